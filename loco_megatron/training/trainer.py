"""``train()``: set-up, the loop, evaluation, metrics and checkpoints, top to bottom."""

from __future__ import annotations

import pathlib
import time
from typing import Callable

from loco_megatron.checkpoint import Checkpointer
from loco_megatron.cli import LaunchEnv
from loco_megatron.config import Config, ConfigError
from loco_megatron.data.dataset import resolve_data
from loco_megatron.diloco.layout import check_replicas
from loco_megatron.diloco.setup import build_outer_step
from loco_megatron.distributed import init_distributed, shutdown_distributed
from loco_megatron.loco.hooks import GradSyncHook, ParamGatherHook
from loco_megatron.platform import detect_platform, platform_context
from loco_megatron.training.after_step import eval_and_save, log_if_due, new_window
from loco_megatron.training.console import say, say_fn
from loco_megatron.training.health import RunAborted
from loco_megatron.training.kernels import agree_kernels, resolve_loco_kernels
from loco_megatron.training.log_window import accumulate, accumulate_param
from loco_megatron.training.preflight import check_start
from loco_megatron.training.run_end import end_of_run
from loco_megatron.training.setup import Run, set_up, start
from loco_megatron.training.signals import StopRequest, decide
from loco_megatron.training.step import train_step
from loco_megatron.training.summary import RunTotals
from loco_megatron.training.watchdog import watchdog_for


def train(config: Config, env: LaunchEnv, grad_sync_factory: Callable = GradSyncHook,
          param_sync_factory: Callable = ParamGatherHook, outer_step_factory: Callable = build_outer_step) -> dict:
    """Run the configured pretraining; returns rank 0's last logged metrics.

    ``grad_sync_factory(model_chunks, loco_config, comm_stats)`` installs the gradient
    sync (LoCo or timed megatron), ``param_sync_factory(model_chunks, optimizer,
    loco_config, comm_stats)`` the parameter all-gather (--param-gather-bits),
    ``outer_step_factory(config, model_chunks, optimizer, comm_stats, log)`` DiLoCo's outer
    step (None without --diloco-replicas); pass other callables to swap them out.
    """
    # Everything that can be validated without the process group is, before it exists
    # (the layout checks are the ones --dry-run makes).
    check_start(config, env.world_size)
    check_replicas(config, env.world_size, config.loco.loco_ranks_per_node or env.local_world_size)
    if config.diloco.elastic:  # no lighthouse there, or its run ended: one line within seconds, before any set-up
        from loco_megatron.diloco.elastic.lighthouse import check_lighthouse

        check_lighthouse(config.diloco.diloco_lighthouse, config.train.train_iters)
    cache_dir = config.data.data_cache_path or str(pathlib.Path(env.cache_home) / "loco_megatron")
    sources = resolve_data(config, cache_dir, say_fn(env.rank == 0), env.hf_hub_offline)
    precheck = Checkpointer(config.checkpoint.save, config.checkpoint.load, env.rank, {})
    precheck.check_save_target(precheck.find_resume_dir())  # bad --load/--save: fail before any set-up

    platform = detect_platform(env.local_rank)
    asked = config.loco.loco_kernels
    # --loco-kernels cpu may build the C++ kernels here; auto starts a first build in the background.
    config, kernels_why, build = resolve_loco_kernels(config, platform, env, say_fn(env.rank == 0))
    with platform_context(platform):
        layout = init_distributed(config, platform, env.rank, env.world_size, env.init_method,
                                  env.distributed_timeout_s, env.store_at if env.agent_store else None,
                                  env.restart_count, env.agents)
        try:
            config, kernels_why = agree_kernels(config, asked, kernels_why, platform.device)
            run = set_up(config, env, platform, layout, sources, cache_dir, grad_sync_factory, param_sync_factory,
                         outer_step_factory)
            run.build = build
            start(run, kernels_why)
            return _loop(run)
        except ConfigError as e:
            # After start-up a file may be bad on some ranks only: each reports, unless the
            # ranks agreed on the error in a collective (then rank 0 prints it once).
            e.per_rank = not getattr(e, "agreed", False)
            raise
        finally:
            shutdown_distributed()


def _loop(run: Run) -> dict:
    """Train until --train-iters or an agreed stop, then end the run (:func:`end_of_run`:
    DiLoCo's final outer step, the save, the summary). Returns rank 0's last logged metrics."""
    config, layout, state, ckpt, t = run.config, run.layout, run.state, run.ckpt, run.config.train
    d, device = config.data, run.device
    last: dict = {}
    window = new_window(device, run.outer)
    stop = StopRequest(t.stop_file, layout.is_logging_rank, run.env.started_at, launcher_pid=run.env.launcher_pid)
    totals = RunTotals(state.iteration, state.tokens_seen, state.train_time_s)
    stop.discard_stale_file()
    stop.install()
    watchdog = watchdog_for(run.env, t, layout.rank, layout.world_size)  # a silent rank ends the job in one line
    if watchdog:
        watchdog.start()
    try:
        while state.iteration < t.train_iters:
            run.grad_sync.iteration = state.iteration  # drives --loco-warmup-iters
            run.profiler.before_step(state.iteration + 1)
            t_step = time.perf_counter()
            result = train_step(run.chunks, run.optimizer, run.scheduler, run.batches.step(),
                                run.batches.num_microbatches, config.model.seq_length, d.micro_batch_size, device,
                                poison=t.nan_poisoned(state.iteration + 1, layout.rank), ranges=run.profiler.ranges)
            state.iteration += 1
            # (elastic DiLoCo: this job's share of the global batch, which the batch split may move)
            tokens_per_step = run.batches.samples * config.model.seq_length
            if watchdog:
                watchdog.iteration = state.iteration
            if run.outer is not None:  # DiLoCo: the outer step, where the schedule puts one
                run.outer.count_step(time.perf_counter() - t_step)
                run.outer.after_step(state.iteration)
            run.profiler.after_step(state.iteration)
            state.tokens_seen += tokens_per_step
            window["tokens"] += tokens_per_step
            state.train_time_s += time.perf_counter() - t_step
            comm, loco_sums = run.comm_stats.take()
            totals.add_step(comm)
            accumulate(window, result, comm, loco_sums)
            accumulate_param(window, run.comm_stats)
            # The stop wish and the skip guard's input, agreed inside the replica (the whole
            # world without DiLoCo) in one tiny all-reduce: no step waits on another site.
            _, skipped = stop.agreed(device, result.skipped, layout.replica_group())
            last = log_if_due(run, window, totals, last, tokens_per_step)
            run.guard.update(state.iteration, skipped)  # RunAborted here unless DiLoCo defers it
            # Between replicas the decision is made at their outer steps only (every step without).
            agreed = run.flags.after_step(state.iteration, run.flags.flags(stop.wish(), run.guard.abort is not None))
            reason = decide(agreed, stop, run.guard.abort, layout.replicas) if agreed is not None else None
            if reason is None and getattr(run.outer, "ended", False):  # (elastic: decided alike on every rank)
                reason = "the run reached --train-iters without this replica"
            if not (run.outer is not None and (reason or state.iteration == t.train_iters)):
                last = eval_and_save(run, window, totals, last)  # (DiLoCo's last step: after its final outer step)
            if reason:
                if layout.is_logging_rank:
                    what = "saving at" if ckpt.save_root else "no --save, nothing saved; stopping at"
                    print(f"stop requested ({reason}): {what} iteration {state.iteration}", flush=True)
                say(layout, ckpt.finish_in_flight(agreed=True))  # every rank agreed to stop here
                break
        last = end_of_run(run, window, totals, last, stop)
    except RunAborted:  # every rank raises it at the same step: the in-flight save can be finalized
        say(layout, ckpt.finish_in_flight(agreed=True))
        raise
    except BaseException:  # maybe on this rank only: no collective, but let the background write end
        note = ckpt.finish_in_flight(agreed=False)
        if note:
            print(note, flush=True)
        raise
    finally:
        if watchdog:
            watchdog.stop()
        stop.restore()
        run.profiler.close()
        run.logger.close()
        if getattr(run.outer, "coordinator", None) is not None:
            run.outer.coordinator.shutdown()
    return last
