"""Building elastic DiLoCo's outer step: the lanes of this rank (over megatron's sharded
state dict, :mod:`loco_megatron.checkpoint.model_space`) and the
:class:`~.step.ElasticOuterStep` with what every replica must share."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from loco_megatron.checkpoint.model_space import model_tensors
from loco_megatron.config import Config
from loco_megatron.config.run import batch_granule
from loco_megatron.diloco.elastic.cycle import config_hash, settings_parts
from loco_megatron.diloco.elastic.lanes import LaneMover, LaneViews, NoLane, Space, check_cover, shard_blocks
from loco_megatron.diloco.elastic.split import fixed_share
from loco_megatron.diloco.elastic.replica import Rules, SplitSettings
from loco_megatron.diloco.elastic.step import ElasticOuterStep


def lane_channels(config: Config, chunks: list, optimizer, fragment: Callable, coordinator,
                  channel_maker: Callable) -> tuple[dict, dict, list]:
    """Per fragment, this rank's lane (:mod:`.lanes`; an empty one off the hosts) and the
    mover between the replica's shards and its lanes; and the lanes' space (what every
    replica must share). Collective over the job (an all-gather of every rank's blocks on
    the control group, the first gathers of the lanes)."""
    from loco_megatron.loco.hooks.diloco import main_shards

    d = config.diloco
    meta = model_tensors({f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(chunks)})
    mine = [b for pairs in main_shards(optimizer) for param, start, end, view in pairs
            for b in shard_blocks(meta[param], start, end, view, fragment(param))]
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, [b.describe() for b, _ in mine], group=coordinator.control)

    def all_to_all(output, input, output_sizes, input_sizes) -> None:  # over this replica (the job)
        dist.all_to_all_single(output, input, output_sizes, input_sizes)

    channels, makers, signature = {}, {}, []
    for f in sorted({row[5] for rank_blocks in table for row in rank_blocks}):
        # (a fragment's box of a stacked layer tensor is the rows of its layers)
        space = Space.of_blocks(table, f, coordinator.lanes)
        check_cover(space, table, f)
        mover = LaneMover(space, f, table, mine, dist.get_rank(), all_to_all, coordinator.device)
        key = f"fragment{f}"
        if mover.lane is not None and mover.numel:
            # stochastic rounding: this lane's place among every replica's lanes
            makers[key] = channel_maker(mover.numel, key, coordinator.device, None, coordinator.ops,
                                        d.diloco_replica_id * coordinator.lanes + mover.lane,
                                        pieces=space.lane_pieces(mover.lane))
        else:
            makers[key] = NoLane
        channels[key] = (LaneViews(mover), makers[key](), 0, f)
        signature.append((f, space.signature()))
    return channels, makers, signature


def elastic_outer_step(config: Config, args: tuple, options, space: list, coordinator, makers: dict) -> ElasticOuterStep:
    """The outer step of an elastic replica (``args``: :class:`~loco_megatron.diloco.outer.OuterStep`'s)."""
    d, lc = config.diloco, config.loco
    # What every replica must share: the model (its lanes' space: every tensor's key and
    # shape, per fragment), the outer settings (the batch split's mode among them), the
    # global batch and the seed (the first replica's initial weights are everyone's).
    local = ("diloco_replica_id", "diloco_lighthouse", "diloco_quorum_timeout_s", "diloco_exchange_timeout_s",
             "diloco_replica_weight", "diloco_link_gbps")
    # (not the layout: TP, PP, DP and the micro batch are each replica's own); each under
    # the name a refusal gives it when it differs
    named = [*((f"--{k.replace('_', '-')}", v) for k, v in dataclasses.asdict(d).items()
               if k not in local + ("diloco_outer_ranks",)),
             ("--loco-block-size", lc.loco_block_size), ("--loco-quant-seed", lc.loco_quant_seed),
             ("the outer gradients' quantisation options (--loco-* flags)", sorted(options.__dict__.items())),
             ("--seq-length", config.model.seq_length), ("--global-batch-size", config.data.global_batch_size),
             ("--seed", config.train.seed), ("the model (its tensors' names and shapes)", space)]
    shared = [v for _, v in named]
    p, gbs, device = config.parallel, config.data.global_batch_size, coordinator.device

    def slowest(seconds: float) -> float:  # (at an outer step, which waits for the others anyway)
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    world = dist.get_world_size()
    split = SplitSettings(d.diloco_batch_split, gbs,
                          batch_granule(config.data.micro_batch_size, config.data_parallel_size(world),
                                        p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size),
                          d.diloco_replica_weight,
                          fixed_share(d.diloco_replica_id, d.diloco_replicas, gbs) if d.diloco_batch_split == "fixed"
                          else None, slowest)
    kind, extra = ElasticOuterStep, {}
    if d.diloco_eager:
        from loco_megatron.diloco.elastic.eager import ElasticEagerStep

        kind, extra = ElasticEagerStep, {"naive": d.diloco_eager_naive}
    return kind(*args, coordinator=coordinator, replica=d.diloco_replica_id, config_hash=config_hash(shared),
                relay=lambda key, world: makers[key](world), split=split, settings=settings_parts(named),
                rules=Rules(d.diloco_replicas, d.diloco_min_replicas, world, config.optimizer.optimizer,
                            config.train.train_iters), **extra)
