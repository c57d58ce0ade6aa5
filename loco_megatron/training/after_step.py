"""What follows a training step: the log window, evaluation, the periodic save (and the
--async-save commit), and the stop decision's console line.

Collectives, in this order on every rank: the log window's (inside the replica under
DiLoCo: :mod:`.log_window`), the evaluation's (likewise), the background write's commit
and the save (the whole world: a checkpoint holds every replica)."""

from __future__ import annotations

import math
import time

import torch

from loco_megatron.config import Config
from loco_megatron.data.dataset import MicroBatchIterator
from loco_megatron.distributed import ParallelLayout
from loco_megatron.loco.hooks import ParamGatherHook
from loco_megatron.metrics.logger import MetricsLogger
from loco_megatron.training.console import say
from loco_megatron.training.log_window import accumulate_param, log_window, param_sums_across_ranks, reduce_for_logging
from loco_megatron.training.state import TrainerState
from loco_megatron.training.step import evaluate
from loco_megatron.training.summary import RunTotals


def new_window(device: torch.device, outer=None) -> dict:
    """An empty log window (figures accumulated on the device between two log lines)."""
    return {"loss": torch.zeros((), device=device), "steps": 0, "t0": time.perf_counter(), "grad_norm": None,
            "skipped": 0, "comm": {}, "loco": None, "param": None, "tokens": 0,
            "outer_steps": outer.outer_steps if outer is not None else 0}


def log_due(run, iteration: int) -> bool:
    """A log line at every --log-interval, at --train-iters, and under DiLoCo at every step
    that applied an outer step (so its line shows it)."""
    return (iteration % run.config.logging.log_interval == 0 or iteration == run.config.train.train_iters
            or (run.outer is not None and run.outer.steps_at(iteration)))


def log_if_due(run, window: dict, totals: RunTotals, last: dict, tokens_per_step: int) -> dict:
    """The log window, where due. Returns rank 0's last logged metrics."""
    config, state, t = run.config, run.state, run.config.train
    if not log_due(run, state.iteration):
        return last
    last = log_window(window, state, run.optimizer, run.layout, run.device, tokens_per_step, run.logger,
                      t.train_iters, run.throughput, bool(config.loco.param_gather_bits), run.comm_stats, run.outer)
    totals.note(state.iteration, last)
    if run.build is not None:
        run.build.poll()
    return last


def eval_due(config: Config, iteration: int) -> bool:
    t = config.train
    return bool(t.eval_interval and (iteration % t.eval_interval == 0 or iteration == t.train_iters))


def save_due(config: Config, iteration: int) -> bool:
    interval = config.checkpoint.save_interval
    return bool(interval and iteration % interval == 0)


def eval_and_save(run, window: dict, totals: RunTotals, last: dict) -> dict:
    """After a step that does not end the run: evaluation and the periodic save, where due.
    Under DiLoCo a finished background write is committed only at a step where the
    replicas exchange anyway (megatron's commit is a collective over every rank)."""
    config, state = run.config, run.state
    if eval_due(config, state.iteration):
        evaluated = run_eval(config, run.chunks, run.valid_ds, run.layout, run.device, state, run.logger)
        totals.note(state.iteration, evaluated)
        last.update(evaluated)
    if run.outer is None or run.flags.is_sync_point(state.iteration):
        run.ckpt.poll()  # commits a finished background write (--async-save)
    if run.ckpt.save_root and save_due(config, state.iteration):
        save(run, window)
    for timing in run.ckpt.take_timings():
        run.logger.log(state.iteration, timing)
    return last


def save(run, window: dict) -> None:
    config, state, layout = run.config, run.state, run.layout
    if run.resume is None and run.guard.last_good == 0:
        # Every step so far was skipped (found-inf, agreed by all ranks), so the optimizer has
        # no moments yet and its state cannot be written (KeyError 'exp_avg' / 'step'); the
        # run may still recover, so skip this save rather than end it.
        say(layout, f"checkpoint: iteration {state.iteration} not saved: no optimizer step has "
                    f"succeeded yet (every step skipped for NaN/Inf), so there is no optimizer state")
        return
    if config.parallel.overlap_param_gather:
        # The all-gather of the updated params is deferred to the next forward; finish it
        # now so the saved model weights are the ones the optimizer just produced.
        for chunk in run.chunks:
            chunk.start_param_sync(force_sync=True)
    if config.loco.param_gather_bits:  # never save weights a non-finite update was withheld from
        accumulate_param(window, run.comm_stats)
        ParamGatherHook.check_finite(param_sums_across_ranks(window, run.device)[2].item(), state.iteration)
    if run.outer is not None:  # the outer exchanges in flight complete; their means are saved
        run.outer.settle()
    run.ckpt.save(state.iteration, run.stateful)


def run_eval(config: Config, chunks: list, valid_ds, layout: ParallelLayout, device,
             state: TrainerState, logger: MetricsLogger) -> dict:
    """The validation loss over --eval-iters steps of the same samples every time (so
    evaluations compare). Under DiLoCo each replica evaluates all of them on its own ranks
    (its model is its own between outer steps), and rank 0 logs replica 0's."""
    d, t = config.data, config.train
    if not t.eval_iters:
        return {}
    it = MicroBatchIterator(valid_ds, d.global_batch_size, d.micro_batch_size, layout.inner_dp_rank,
                            layout.inner_dp_size)
    steps = [it.step() for _ in range(t.eval_iters)]
    loss = evaluate(chunks, steps, it.num_microbatches, config.model.seq_length, d.micro_batch_size, device)
    value = reduce_for_logging(loss if loss is not None else torch.zeros((), device=device), layout)
    metrics = {"eval/lm_loss": value, "eval/ppl": math.exp(min(value, 50.0))}
    logger.log(state.iteration, metrics)
    return metrics
