"""``train()``: set-up, the loop, evaluation, metrics and checkpoints, top to bottom."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from typing import Callable, Optional

import torch

from loco_megatron.checkpoint import Checkpointer
from loco_megatron.checkpoint.model_shape import model_shape
from loco_megatron.cli import LaunchEnv
from loco_megatron.config import Config, ConfigError
from loco_megatron.data.dataset import MicroBatchIterator, build_datasets, resolve_data
from loco_megatron.diloco.layout import check_replicas, describe as describe_replicas
from loco_megatron.diloco.setup import build_outer_step
from loco_megatron.distributed import ParallelLayout, init_distributed, shutdown_distributed
from loco_megatron.loco.collectives import TORCH_OPS
from loco_megatron.loco.hooks import GradSyncHook
from loco_megatron.loco.hooks.fsdp import fsdp_factories
from loco_megatron.loco.hooks import ParamGatherHook
from loco_megatron.loco.tp_replicas import ReplicaGradAverage, needs_replica_average, tp_replicated_params
from loco_megatron.metrics.comm import CommStats, clock_for
from loco_megatron.metrics.logger import MetricsLogger
from loco_megatron.metrics.variant import variant
from loco_megatron.model import build_model, padded_vocab_size
from loco_megatron.optimizer import build_optimizer, build_scheduler
from loco_megatron.platform import Platform, detect_platform, platform_context
from loco_megatron.training.flops import throughput_for
from loco_megatron.training.health import RunAborted, SkipGuard
from loco_megatron.training.kernels import BackgroundBuild, agree_kernels, resolve_loco_kernels
from loco_megatron.training.log_window import (accumulate, accumulate_param, log_window, param_sums_across_ranks,
                                               reduce_for_logging)
from loco_megatron.training.preflight import check_start
from loco_megatron.training.profiling import Profiler
from loco_megatron.training.schedule import ResumedSchedule, check_train_iters
from loco_megatron.training.signals import StopRequest
from loco_megatron.training.summary import RunTotals, end_summary, memory_line, startup_summary
from loco_megatron.training.state import FsdpModelState, FsdpOptimizerState, ModelState, OptimizerState, TrainerState
from loco_megatron.training.step import evaluate, train_step
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
    cache_dir = config.data.data_cache_path or str(pathlib.Path(env.cache_home) / "loco_megatron")
    sources = resolve_data(config, cache_dir, _rank0_print(env.rank == 0), env.hf_hub_offline)
    precheck = Checkpointer(config.checkpoint.save, config.checkpoint.load, env.rank, {})
    precheck.check_save_target(precheck.find_resume_dir())  # bad --load/--save: fail before any set-up

    platform = detect_platform(env.local_rank)
    asked = config.loco.loco_kernels
    # --loco-kernels cpu may build the C++ kernels here; auto starts a first build in the background.
    config, kernels_why, build = resolve_loco_kernels(config, platform, env, _rank0_print(env.rank == 0))
    with platform_context(platform):
        layout = init_distributed(config, platform, env.rank, env.world_size, env.init_method,
                                  env.distributed_timeout_s, env.store_at if env.agent_store else None,
                                  env.restart_count, env.agents)
        try:
            config, kernels_why = agree_kernels(config, asked, kernels_why, platform.device)
            run = _set_up(config, env, platform, layout, sources, cache_dir, grad_sync_factory, param_sync_factory,
                          outer_step_factory)
            run.build = build
            _start(run, kernels_why)
            return _loop(run)
        except ConfigError as e:
            # After start-up a file may be bad on some ranks only: each reports, unless the
            # ranks agreed on the error in a collective (then rank 0 prints it once).
            e.per_rank = not getattr(e, "agreed", False)
            raise
        finally:
            shutdown_distributed()


def _configure_schedules(model_chunks: list, optimizer, after_finalize: Optional[Callable] = None) -> None:
    """Hooks megatron's schedules call: loss scaling, grad-sync suppression between
    micro batches, and the final wait/reduction of all gradients (then ``after_finalize``,
    e.g. the TP replica average of :mod:`loco_megatron.loco.tp_replicas`)."""
    from megatron.core.distributed import finalize_model_grads

    config = model_chunks[0].config
    config.grad_scale_func = optimizer.scale_loss
    if after_finalize is None:
        config.finalize_model_grads_func = finalize_model_grads
    else:
        def finalize_then(*args, **kwargs):
            out = finalize_model_grads(*args, **kwargs)
            after_finalize()
            return out

        config.finalize_model_grads_func = finalize_then
    # One per chunk with virtual pipeline stages: the interleaved schedule starts each
    # chunk's grad sync as soon as that chunk's last backward is done.
    config.no_sync_func = [c.no_sync for c in model_chunks]
    config.grad_sync_func = [c.start_grad_sync for c in model_chunks]
    if len(model_chunks) == 1:
        config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]


@dataclasses.dataclass
class _Run:
    """What the loop works with, built by :func:`_set_up`."""

    config: Config
    env: LaunchEnv
    layout: ParallelLayout
    device: torch.device
    chunks: list
    optimizer: object
    scheduler: object
    comm_stats: CommStats
    grad_sync: object
    param_sync: object
    outer: Optional[object]
    """DiLoCo's :class:`~loco_megatron.diloco.outer.OuterStep` (None without --diloco-replicas)."""
    profiler: Profiler
    throughput: object
    batches: MicroBatchIterator
    valid_ds: object
    state: TrainerState
    guard: SkipGuard
    stateful: dict
    ckpt: Checkpointer
    resume: Optional[pathlib.Path]
    vocab: int
    """Padded vocabulary size."""
    logger: Optional[MetricsLogger] = None
    build: Optional[BackgroundBuild] = None
    """The C++ kernels' first build, running beside this run (says when it is done)."""


def _layout_key(config: Config, layout: ParallelLayout, vocab: int) -> dict:
    """What a checkpoint records of the layout (--ckpt-format torch loads only into the same)."""
    p = config.parallel
    vpp = p.virtual_pipeline_model_parallel_size or 1
    return {"world_size": layout.world_size, "tp": p.tensor_model_parallel_size,
            "pp": layout.pp_size, "ep": p.expert_model_parallel_size,
            **({"vpp": vpp} if vpp > 1 else {}),
            # (only when folded: checkpoints written before the flag existed stay loadable)
            **({"etp": p.expert_tp} if p.expert_tp != p.tensor_model_parallel_size else {}),
            "model": model_shape(config.model, vocab),
            # megatron's per-rank optimizer state (--ckpt-format torch) only loads into the
            # same buckets: with this in the layout a bucket change is refused in one line.
            "bucket": p.ddp_bucket_size or 0,
            # Megatron-FSDP's shards: its checkpoint (per rank) loads into the same sharding only.
            **({"fsdp": [p.data_parallel_sharding_strategy, p.num_distributed_optimizer_instances]}
               if p.use_megatron_fsdp else {}),
            # DiLoCo: each replica's shards are its own (the same rank order only).
            **({"diloco_replicas": config.diloco.diloco_replicas} if config.diloco.enabled else {})}


def _set_up(config: Config, env: LaunchEnv, platform: Platform, layout: ParallelLayout, sources,
            cache_dir: str, grad_sync_factory: Callable, param_sync_factory: Callable,
            outer_step_factory: Callable) -> _Run:
    """Model, optimizer, the sync hooks, data and state, in the order their dependencies
    need; a resumable checkpoint is found before the model is built and loaded after."""
    d, t, device = config.data, config.train, platform.device
    vocab = padded_vocab_size(sources.tokenizer.vocab_size, config.parallel.tensor_model_parallel_size)
    cc = config.checkpoint
    ckpt = Checkpointer(cc.save, cc.load, layout.rank, _layout_key(config, layout, vocab), device, cc.ckpt_format,
                        cc.async_save, dataclasses.asdict(config), _rank0_print(layout.is_logging_rank))
    # Another model shape (torch format: layout, or a bad rank file) is refused before the build.
    resume = ckpt.find_resume_dir(collective=True)
    chunks = build_model(config, vocab, device)
    optimizer = build_optimizer(config, chunks)
    scheduler = build_scheduler(config, optimizer)
    comm_stats = CommStats(clock_for(device))
    # Before the grad hook, which then times the (compressed) parameter gather.
    if config.parallel.use_megatron_fsdp:
        grad_sync_factory, param_sync_factory = fsdp_factories(grad_sync_factory is GradSyncHook, grad_sync_factory,
                                                               param_sync_factory is ParamGatherHook,
                                                               param_sync_factory, optimizer)
    param_sync = param_sync_factory(chunks, optimizer, config.loco, comm_stats)
    grad_sync = grad_sync_factory(chunks, config.loco, comm_stats)
    outer = outer_step_factory(config, chunks, optimizer, comm_stats, _rank0_print(layout.is_logging_rank))
    replicas = None
    if needs_replica_average(config.loco.loco_bits, config.parallel.tensor_model_parallel_size):
        from megatron.core import parallel_state

        replicas = ReplicaGradAverage(
            tp_replicated_params(chunks, config.parallel.sequence_parallel, chunks[0].config.qk_layernorm),
            parallel_state.get_tensor_model_parallel_group(), getattr(grad_sync, "ops", TORCH_OPS))
    _configure_schedules(chunks, optimizer, replicas)
    profiler = Profiler(config.logging, layout.rank, device)
    profiler.instrument(chunks, grad_sync)

    train_ds, valid_ds = build_datasets(config, sources, cache_dir)
    batches = MicroBatchIterator(train_ds, d.global_batch_size, d.micro_batch_size, layout.dp_rank, layout.dp_size)
    state, guard = TrainerState(), SkipGuard(t.max_skipped_consecutive)
    fsdp = config.parallel.use_megatron_fsdp
    stateful = {"model": (FsdpModelState if fsdp else ModelState)(chunks),
                "optimizer": (FsdpOptimizerState if fsdp else OptimizerState)(optimizer),
                "scheduler": ResumedSchedule(scheduler, config),  # after "optimizer": see its docstring
                "data": batches, "trainer": state, "loco": grad_sync, "health": guard,
                "param_gather": param_sync, **({"diloco": outer} if outer is not None else {})}
    return _Run(config, env, layout, device, chunks, optimizer, scheduler, comm_stats, grad_sync, param_sync, outer,
                profiler, throughput_for(config.model, vocab, layout.world_size, device, config.logging.peak_tflops),
                batches, valid_ds, state, guard, stateful, ckpt, resume, vocab)


def _start(run: _Run, kernels_why: Optional[str]) -> None:
    """Load the checkpoint, open the metrics logger, print the start-up summary."""
    config, layout = run.config, run.layout
    if layout.is_logging_rank:
        line = memory_line(run.grad_sync if config.loco.enabled else None,
                           run.param_sync if config.loco.param_gather_bits else None)
        if line:
            print(line, flush=True)
    if run.resume is not None:
        _print_rank0(layout, f"loading checkpoint {run.resume}")
        run.ckpt.load(run.resume, run.stateful)
        check_train_iters(config.train.train_iters, run.state.iteration, run.resume)
    flat = config.to_flat_dict()
    # resumed_from_iteration marks where a resumed run's records start in an appended jsonl.
    run_config = {**flat, "world_size": layout.world_size, "data_parallel_size": layout.dp_size,
                  "device": run.device.type, "resumed_from_iteration": run.state.iteration, "variant": variant(flat)}
    wandb_id = pathlib.Path(config.checkpoint.save) / "wandb_run_id" if config.checkpoint.save else None
    run.logger = MetricsLogger(config.logging, run_config, layout.is_logging_rank, run.env.wandb_offline,
                               wandb_dir=run.env.wandb_dir, wandb_id_file=wandb_id)
    if layout.is_logging_rank:
        report = getattr(run.grad_sync, "memory_report", None)
        print(startup_summary(config, layout, run.chunks, run.vocab, kernels_why,
                              report()["params"] if report and config.loco.enabled else None), flush=True)
        if config.diloco.enabled:
            print(describe_replicas(config, layout.world_size), flush=True)
        print(f"{run.ckpt.start_note} at iteration {run.state.iteration}", flush=True)
        if run.stateful["scheduler"].note:
            print(run.stateful["scheduler"].note, flush=True)
    for timing in run.ckpt.take_timings():  # ckpt/load_s
        run.logger.log(run.state.iteration, timing)


def _loop(run: _Run) -> dict:
    """Train until --train-iters or an agreed stop; save; the end-of-run summary. Returns
    rank 0's last logged metrics."""
    config, layout, state, ckpt, t = run.config, run.layout, run.state, run.ckpt, run.config.train
    d, device = config.data, run.device
    tokens_per_step = d.global_batch_size * config.model.seq_length
    last: dict = {}
    window = {"loss": torch.zeros((), device=device), "steps": 0, "t0": time.perf_counter(),
              "grad_norm": None, "skipped": 0, "comm": {}, "loco": None, "param": None}
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
            if watchdog:
                watchdog.iteration = state.iteration
            if run.outer is not None:  # DiLoCo: the outer step, where the schedule puts one
                run.outer.after_step(state.iteration)
            run.profiler.after_step(state.iteration)
            state.tokens_seen += tokens_per_step
            state.train_time_s += time.perf_counter() - t_step
            comm, loco_sums = run.comm_stats.take()
            totals.add_step(comm)
            accumulate(window, result, comm, loco_sums)
            accumulate_param(window, run.comm_stats)
            # The stop decision and the skip guard's input, agreed in one tiny all-reduce.
            reason, skipped = stop.agreed(device, result.skipped)
            last = _log_eval_save(run, window, totals, last, tokens_per_step, skipped)
            if reason:
                if layout.is_logging_rank:
                    what = "saving at" if ckpt.save_root else "no --save, nothing saved; stopping at"
                    print(f"stop requested ({reason}): {what} iteration {state.iteration}", flush=True)
                _print_rank0(layout, ckpt.finish_in_flight(agreed=True))  # every rank agreed to stop here
                break
        if run.outer is not None:  # no outer exchange outlives the run (a save also settles them)
            run.outer.settle()
        if totals.start_iteration == config.train.train_iters:  # resumed at --train-iters: nothing to train or save
            _print_rank0(layout, f"nothing to train: resumed at iteration {state.iteration}, which is --train-iters")
        elif ckpt.save_root and not _save_due(config, state.iteration):
            _save(run, window)
        ckpt.wait()  # the last (or stop-requested) save is committed before exit
        for timing in ckpt.take_timings():
            run.logger.log(state.iteration, timing)
        summary = totals.across_ranks(state, device, run.env.started_at)  # collective: every rank
        if layout.is_logging_rank:
            print(end_summary(summary, ckpt.save_root, layout.world_size), flush=True)
            run.logger.summary(state.iteration, summary)
        if stop.orphaned:  # saved like any stop, but no launcher is left to end the job: fail it
            raise RunAborted(f"{stop.orphaned} at iteration {state.iteration}")
    except RunAborted:  # every rank raises it at the same step: the in-flight save can be finalized
        _print_rank0(layout, ckpt.finish_in_flight(agreed=True))
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
    return last


def _save_due(config: Config, iteration: int) -> bool:
    interval = config.checkpoint.save_interval
    return bool(interval and iteration % interval == 0)


def _log_eval_save(run: _Run, window: dict, totals: RunTotals, last: dict, tokens_per_step: int,
                   skipped: bool) -> dict:
    """After a step: the log window, evaluation, the skip guard and the periodic save, where
    due. Returns rank 0's last logged metrics."""
    config, state, t = run.config, run.state, run.config.train
    if state.iteration % config.logging.log_interval == 0 or state.iteration == t.train_iters:
        last = log_window(window, state, run.optimizer, run.layout, run.device, tokens_per_step, run.logger,
                          t.train_iters, run.throughput, bool(config.loco.param_gather_bits), run.outer)
        totals.note(state.iteration, last)
        if run.build is not None:
            run.build.poll()
    if t.eval_interval and (state.iteration % t.eval_interval == 0 or state.iteration == t.train_iters):
        evaluated = _run_eval(config, run.chunks, run.valid_ds, run.layout, run.device, state, run.logger)
        totals.note(state.iteration, evaluated)
        last.update(evaluated)
    run.guard.update(state.iteration, skipped)  # RunAborted: leave before saving
    run.ckpt.poll()  # commits a finished background write (--async-save)
    if run.ckpt.save_root and _save_due(config, state.iteration):
        _save(run, window)
    for timing in run.ckpt.take_timings():
        run.logger.log(state.iteration, timing)
    return last


def _print_rank0(layout: ParallelLayout, line: str) -> None:
    if line and layout.is_logging_rank:
        print(line, flush=True)


def _rank0_print(is_logging_rank: bool) -> Callable[[str], None]:
    return (lambda line: print(line, flush=True)) if is_logging_rank else (lambda line: None)


def _save(run: _Run, window: dict) -> None:
    config, state, layout = run.config, run.state, run.layout
    if run.resume is None and run.guard.last_good == 0:
        # Every step so far was skipped (found-inf, agreed by all ranks), so the optimizer has
        # no moments yet and its state cannot be written (KeyError 'exp_avg' / 'step'); the
        # run may still recover, so skip this save rather than end it.
        _print_rank0(layout, f"checkpoint: iteration {state.iteration} not saved: no optimizer step has "
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


def _run_eval(config: Config, chunks: list, valid_ds, layout: ParallelLayout, device,
              state: TrainerState, logger: MetricsLogger) -> dict:
    d, t = config.data, config.train
    if not t.eval_iters:
        return {}
    # The same validation samples at every evaluation, so evaluations compare.
    it = MicroBatchIterator(valid_ds, d.global_batch_size, d.micro_batch_size, layout.dp_rank, layout.dp_size)
    steps = [it.step() for _ in range(t.eval_iters)]
    loss = evaluate(chunks, steps, it.num_microbatches, config.model.seq_length, d.micro_batch_size, device)
    value = reduce_for_logging(loss if loss is not None else torch.zeros((), device=device), layout)
    metrics = {"eval/lm_loss": value, "eval/ppl": math.exp(min(value, 50.0))}
    logger.log(state.iteration, metrics)
    return metrics
