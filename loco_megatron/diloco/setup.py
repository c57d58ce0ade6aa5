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
    from loco_megatron.loco.hooks.diloco import run_in_optimizer_step, scale_replica_gradients

    scale_replica_gradients(chunks, d.replicas_in_world)
    names = {id(p): name for chunk in chunks for name, p in chunk.module.named_parameters()}
    layers = _layer_numbers(chunks)

    def fragment(param) -> int:
        return fragment_of(names[id(param)], layers.get(id(param)), getattr(param, "shared_embedding", False),
                           config.model.num_layers, d.diloco_fragments)

    # The outer exchange runs every H steps: LoCo's torch kernels unless others are asked
    # for (the gain correction has torch kernels only).
    kernels = lc.loco_kernels if lc.loco_kernels != "auto" and not d.diloco_outer_gain_correction else "torch"
    options = QuantOptions(**lc.options_for(d.diloco_outer_bits), seed=lc.loco_quant_seed)
    workspace = Workspace()

    def channel_maker(numel: int, key: str, device, group, ops, stream_rank, exact: bool = False):
        def make() -> OuterChannel:
            return OuterChannel(numel, group, 0 if exact else d.diloco_outer_bits, lc.loco_block_size,
                                options, d.diloco_outer_error_feedback, d.diloco_outer_beta, kernels, device,
                                name=key, ops=ops, workspace=workspace, clock=stats.clock, exact=exact,
                                gain_correction=d.diloco_outer_gain_correction, stream_rank=stream_rank)
        return make

    if coordinator is None:
        channels, makers = _shard_channels(config, optimizer, fragment, outer_group(d.diloco_replicas), ops,
                                           channel_maker)
        space = None
    else:
        channels, makers, space = _lane_channels(config, chunks, optimizer, fragment, coordinator, channel_maker)

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

    # What every replica must share: the model (its lanes' space: every tensor's key and
    # shape, per fragment), the outer settings (the batch split's mode among them), the
    # global batch and the seed (the first replica's initial weights are everyone's).
    local = ("diloco_replica_id", "diloco_lighthouse", "diloco_quorum_timeout_s", "diloco_exchange_timeout_s",
             "diloco_replica_weight")
    # (not the layout: TP, PP, DP and the micro batch are each replica's own)
    shared = [{k: v for k, v in dataclasses.asdict(d).items() if k not in local + ("diloco_outer_ranks",)},
              lc.loco_block_size, lc.loco_quant_seed, sorted(options.__dict__.items()), config.model.seq_length,
              config.data.global_batch_size, config.train.seed, space]
    p, gbs, device = config.parallel, config.data.global_batch_size, coordinator.device

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


def _shard_channels(config: Config, optimizer, fragment: Callable, group, ops: CollectiveOps,
                    channel_maker: Callable) -> tuple[dict, dict]:
    """One world: per sub-optimizer and fragment, this rank's shards (rank k of each replica
    holds the same ones and exchanges with the others' rank k over ``group``)."""
    from loco_megatron.loco.hooks.diloco import main_shards

    channels, makers = {}, {}
    for i, pairs in enumerate(main_shards(optimizer)):
        per_channel: dict[tuple[int, bool], list] = {}
        for param, start, end, view in pairs:
            # A tied embedding split over two pipeline stages: both copies must get the same
            # update, wherever each sits in its stage's shard (see exchange.py, exact).
            tied = getattr(param, "shared_embedding", False) and config.parallel.pipeline_model_parallel_size > 1
            per_channel.setdefault((fragment(param), tied), []).append((view, (param, start, end)))
        for f, tied in sorted(per_channel):
            views = ShardViews([v for v, _ in per_channel[f, tied]], [s for _, s in per_channel[f, tied]])
            key = f"opt{i}.fragment{f}" + (".tied" if tied else "")
            makers[key] = channel_maker(views.numel, key, views.views[0].device, group, ops, None, exact=tied)
            channels[key] = (views, makers[key](), i, f)
    return channels, makers


def _lane_channels(config: Config, chunks: list, optimizer, fragment: Callable, coordinator,
                   channel_maker: Callable) -> tuple[dict, dict, list]:
    """Elastic DiLoCo: per fragment, this rank's lane (:mod:`.lanes`; an empty one off the
    hosts) and the mover between the replica's shards and its lanes; and the lanes' space
    (what every replica must share). Collective over the job (an all-gather of every
    rank's blocks on the control group, the first gathers of the lanes)."""
    from loco_megatron.checkpoint.dist_optimizer import _model_meta
    from loco_megatron.diloco.lanes import LaneMover, LaneViews, NoLane, Space, check_cover, shard_blocks
    from loco_megatron.loco.hooks.diloco import main_shards

    d = config.diloco
    meta = _model_meta({f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(chunks)})
    mine = [b for pairs in main_shards(optimizer) for param, start, end, view in pairs
            for b in shard_blocks(meta[param], start, end, view, fragment(param))]
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, [b.describe() for b, _ in mine], group=coordinator.control)
    shapes: dict[int, dict[str, tuple]] = {}
    for rank_blocks in table:
        for key, shape, _, _, _, f in rank_blocks:
            if shapes.setdefault(f, {}).setdefault(key, shape) != shape:
                raise ValueError(f"DiLoCo lanes: {key} has shapes {shape} and {shapes[f][key]} on different ranks")

    def all_to_all(output, input, output_sizes, input_sizes) -> None:  # over this replica (the job)
        dist.all_to_all_single(output, input, output_sizes, input_sizes)

    channels, makers, signature = {}, {}, []
    for f in sorted(shapes):
        space = Space(shapes[f], coordinator.lanes)
        check_cover(space, table, f)
        mover = LaneMover(space, f, table, mine, dist.get_rank(), all_to_all, coordinator.device)
        key = f"fragment{f}"
        if mover.lane is not None and mover.numel:
            # stochastic rounding: this lane's place among every replica's lanes
            makers[key] = channel_maker(mover.numel, key, coordinator.device, None, coordinator.ops,
                                        d.diloco_replica_id * coordinator.lanes + mover.lane)
        else:
            makers[key] = NoLane
        channels[key] = (LaneViews(mover), makers[key](), 0, f)
        signature.append((f, space.signature()))
    return channels, makers, signature
