"""The outer step built from the distributed optimizer's shards, over megatron-core's
inter-instance groups (see :mod:`.layout` for the replicas)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.config import Config
from loco_megatron.config.run import batch_granule
from loco_megatron.diloco.batch_split import fixed_share
from loco_megatron.diloco.exchange import OuterChannel
from loco_megatron.diloco.fragments import fragment_of
from loco_megatron.diloco.outer import OuterStep, ShardViews
from loco_megatron.diloco.schedule import FragmentSchedule
from loco_megatron.loco.collectives import TORCH_OPS, CollectiveOps
from loco_megatron.loco.quantize import QuantOptions
from loco_megatron.loco.workspace import Workspace
from loco_megatron.metrics.comm import CommStats


def outer_group(replicas: int):
    """This rank's outer group: megatron's inter-instance group, or (one replica) a group of
    this rank alone (made locally: no other rank takes part)."""
    if replicas == 1:
        return dist.new_group([dist.get_rank()], use_local_synchronization=True)
    from megatron.core import parallel_state as ps

    return ps.get_inter_distributed_optimizer_instance_group()


def _layer_numbers(chunks: list) -> dict[int, int]:
    """id(param) -> global 1-based layer number, for every transformer-layer parameter."""
    out = {}
    for chunk in chunks:
        decoder = getattr(chunk.module, "decoder", None)
        for layer in (decoder.layers if decoder is not None else ()):
            for p in layer.parameters():
                out[id(p)] = layer.layer_number
    return out


def build_outer_step(config: Config, chunks: list, optimizer, stats: CommStats, log: Callable[[str], None],
                     ops: CollectiveOps = TORCH_OPS, coordinator=None) -> Optional[OuterStep]:
    """The outer step of this rank (None without --diloco-replicas). Corrects megatron's
    gradient scaling for replicas. Collective (creates the one-replica group).
    ``coordinator`` (elastic DiLoCo, --diloco-lighthouse): this rank's
    :class:`~.elastic.ElasticCoordinator`; the outer exchange then runs on its torchft
    groups and the step is an :class:`~.elastic_step.ElasticOuterStep`."""
    d, lc = config.diloco, config.loco
    if not d.enabled:
        return None
    from loco_megatron.loco.hooks.diloco import main_shards, run_in_optimizer_step, scale_replica_gradients

    scale_replica_gradients(chunks, d.replicas_in_world)
    if coordinator is not None:
        group, ops = None, coordinator.ops
        # Stochastic rounding: this rank's place in the whole run, as in one world.
        stream_rank = d.diloco_replica_id * dist.get_world_size() + dist.get_rank()
    else:
        group, stream_rank = outer_group(d.diloco_replicas), None
    names = {id(p): name for chunk in chunks for name, p in chunk.module.named_parameters()}
    layers = _layer_numbers(chunks)
    # The outer exchange runs every H steps: LoCo's torch kernels unless others are asked
    # for (the gain correction has torch kernels only).
    kernels = lc.loco_kernels if lc.loco_kernels != "auto" and not d.diloco_outer_gain_correction else "torch"
    options = QuantOptions(**lc.options_for(d.diloco_outer_bits), seed=lc.loco_quant_seed)
    workspace = Workspace()
    channels, makers = {}, {}
    for i, pairs in enumerate(main_shards(optimizer)):
        per_channel: dict[tuple[int, bool], list] = {}
        for param, start, end, view in pairs:
            shared = getattr(param, "shared_embedding", False)
            f = fragment_of(names[id(param)], layers.get(id(param)), shared, config.model.num_layers,
                            d.diloco_fragments)
            # A tied embedding split over two pipeline stages: both copies must get the same
            # update, wherever each sits in its stage's shard (see exchange.py, exact).
            tied = shared and config.parallel.pipeline_model_parallel_size > 1
            per_channel.setdefault((f, tied), []).append((view, (param, start, end)))
        for f, tied in sorted(per_channel):
            views = ShardViews([v for v, _ in per_channel[f, tied]], [s for _, s in per_channel[f, tied]])
            key = f"opt{i}.fragment{f}" + (".tied" if tied else "")

            def make(numel=views.numel, tied=tied, key=key, device=views.views[0].device) -> OuterChannel:
                return OuterChannel(numel, group, 0 if tied else d.diloco_outer_bits, lc.loco_block_size,
                                    options, d.diloco_outer_error_feedback, d.diloco_outer_beta, kernels, device,
                                    name=key, ops=ops, workspace=workspace, clock=stats.clock, exact=tied,
                                    gain_correction=d.diloco_outer_gain_correction, stream_rank=stream_rank)

            makers[key] = make
            channels[key] = (views, make(), i, f)

    def record(work) -> None:  # once per exchange, when it completed (see OuterStep)
        stats.add_interval("outer_time", work.launch_mark, work.done_mark)
        for start, end in work.exposed_marks:
            stats.add_interval("outer_exposed", start, end)
        work.exposed_marks = []
        stats.add_outer_bytes(work.bytes_sent, work.c.uncompressed_bytes())

    # Without DiLoCo the replicas would all-reduce every step: bf16, half the fp32 ring's bytes.
    every_step = sum(ch.uncompressed_bytes() for _, ch, _, _ in channels.values()) // 2
    args = (channels, FragmentSchedule(d.diloco_inner_steps, d.diloco_fragments, d.diloco_sync_delay),
            d.diloco_outer_lr, d.diloco_outer_momentum, d.diloco_mixing_factor,
            lambda update: run_in_optimizer_step(optimizer, update), record,
            lambda: stats.add_outer_reference(every_step), log)
    if coordinator is None:
        return OuterStep(*args)
    from loco_megatron.diloco.elastic import config_hash
    from loco_megatron.diloco.elastic_step import ElasticOuterStep, SplitSettings

    # What every replica must share: the shards (their sizes per channel, so the model's
    # shape and the layout), the outer settings (the batch split's mode among them), the
    # global batch.
    local = ("diloco_replica_id", "diloco_lighthouse", "diloco_quorum_timeout_s", "diloco_exchange_timeout_s",
             "diloco_replica_weight")
    shared = [config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size,
              dist.get_world_size(), {k: v for k, v in dataclasses.asdict(d).items() if k not in local},
              lc.loco_block_size, lc.loco_quant_seed, sorted(options.__dict__.items()), config.model.seq_length,
              config.data.global_batch_size, config.data.micro_batch_size,
              {k: ch.numel for k, (_, ch, _, _) in channels.items()}]
    p, gbs = config.parallel, config.data.global_batch_size
    device = next(iter(channels.values()))[0].views[0].device if channels else torch.device("cpu")

    def slowest(seconds: float) -> float:  # (at an outer step, which waits for the others anyway)
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    split = SplitSettings(d.diloco_batch_split, gbs,
                          batch_granule(config.data.micro_batch_size, config.data_parallel_size(dist.get_world_size()),
                                        p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size),
                          d.diloco_replica_weight,
                          fixed_share(d.diloco_replica_id, d.diloco_replicas, gbs) if d.diloco_batch_split == "fixed"
                          else None, slowest)
    return ElasticOuterStep(*args, coordinator=coordinator, replica=d.diloco_replica_id, config_hash=config_hash(shared),
                            relay=lambda key: makers[key](), split=split)
