"""The end of a run (--train-iters, or a stop every rank agreed on): under DiLoCo the final
outer step, so every replica ends on the agreed model; the last save; under DiLoCo the
evaluation of the agreed model; the end-of-run summary.

Every rank arrives here at the same iteration, so the collectives that cross between
replicas here (the last flag exchange, the final outer exchanges, the save, the summary)
line up on every rank."""

from __future__ import annotations

from loco_megatron.training.after_step import eval_due, run_eval, save, save_due
from loco_megatron.training.console import say
from loco_megatron.training.health import RunAborted
from loco_megatron.training.signals import StopRequest, decide
from loco_megatron.training.summary import RunTotals, end_summary


def end_of_run(run, window: dict, totals: RunTotals, last: dict, stop: StopRequest) -> dict:
    """Returns rank 0's last logged metrics; RunAborted when a replica's skip guard gave up
    (nothing saved) or the torchrun agent is gone (saved first)."""
    config, layout, state, ckpt = run.config, run.layout, run.state, run.ckpt
    if totals.start_iteration == config.train.train_iters:  # resumed at --train-iters: nothing to train or save
        say(layout, f"nothing to train: resumed at iteration {state.iteration}, which is --train-iters")
    else:
        if run.outer is not None:
            # A replica's abort or stop that no outer step carried yet: known to all now.
            agreed = run.flags.final(run.flags.flags(stop.wish(), run.guard.abort is not None))
            decide(agreed, stop, run.guard.abort, layout.replicas)
            final_outer_step(run, totals)
        if ckpt.save_root and (run.outer is not None or not save_due(config, state.iteration)):
            save(run, window)
        ckpt.wait()  # the last (or stop-requested) save is committed before exit
        if run.outer is not None:  # (after the save, which keeps the local parameters for a resume)
            run.outer.take_final()
            if eval_due(config, state.iteration):
                evaluated = run_eval(config, run.chunks, run.valid_ds, layout, run.device, state, run.logger)
                totals.note(state.iteration, evaluated)
                last.update(evaluated)
    for timing in ckpt.take_timings():
        run.logger.log(state.iteration, timing)
    summary = totals.across_ranks(state, run.device, run.env.started_at)  # collective: every rank
    coordinator = getattr(run.outer, "coordinator", None)
    if coordinator is not None:  # elastic DiLoCo: this replica's part in the run
        summary["summary/diloco_outer_steps_taken_part"] = coordinator.took_part
        summary["summary/diloco_outer_steps_committed"] = coordinator.committed
        summary["summary/diloco_inner_steps"] = run.outer.inner_steps
        summary["summary/diloco_outer_wait_s"] = run.outer.waited_total_s
        summary["summary/diloco_outer_wait_share"] = run.outer.waited_total_s / max(summary["summary/wall_s"], 1e-9)
    if layout.is_logging_rank:
        print(end_summary(summary, ckpt.save_root, layout.world_size), flush=True)
        if coordinator is not None:
            # (the counts of this job and those of the replica since the run began, each named)
            print(f"  DiLoCo replica {config.diloco.diloco_replica_id}: took part in {coordinator.took_part} of the "
                  f"{coordinator.committed} outer steps committed while it was live ({run.outer.outer_steps} in the "
                  f"run); this job: {run.outer.inner_steps} inner steps from iteration {totals.start_iteration}, "
                  f"{summary['summary/tokens']:,} tokens, {summary['summary/diloco_outer_wait_s']:.1f} s at outer "
                  f"steps ({100 * summary['summary/diloco_outer_wait_share']:.1f}% of its wall time)", flush=True)
        run.logger.summary(state.iteration, summary)
    if stop.orphaned:  # saved like any stop, but no launcher is left to end the job: fail it
        raise RunAborted(f"{stop.orphaned} at iteration {state.iteration}")
    unfinished = getattr(run.outer, "unfinished", "")
    if unfinished:  # elastic DiLoCo with no agreed model to end on: saved (this replica's training), not a result
        saved = f"; the checkpoint at iteration {state.iteration} keeps this replica's training" if ckpt.save_root else ""
        if getattr(run.outer, "ended", False):  # (the run's model is the one its last quorum ended on)
            raise RunAborted(f"{unfinished}{saved} (the export refuses it as the run's model)")
        raise RunAborted(f"{unfinished}{saved}; resume it with --load once the other replicas can take part")
    return last


def final_outer_step(run, totals: RunTotals) -> None:
    """DiLoCo's final outer step (:meth:`~loco_megatron.diloco.outer.OuterStep.finish`),
    its bytes counted in the summary, and one line saying what it did."""
    t = run.state.iteration
    if run.config.diloco.elastic:  # a replica that stops early leaves alone: no exchange with the others
        done = run.outer.finish(t, exchange=t == run.config.train.train_iters)
    else:
        done = run.outer.finish(t)
    comm, _ = run.comm_stats.take()
    totals.add_step(comm)
    what = (f"exchanged fragment(s) {', '.join(map(str, done['exchanged']))}" if done["exchanged"]
            else "nothing to exchange")
    applied = f", applied {done['in_flight']} exchange(s) in flight" if done["in_flight"] else ""
    sent = f", {comm['comm/outer_bytes_sent'] / 2**20:.2f} MiB sent by rank 0" if done["exchanged"] else ""
    if run.outer.final is None:  # (elastic: no agreed model to end on; end_of_run says why, after the save)
        return
    if run.config.diloco.elastic and t != run.config.train.train_iters:
        say(run.layout, f"DiLoCo: replica {run.config.diloco.diloco_replica_id} stops alone at iteration {t} (the "
                        f"others train on): it ends on the agreed parameters of its last outer step (saved as "
                        f"diloco.final, which the export reads)")
        return
    say(run.layout, f"DiLoCo: final outer step at iteration {t}: {what}{applied}{sent}; every replica takes the "
                    f"agreed parameters (saved as diloco.final, which the export reads)")
