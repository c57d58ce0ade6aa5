"""The distributed optimizer's state in model space, written shard by shard (reshardable
over DP, TP, PP and EP).

For every model parameter of global shape S the fp32 main param and the Adam moments are
global tensors of shape S (keys ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model
key>``); the optimizer's non-tensor state (param groups, step) is common state.

Each DP rank writes only the elements its own shard holds: a flattened range of the local
(TP/PP/EP) parameter. megatron-core's ``fully_sharded_model_space`` format does this with
``ShardedTensor.flattened_range``, which 0.16 no longer accepts ("flattened_range is not
supported"), and its ``fully_reshardable`` format gathers the whole replica onto every rank
(and scrambles every bucket after the first). So the mapping is done here: a flattened range
of a row-major tensor is a handful of rectangular blocks (a partial row, whole rows, a
partial row, recursively per axis), each one a ShardedTensor chunk of the global tensor at
the model-parallel offset plus its offset inside the local shard. The chunks are views of
the live optimizer state, never a copy on the device: megatron's writer stages them before
training goes on (a synchronous save writes them while the loop waits; --async-save copies
them to host memory, from CUDA with pinned non-blocking copies, when the write is scheduled,
and forks the writer from that snapshot), so a save adds no device memory at all and the
host holds at most the one staged copy the background write needs. Loading asks for the
blocks of the new layout's slices and DCP reads them from whichever saved chunks overlap,
which is what makes any DP/TP/PP/EP change bit-exact. The flat-range-to-blocks mapping is
:mod:`.model_space`'s, shared with DiLoCo's outer lanes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import torch

from loco_megatron.checkpoint.model_space import model_tensors, row_major_blocks, sharded_parts

from loco_megatron.loco.hooks.version import check_megatron_core_version

_KEYS = (("param", "fp32_param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


def owned_slices(opt) -> Iterator[tuple]:
    """(model param, start, end) for every parameter this DP rank holds optimizer state
    for: elements [start, end) of the flattened local parameter, in a fixed order (the
    same on save and load)."""
    # Private buffer/range maps of megatron's DistributedOptimizer: refuse untested versions.
    check_megatron_core_version()
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for gbuf_range_map in per_bucket:
                for param, ranges in gbuf_range_map["param_map"].items():
                    yield param, ranges["param"].start, ranges["param"].end


def state_tensors(opt, param) -> dict:
    """{"param"/"exp_avg"/"exp_avg_sq": 1-D tensor}: this rank's slice of ``param``'s fp32
    main param and Adam moments (the moments exist once a step ran or a state was loaded)."""
    group, order = opt.model_param_group_index_map[param]
    main = opt.optimizer.param_groups[group]["params"][order]
    state = opt.optimizer.state[main]
    return {key: (main if key == "param" else state[key]).detach().view(-1) for key, _ in _KEYS}


def own_state_bytes(opt) -> int:
    """Bytes of optimizer-state tensors (fp32 param + both moments) this rank owns."""
    return sum((end - start) * 4 * len(_KEYS) for _, start, end in owned_slices(opt))


def _pieces(sh, start: int, end: int, replica: int = 0) -> Iterator[tuple]:
    """(ShardedTensor metadata, block shape, flat start) for elements [start, end) of the
    local param: blocks of the global tensor, offsets in global coordinates. ``replica``:
    the data-parallel coordinate of the blocks' replica id (the other coordinates are the
    model param's): 0 when every DP rank writes its own slice; DiLoCo's outer state, held
    alike by every replica and written by replica 0, passes the rank's replica."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for part, base in sharded_parts(sh):
        lo, hi = max(start, base), min(end, base + math.prod(part.local_shape))
        p = part.prepend_axis_num
        # The DP coordinate of the model param's replica id says which DP rank would write
        # the (replicated) param; here every DP rank writes its own slice.
        rid = (*part.replica_id[:-1], replica) if isinstance(part.replica_id, tuple) else replica
        for off, shape, flat in row_major_blocks(tuple(part.local_shape), lo - base, hi - base):
            meta = ShardedTensor(
                part.key, None, torch.float32, (1,) * p + shape, part.global_shape,
                part.global_offset[:p] + tuple(g + o for g, o in zip(part.global_offset[p:], off)),
                axis_fragmentations=None, replica_id=rid, allow_shape_mismatch=part.allow_shape_mismatch)
            yield meta, (1,) * p + shape, flat + base


def sharded_state_dict(opt, model_sd: dict, is_loading: bool) -> dict:
    """One DistributedOptimizer's state: ``{"common": ..., "params": {i: {name: [ShardedTensor]}}}``,
    the blocks of this rank's own slice of every parameter it holds state for. Saving
    passes views of the live state (no copy: see the module docstring for who stages them
    and when); loading, empty host buffers of the same size."""
    meta = model_tensors(model_sd)
    params = {}
    for i, (param, start, end) in enumerate(owned_slices(opt)):
        tensors = None if is_loading else state_tensors(opt, param)
        pieces = list(_pieces(meta[param], start, end))
        entry = {}
        for key, name in _KEYS:
            staging = torch.empty(end - start, dtype=torch.float32) if is_loading else tensors[key]
            entry[name] = [dataclasses.replace(m, key=f"optimizer.state.{name}.{m.key}",
                                               data=staging[flat - start:flat - start + math.prod(shape)].view(shape))
                           for m, shape, flat in pieces]
        params[i] = entry
    # Common state comes from rank 0's common.pt at load (a fresh optimizer has none to describe).
    return {"common": None if is_loading else opt.state_dict(), "params": params}


@torch.no_grad()
def load_state_dict(opt, sd: dict) -> None:
    """Restore param groups/step, then this rank's own slice of every param's state (the
    blocks come back in flat order: copied one after the other)."""
    # megatron's load_state_dict replaces the inner optimizer's state tensors: read them after.
    opt.load_state_dict(sd["common"])
    for i, (param, _, _) in enumerate(owned_slices(opt)):
        tensors = state_tensors(opt, param)
        for key, name in _KEYS:
            at = 0
            for block in sd["params"][i][name]:
                n = block.numel()
                tensors[key][at:at + n].copy_(block.reshape(-1))
                at += n
