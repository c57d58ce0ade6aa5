"""What DiLoCo needs from megatron-core's private internals (see :mod:`loco_megatron.diloco`).

* :func:`scale_replica_gradients`: megatron's DDP scales each bucket by ``1 / DP`` before
  its reduce-scatter, with ``DP`` the data-parallel size of the whole world; under
  DiLoCo the buckets are reduced inside one replica only (megatron's intra-instance
  group), so the mean over the replica's ranks needs ``R`` times that factor.
* :func:`main_shards`: per (dense, expert) distributed optimizer, its fp32 main
  parameters: this rank's shard of each model parameter, as 1-D views the outer step
  reads and writes in place (per Muon / AdamW sub-optimizer of --optimizer muon: the
  whole parameters this rank owns).
* :func:`run_in_optimizer_step`: run the outer update *as* a megatron optimizer step: the
  inner torch optimizer's ``step`` is swapped for the outer update and megatron's own
  ``step_with_ready_grads`` does the rest, exactly as after an Adam step: the main
  parameters are copied to the model's (bf16) weights and all-gathered inside the
  replica (at once, or with the next forward under ``--overlap-param-gather``; through
  ``--param-gather-bits`` when it is on, whose step wrapper then sees the update coming).
  Under --optimizer muon the same holds for each sub-optimizer (Muon and AdamW) of the
  layer-wise optimizer, whose ``step_with_ready_grads`` then all-gathers the whole
  parameters each rank owns inside the replica (:mod:`loco_megatron.optimizer.layer_wise`).
"""

from __future__ import annotations

from typing import Callable

import torch

from loco_megatron.loco.hooks.version import check_megatron_core_version
from loco_megatron.optimizer import sub_optimizers


def scale_replica_gradients(ddp_models: list, replicas: int) -> None:
    """Turn megatron's world-wide ``1 / DP`` gradient scaling into the replica's ``1 / (DP / R)``."""
    check_megatron_core_version()
    for model in ddp_models:
        for group in list(model.bucket_groups) + list(model.expert_parallel_bucket_groups):
            for bucket in group.buckets:
                bucket.gradient_scaling_factor *= replicas


def main_shards(optimizer) -> list[list[tuple[torch.nn.Parameter, int, int, torch.Tensor]]]:
    """Per sub-optimizer (dense first, then expert), ``[(model param, start, end, main view)]``
    for every parameter this rank holds a shard of: ``main view`` is the fp32 1-D main
    parameter the distributed optimizer steps (for fp32 models a view of the model's own
    buffer), elements ``[start, end)`` of the flattened local (TP/PP/EP) parameter. A stub
    optimizer (no parameters on this rank) gives an empty list. --optimizer muon (the
    layer-wise optimizer, each rank of a replica stepping whole parameters): per
    sub-optimizer (Muon, then megatron's dense and expert AdamW), ``(param, 0, numel, main
    view)`` for every parameter this rank owns, ``main view`` its fp32 main parameter
    flattened (the model parameter itself in fp32)."""
    check_megatron_core_version()
    from loco_megatron.optimizer.layer_wise import owned

    whole = owned(optimizer)
    if whole is not None:
        return [[(param, 0, param.numel(), main.detach().view(-1)) for param, main in pairs] for pairs in whole]
    out = []
    for opt in sub_optimizers(optimizer):
        pairs = []
        if not getattr(opt, "is_stub_optimizer", False):
            for gbuf_range_maps in opt.gbuf_ranges:
                for per_bucket in gbuf_range_maps.values():
                    for gbuf_range_map in per_bucket:
                        for param, ranges in gbuf_range_map["param_map"].items():
                            group, order = opt.model_param_group_index_map[param]
                            main = opt.optimizer.param_groups[group]["params"][order].detach().view(-1)
                            pairs.append((param, ranges["param"].start, ranges["param"].end, main))
        out.append(pairs)
    return out


@torch.no_grad()
def run_in_optimizer_step(optimizer, update: Callable[[int], None]) -> None:
    """Call ``update(i)`` for sub-optimizer ``i`` in place of its inner torch step, inside
    megatron's ``step_with_ready_grads`` (see the module docstring). Every rank calls this
    at the same iterations, so the intra-replica all-gathers it issues line up."""
    subs = sub_optimizers(optimizer)
    for i, opt in enumerate(subs):
        if not getattr(opt, "is_stub_optimizer", False):
            opt.optimizer.step = (lambda i=i: update(i))  # an instance attribute shadows the method
    try:
        optimizer.step_with_ready_grads()
    finally:
        for opt in subs:
            inner = getattr(opt, "optimizer", None)
            if inner is not None and "step" in vars(inner):
                del inner.step
