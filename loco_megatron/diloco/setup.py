"""The outer step built from the distributed optimizer's shards, over megatron-core's
inter-instance groups (see :mod:`.layout` for the replicas)."""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist

from loco_megatron.config import Config
from loco_megatron.diloco.exchange import OuterChannel
from loco_megatron.diloco.fragments import fragment_of
from loco_megatron.diloco.outer import OuterStep, ShardViews
from loco_megatron.diloco.schedule import FragmentSchedule
from loco_megatron.diloco.sparse.channel import SparseChannel
from loco_megatron.diloco.sparse.chunks import ChunkPlan, slice_pieces
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

    def channel_maker(numel: int, key: str, device, group, ops, stream_rank, exact: bool = False,
                      pieces: Optional[list] = None):
        """``make(world)``: a new channel of ``numel`` elements (``pieces``: the shard's
        ``(length, shape, start)`` runs, :mod:`.sparse.chunks`; SparseLoCo tiles by them)."""
        if d.sparse_outer and not exact:  # (a tied embedding's two copies stay exact: see _shard_channels)
            plan = ChunkPlan(pieces or [(numel, (numel,), 0)], d.diloco_outer_chunk, device)

            def make_sparse(world: Optional[int] = None) -> SparseChannel:
                return SparseChannel(plan, group, d.diloco_outer_topk, d.diloco_outer_bits, d.diloco_outer_beta,
                                     d.diloco_outer_error_feedback, device, name=key, ops=ops, clock=stats.clock,
                                     world=world, mean=d.diloco_outer_topk_mean)
            return make_sparse

        def make(world: Optional[int] = None) -> OuterChannel:
            return OuterChannel(numel, group, 0 if exact else d.diloco_outer_bits, lc.loco_block_size,
                                options, d.diloco_outer_error_feedback, d.diloco_outer_beta, kernels, device,
                                name=key, ops=ops, workspace=workspace, clock=stats.clock, exact=exact,
                                gain_correction=d.diloco_outer_gain_correction, stream_rank=stream_rank, world=world)
        return make

    if coordinator is None:
        channels, makers = _shard_channels(config, optimizer, fragment, outer_group(d.diloco_replicas), ops,
                                           channel_maker, _tp_replicated(chunks, config))
    else:
        from loco_megatron.diloco.elastic.setup import lane_channels

        channels, makers, space = lane_channels(config, chunks, optimizer, fragment, coordinator, channel_maker)

    def record(work) -> None:  # once per exchange, when it completed (see OuterStep)
        stats.add_interval("outer_time", work.launch_mark, work.done_mark)
        for start, end in work.exposed_marks:
            stats.add_interval("outer_exposed", start, end)
        work.exposed_marks = []
        stats.add_outer_bytes(work.bytes_sent, work.c.uncompressed_bytes())

    # Without DiLoCo the replicas would all-reduce every step: bf16, half the fp32 ring's bytes.
    every_step = sum(ch.uncompressed_bytes() for _, ch, _, _ in channels.values()) // 2
    args = (channels, FragmentSchedule(d.diloco_inner_steps, d.diloco_fragments, d.diloco_sync_delay, d.diloco_eager),
            d.diloco_outer_lr, d.diloco_outer_momentum, d.diloco_mixing_factor,
            lambda update: run_in_optimizer_step(optimizer, update), record,
            lambda: stats.add_outer_reference(every_step), log)
    if coordinator is None and d.diloco_eager:
        from loco_megatron.diloco.eager import EagerOuterStep

        return EagerOuterStep(*args, naive=d.diloco_eager_naive)
    if coordinator is None:
        return OuterStep(*args)
    from loco_megatron.diloco.elastic.setup import elastic_outer_step

    return elastic_outer_step(config, args, options, space, coordinator, makers)


def _tp_stream_rank() -> int:
    """This rank's place in the run with its TP coordinate left out (TP is innermost in the
    rank order): the TP peers of a replicated parameter round it alike."""
    from megatron.core import parallel_state as ps

    return dist.get_rank() - ps.get_tensor_model_parallel_rank()


def _tp_replicated(chunks: list, config: Config) -> set[int]:
    """ids of the dense parameters TP replicates (not split: norms, row-parallel biases,
    learned position embeddings), with TP > 1 (else none)."""
    if config.parallel.tensor_model_parallel_size == 1:
        return set()
    return {id(p) for chunk in chunks for p in chunk.parameters()
            if not getattr(p, "tensor_model_parallel", False) and getattr(p, "allreduce", True)}


def _shard_channels(config: Config, optimizer, fragment: Callable, group, ops: CollectiveOps,
                    channel_maker: Callable, replicated: set[int] = frozenset()) -> tuple[dict, dict]:
    """One world: per sub-optimizer and fragment, this rank's shards (rank k of each replica
    holds the same ones and exchanges with the others' rank k over ``group``).

    The parameters TP replicates (``replicated``) exchange in channels of their own
    (``.tp``): in a channel with TP-split parameters a compressed exchange's blocks (and a
    ring all-reduce's summation order) would mix them with values that differ between the
    TP ranks, and the copies would leave the outer step different. Their own channel holds
    the same elements in the same order on every TP rank, and rounds them alike (its
    stochastic-rounding stream is the TP group's, not the rank's)."""
    from loco_megatron.loco.hooks.diloco import main_shards

    channels, makers = {}, {}
    for i, pairs in enumerate(main_shards(optimizer)):
        per_channel: dict[tuple[int, bool], list] = {}
        for param, start, end, view in pairs:
            # A tied embedding split over two pipeline stages: both copies must get the same
            # update, wherever each sits in its stage's shard (see exchange.py, exact).
            tied = getattr(param, "shared_embedding", False) and config.parallel.pipeline_model_parallel_size > 1
            tp = not tied and id(param) in replicated
            per_channel.setdefault((fragment(param), tied, tp), []).append((view, (param, start, end)))
        for f, tied, tp in sorted(per_channel):
            pairs = per_channel[f, tied, tp]
            views = ShardViews([v for v, _ in pairs], [s for _, s in pairs])
            key = f"opt{i}.fragment{f}" + (".tied" if tied else "") + (".tp" if tp else "")
            makers[key] = channel_maker(views.numel, key, views.views[0].device, group, ops,
                                        _tp_stream_rank() if tp else None, exact=tied,
                                        pieces=slice_pieces(views.slices))
            channels[key] = (views, makers[key](), i, f)
    return channels, makers
