"""The distributed optimizer's state in model space (reshardable over DP, TP, PP, EP).

For every model parameter of shape S, the fp32 main param and the Adam moments are saved
as ShardedTensors of shape S under the model parameter's own sharding metadata (keys
``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>``), plus the optimizer's
non-tensor state (param groups, step) as common state. This is megatron-core's
``fully_reshardable`` representation; its 0.16 save maps parameters into the gathered
buffer with padded-bucket offsets but fills that buffer bucket by bucket *without* the
padding, which scrambles every bucket after the first (wrong weights after a resume), so
the mapping is done here with the right offsets. Loading reads each local (TP/PP) param
whole and keeps this rank's DP slice of it.
"""

from __future__ import annotations

import dataclasses

import torch

from loco_megatron.loco.hooks.version import check_megatron_core_version

_KEYS = (("param", "fp32_param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


def _model_meta(model_sd: dict) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    return {sh.data: sh for sh in nested_values(tensors)}


def _params(opt):
    """(gbuf index, buffer, model param, (start, end, bucket id)) in a fixed order."""
    for gbuf_idx, buffer in enumerate(opt.buffers):
        for param, index in buffer.param_index_map.items():
            yield gbuf_idx, buffer, param, index


def _world_tensors(opt) -> dict:
    """gbuf index -> {"param"/"exp_avg"/"exp_avg_sq": whole-buffer tensor in *padded*
    buffer coordinates}, gathered over DP onto every DP rank."""
    gathered = opt.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
    out = {}
    for gbuf_idx, buffer in enumerate(opt.buffers):
        (dtype,) = opt.gbuf_ranges[gbuf_idx].keys()
        world = gathered[gbuf_idx][dtype]
        padded = {key: torch.zeros(buffer.numel, dtype=torch.float32) for key, _ in _KEYS}
        src = 0
        for bucket in buffer.buckets:  # megatron concatenates the buckets without their padding
            for key in padded:
                padded[key][bucket.offset:bucket.offset + bucket.numel_unpadded] = \
                    world[key][src:src + bucket.numel_unpadded]
            src += bucket.numel_unpadded
        out[gbuf_idx] = padded
    return out


def sharded_state_dict(opt, model_sd: dict, is_loading: bool) -> dict:
    """One DistributedOptimizer's state: ``{"common": ..., "params": {i: {name: ShardedTensor}}}``
    (a ShardedTensorFactory where the model has one, e.g. SwiGLU's fused fc1 under TP)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    # This module reads the optimizer's private buffer/range maps: refuse untested versions.
    check_megatron_core_version()
    meta = _model_meta(model_sd)
    world = None if is_loading else _world_tensors(opt)
    params = {}
    for i, (gbuf_idx, _, param, (start, end, _)) in enumerate(_params(opt)):
        sh = meta[param]
        entry = {}
        for key, name in _KEYS:
            data = (torch.empty(sh.data.shape, dtype=torch.float32) if is_loading
                    else world[gbuf_idx][key][start:end].reshape(sh.data.shape).clone())
            extra = {} if isinstance(sh, ShardedTensorFactory) else {"dtype": torch.float32}
            entry[name] = dataclasses.replace(sh, key=f"optimizer.state.{name}.{sh.key}", data=data, **extra)
        params[i] = entry
    # Common state comes from rank 0's common.pt at load (a fresh optimizer has none to describe).
    return {"common": None if is_loading else opt.state_dict(), "params": params}


@torch.no_grad()
def load_state_dict(opt, sd: dict) -> None:
    """Restore param groups/step, then this rank's DP slice of every local param's state."""
    opt.load_state_dict(sd["common"])
    ranges = {}
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for gbuf_range_map in per_bucket:
                ranges.update(gbuf_range_map["param_map"])
    for i, (_, _, param, _) in enumerate(_params(opt)):
        if param not in ranges:
            continue  # another DP rank owns this parameter's state
        part = ranges[param]["param"]
        group, order = opt.model_param_group_index_map[param]
        main = opt.optimizer.param_groups[group]["params"][order]
        state = opt.optimizer.state[main]
        for key, name in _KEYS:
            dst = main if key == "param" else state[key]
            dst.copy_(sd["params"][i][name].flatten()[part.start:part.end])
