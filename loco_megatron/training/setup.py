"""Set-up: the model, optimizer, sync hooks, data and state a run works with (:class:`Run`),
in the order their dependencies need, and the start (checkpoint load, logger, start-up lines)."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Optional

import torch

from loco_megatron.checkpoint import Checkpointer
from loco_megatron.checkpoint.model_shape import model_shape
from loco_megatron.cli import LaunchEnv
from loco_megatron.config import Config, ConfigError
from loco_megatron.data.dataset import MicroBatchIterator, build_datasets
from loco_megatron.diloco.elastic.split import Share, fixed_share
from loco_megatron.diloco.flags import ReplicaFlags, cross_replica_gloo_group
from loco_megatron.diloco.layout import describe as describe_replicas
from loco_megatron.distributed import ParallelLayout
from loco_megatron.loco.collectives import TORCH_OPS
from loco_megatron.loco.hooks import GradSyncHook, ParamGatherHook
from loco_megatron.loco.hooks.fsdp import fsdp_factories
from loco_megatron.loco.tp_replicas import ReplicaGradAverage, needs_replica_average, tp_replicated_params
from loco_megatron.metrics.comm import CommStats, clock_for
from loco_megatron.metrics.logger import MetricsLogger
from loco_megatron.metrics.variant import variant
from loco_megatron.model import build_model, padded_vocab_size
from loco_megatron.optimizer import build_optimizer, build_scheduler
from loco_megatron.platform import Platform
from loco_megatron.training.console import say, say_fn
from loco_megatron.training.flops import throughput_for
from loco_megatron.training.health import SkipGuard
from loco_megatron.training.kernels import BackgroundBuild
from loco_megatron.training.profiling import Profiler
from loco_megatron.training.schedule import ResumedSchedule, check_train_iters
from loco_megatron.training.state import FsdpModelState, FsdpOptimizerState, ModelState, OptimizerState, TrainerState
from loco_megatron.training.summary import memory_line, startup_summary


def configure_schedules(model_chunks: list, optimizer, after_finalize: Optional[Callable] = None) -> None:
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
class Run:
    """What the loop works with, built by :func:`set_up`."""

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
    flags: Optional[ReplicaFlags] = None
    """The stop/abort decision: every step without DiLoCo, at the replicas' outer steps with it."""


def layout_key(config: Config, layout: ParallelLayout, vocab: int) -> dict:
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
            # --bf16 with torch norms: since they are bf16 too (model._torch_modules_to_bf16) they
            # share the other parameters' buffers; older checkpoints' per-rank optimizer state
            # (--ckpt-format torch) had them in a buffer of their own: refused in one line.
            **({"bf16_norms": True} if config.model.bf16 and config.model.transformer_impl == "local" else {}),
            # Megatron-FSDP's shards: its checkpoint (per rank) loads into the same sharding only.
            **({"fsdp": [p.data_parallel_sharding_strategy, p.num_distributed_optimizer_instances]}
               if p.use_megatron_fsdp else {}),
            # DiLoCo: each replica's shards are its own (the same rank order only).
            **({"diloco_replicas": config.diloco.replicas_in_world} if config.diloco.enabled else {}),
            # Another optimizer's state cannot be resumed (only when not AdamW: older checkpoints have none).
            **({"optimizer": config.optimizer.optimizer} if config.optimizer.optimizer != "adam" else {})}


def set_up(config: Config, env: LaunchEnv, platform: Platform, layout: ParallelLayout, sources,
            cache_dir: str, grad_sync_factory: Callable, param_sync_factory: Callable,
            outer_step_factory: Callable) -> Run:
    """Model, optimizer, the sync hooks, data and state, in the order their dependencies
    need; a resumable checkpoint is found before the model is built and loaded after."""
    d, t, device = config.data, config.train, platform.device
    vocab = padded_vocab_size(sources.tokenizer.vocab_size, config.parallel.tensor_model_parallel_size)
    cc = config.checkpoint
    ckpt = Checkpointer(cc.save, cc.load, layout.rank, layout_key(config, layout, vocab), device, cc.ckpt_format,
                        cc.async_save, dataclasses.asdict(config), say_fn(layout.is_logging_rank))
    # Another model shape (torch format: layout, or a bad rank file) is refused before the build.
    resume = ckpt.find_resume_dir(collective=True)
    chunks = build_model(config, vocab, device)
    comm_stats = CommStats(clock_for(device))
    optimizer = build_optimizer(config, chunks, comm_stats)
    scheduler = build_scheduler(config, optimizer)
    # Before the grad hook, which then times the (compressed) parameter gather.
    if config.parallel.use_megatron_fsdp:
        grad_sync_factory, param_sync_factory = fsdp_factories(grad_sync_factory is GradSyncHook, grad_sync_factory,
                                                               param_sync_factory is ParamGatherHook,
                                                               param_sync_factory, optimizer)
    param_sync = param_sync_factory(chunks, optimizer, config.loco, comm_stats)
    grad_sync = grad_sync_factory(chunks, config.loco, comm_stats)
    coordinator = elastic_coordinator(config, env, layout, device) if config.diloco.elastic else None
    outer = outer_step_factory(config, chunks, optimizer, comm_stats, say_fn(layout.is_logging_rank),
                               **({"coordinator": coordinator} if coordinator is not None else {}))
    replicas = None
    if needs_replica_average(config.loco.loco_bits, config.parallel.tensor_model_parallel_size):
        from megatron.core import parallel_state

        replicas = ReplicaGradAverage(
            tp_replicated_params(chunks, config.parallel.sequence_parallel, chunks[0].config.qk_layernorm),
            parallel_state.get_tensor_model_parallel_group(), getattr(grad_sync, "ops", TORCH_OPS))
    configure_schedules(chunks, optimizer, replicas)
    profiler = Profiler(config.logging, layout.rank, device)
    profiler.instrument(chunks, grad_sync, optimizer)

    train_ds, valid_ds = build_datasets(config, sources, cache_dir)
    # Elastic DiLoCo: this job trains its replica's share of each step's global batch (fixed:
    # replica r of R, as in a one-world run; other splits are agreed at the first outer step).
    # (until then the whole batch: what a replica left alone at the start trains)
    fixed = coordinator is not None and config.diloco.diloco_batch_split == "fixed"
    share = fixed_share(config.diloco.diloco_replica_id, config.diloco.diloco_replicas, d.global_batch_size) \
        if fixed else Share(0, d.global_batch_size)
    batches = MicroBatchIterator(train_ds, d.global_batch_size, d.micro_batch_size, layout.dp_rank, layout.dp_size,
                                 share=(share.offset, share.samples))
    # Several replicas: each one's guard only records its verdict, which the replicas
    # agree on at an outer step (a replica raising alone would leave the others waiting).
    state, guard = TrainerState(), SkipGuard(t.max_skipped_consecutive, defer=layout.replicas > 1)
    flags = ReplicaFlags(cross_replica_gloo_group(layout.replicas) if layout.replicas > 1 else None,
                         outer.schedule if outer is not None else None, layout.replica)
    fsdp = config.parallel.use_megatron_fsdp
    stateful = {"model": (FsdpModelState if fsdp else ModelState)(chunks),
                "optimizer": (FsdpOptimizerState if fsdp else OptimizerState)(optimizer),
                "scheduler": ResumedSchedule(scheduler, config),  # after "optimizer": see its docstring
                "data": batches, "trainer": state, "loco": grad_sync, "health": guard,
                "param_gather": param_sync, **({"diloco": outer} if outer is not None else {})}
    return Run(config, env, layout, device, chunks, optimizer, scheduler, comm_stats, grad_sync, param_sync, outer,
                profiler, throughput_for(config.model, vocab, layout.world_size, device, config.logging.peak_tflops),
                batches, valid_ds, state, guard, stateful, ckpt, resume, vocab, flags=flags)


def elastic_coordinator(config: Config, env: LaunchEnv, layout: ParallelLayout, device: torch.device):
    """This rank's :class:`~loco_megatron.diloco.elastic.ElasticCoordinator` (its torchft
    Manager starts at the first cycle)."""
    from loco_megatron.diloco.elastic.coordinator import ElasticCoordinator

    d = config.diloco
    if env.store_at is None:
        raise ConfigError("--diloco-lighthouse: start each replica with torchrun (its Manager needs the job's "
                          "store: MASTER_ADDR and MASTER_PORT)")
    from loco_megatron.diloco.elastic.lanes import hosts

    lanes = d.diloco_outer_ranks or 1  # (the default: one lane, which a job of any size hosts)
    placed = hosts(layout.world_size, lanes)
    # (gloo: the cycle's decisions are small objects, whatever the job's own backend). Its
    # timeout covers the longest a lane host can be away between two of its collectives (a
    # quorum, then a collective between replicas): the other ranks wait there meanwhile.
    import datetime

    away = d.diloco_quorum_timeout_s + 2 * d.diloco_exchange_timeout_s + 60
    control = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=away))
    return ElasticCoordinator(d.diloco_lighthouse, d.diloco_replica_id, d.diloco_replicas,
                              layout.rank, placed.index(layout.rank) if layout.rank in placed else None, lanes,
                              env.store_at, control, device, d.diloco_quorum_timeout_s, d.diloco_exchange_timeout_s,
                              say_fn(layout.is_logging_rank), env.torchft_log)


def bind_heal(run: Run) -> None:
    """Elastic DiLoCo: what a heal sends besides the outer state (the iteration and the LR
    schedule's position) and how this replica takes it (its data position follows the
    iteration: replica r's samples of iteration t are fixed)."""
    state, scheduler, batches, layout = run.state, run.scheduler, run.batches, run.layout

    def progress() -> dict:
        return {"iteration": state.iteration, "scheduler_steps": scheduler.num_steps}

    def take(theirs: dict, kept: bool) -> None:
        state.iteration = int(theirs["iteration"])
        scheduler.num_steps = int(theirs["scheduler_steps"])
        scheduler.step(increment=0)  # the learning rate of that position
        batches.consumed_samples = state.iteration * batches.gbs
        if kept:
            whose = "this replica's own, kept from its training so far"
        else:
            whose = f"this replica's own, from {run.resume}" if run.resume else "fresh (no checkpoint of this replica)"
        say(layout, f"DiLoCo: the inner optimizer state is {whose}")

    run.outer.bind_progress(progress, take, batches.set_share)


def start(run: Run, kernels_why: Optional[str]) -> None:
    """Load the checkpoint, open the metrics logger, print the start-up summary."""
    config, layout = run.config, run.layout
    if layout.is_logging_rank:
        line = memory_line(run.grad_sync if config.loco.enabled else None,
                           run.param_sync if config.loco.param_gather_bits else None)
        if line:
            print(line, flush=True)
    if run.resume is not None:
        say(layout, f"loading checkpoint {run.resume}")
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
    if config.diloco.elastic:  # join the live replicas (heal from one if behind) before the first step
        bind_heal(run)
        say(layout, f"DiLoCo: replica {config.diloco.diloco_replica_id} joins at iteration {run.state.iteration} "
                    f"(lighthouse {config.diloco.diloco_lighthouse})")
        run.outer.join(run.state.iteration)
