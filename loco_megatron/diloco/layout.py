"""DiLoCo's replicas and outer groups on megatron-core's parallel state, and the outer step
built from the distributed optimizer's shards.

Replicas are megatron-core's *distributed-optimizer instances*: ``initialize_model_parallel(
num_distributed_optimizer_instances=R)`` splits each data-parallel group into R contiguous
blocks, builds the intra-instance groups (a replica's own data-parallel ranks) and one
inter-instance group per position (the R ranks with the same TP, PP, EP and inner-DP
coordinates: the *outer group*; dense and expert shards share it). The DDP wrapper itself
is told nothing about instances, so each replica reduce-scatters over its own ranks only,
exactly as a job of W/R ranks would (the gradient scaling is corrected in
:func:`loco_megatron.loco.hooks.diloco.scale_replica_gradients`), and the distributed
optimizer shards over the same ranks. With the rank order ``tp-cp-ep-pp-dp`` (Megatron-LM's
``--use-tp-pp-dp-mapping``) data parallelism is outermost, so replica ``r`` is the
contiguous ranks ``r*W/R ... (r+1)*W/R - 1``: whole nodes, its TP, PP and inner-DP traffic
never leaving them.
"""

from __future__ import annotations

from typing import Optional

from loco_megatron.config import Config, ConfigError

RANK_ORDER = "tp-cp-ep-pp-dp"
"""megatron-core's rank order under DiLoCo: data parallelism outermost (replicas contiguous)."""


def check_replicas(config: Config, world_size: int, ranks_per_node: Optional[int]) -> None:
    """ConfigError (one line) unless ``world_size`` ranks split into --diloco-replicas
    replicas of the configured layout, each whole nodes of ``ranks_per_node`` ranks (or a
    whole share of one node)."""
    r = config.diloco.replicas_in_world
    if not r:
        return
    lanes = config.diloco.diloco_outer_ranks
    if config.diloco.elastic and lanes is not None and lanes > world_size:
        raise ConfigError(f"--diloco-outer-ranks: {lanes} is more than this replica job's {world_size} ranks (every "
                          f"replica needs a rank for each; use the smallest replica's world size)")
    if world_size % r:
        raise ConfigError(f"--diloco-replicas: {r} does not divide the world size {world_size}")
    dp = config.data_parallel_size(world_size)
    if dp % r:
        raise ConfigError(f"--diloco-replicas: {r} does not divide the data-parallel size {dp} "
                          f"({world_size} ranks / TP x PP x CP): each replica is a whole TP x PP x DP layout")
    edp = config.expert_data_parallel_size(world_size)
    if edp and edp % r:
        raise ConfigError(f"--diloco-replicas: {r} does not divide the expert data-parallel size {edp}")
    if edp and config.parallel.pipeline_model_parallel_size > 1 and edp != dp:
        raise ConfigError(f"--diloco-replicas with --pipeline-model-parallel-size > 1 and experts needs the expert "
                          f"data-parallel size ({edp}) to equal the dense one ({dp}): megatron-core's rank order "
                          f"{RANK_ORDER} (replicas of whole nodes) requires it; use ETP x EP = TP")
    size = world_size // r
    if ranks_per_node and size % ranks_per_node and ranks_per_node % size:
        raise ConfigError(f"--diloco-replicas: replicas of {size} ranks would split nodes of {ranks_per_node} "
                          f"ranks (--loco-ranks-per-node / torchrun's --nproc-per-node): a replica must be whole "
                          f"nodes or a whole share of one")


def describe(config: Config, world_size: int) -> str:
    """One start-up line: the replica layout and the outer step's settings."""
    d = config.diloco
    r = d.replicas_in_world
    size = world_size // r
    inner_dp = config.data_parallel_size(world_size) // r
    p = config.parallel
    whose = ("--loco-* options" if config.loco.loco_bits == d.diloco_outer_bits
             else f"the {d.diloco_outer_bits}-bit defaults")
    bits = (f"{d.diloco_outer_bits}-bit {'/'.join(config.loco.options_for(d.diloco_outer_bits).values())} "
            f"({whose})"
            f"{f', error feedback (beta {d.diloco_outer_beta})' if d.diloco_outer_error_feedback else ', no error feedback'}"
            f"{', gain-corrected' if d.diloco_outer_gain_correction else ''}"
            if d.diloco_outer_bits else "fp32 all-reduce")
    if d.sparse_outer:
        from loco_megatron.diloco.sparse.chunks import tile_side

        side = tile_side(d.diloco_outer_chunk)
        bits = (f"SparseLoCo top {d.diloco_outer_topk} of {d.diloco_outer_chunk} "
                f"({f'{side}x{side} tiles of 2-D weights, flat elsewhere' if side else 'flat chunks'}), "
                f"{f'{d.diloco_outer_bits}-bit' if d.diloco_outer_bits else 'fp32'} values, "
                + (f"error feedback (beta {d.diloco_outer_beta})" if d.diloco_outer_error_feedback
                   else "no error feedback")
                + ", one all-gather, each entry's mean over "
                + ("its senders" if d.diloco_outer_topk_mean == "chosen" else "every replica"))
    stream = (f", {d.diloco_fragments} fragments, delay {d.diloco_sync_delay} (alpha {d.diloco_mixing_factor})"
              if d.diloco_fragments > 1 or d.diloco_sync_delay else "")
    if d.diloco_eager:
        stream += (", the naive one-interval delay (eager control)" if d.diloco_eager_naive
                   else ", eager updates (each exchange runs through the next interval)")
    grid = f"TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} x DP {inner_dp}"
    step = (f"Nesterov lr {d.diloco_outer_lr} momentum {d.diloco_outer_momentum}" if d.diloco_outer_momentum
            or not d.sparse_outer else f"SGD lr {d.diloco_outer_lr}")
    outer = f"outer step every {d.diloco_inner_steps} steps{stream}: {step}, exchange {bits}"
    if d.elastic:
        return (f"DiLoCo (elastic, torchft): replica {d.diloco_replica_id} of {d.diloco_replicas} expected, this job "
                f"{size} ranks ({grid}); lighthouse {d.diloco_lighthouse}, an outer step needs "
                f"{d.diloco_min_replicas} live replica(s); batch split {d.diloco_batch_split}"
                + (f" (weight {d.diloco_replica_weight:g})" if d.diloco_batch_split != "fixed" else "") + f"; {outer}")
    return f"DiLoCo: {r} replicas of {size} ranks ({grid}; replica 0 = ranks 0-{size - 1}); {outer}"
