"""Model space: where a flat range of a parameter shard lies in megatron's global tensors.

A parameter shard is a flattened range of a local (TP/PP/EP) parameter; megatron's
``sharded_state_dict`` says where that local parameter lies in its global tensor (one
ShardedTensor, or several for a ShardedTensorFactory such as SwiGLU's fused fc1 under TP).
:func:`sharded_parts` lists those pieces with where each starts in the flat local param, and
:func:`row_major_blocks` cuts a flat range of a row-major shape into rectangular blocks. The
distributed optimizer's checkpoint (:mod:`.dist_optimizer`) and DiLoCo's outer lanes
(:mod:`loco_megatron.diloco.lanes`) build on both.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch


def row_major_blocks(shape: tuple, start: int, end: int, offset: tuple = ()) -> Iterator[tuple]:
    """Rectangular blocks covering flat elements [start, end) of a row-major ``shape``:
    (block offset, block shape, flat start), in flat order. At most 2 per axis."""
    if start >= end:
        return
    if len(shape) <= 1:
        yield offset + ((start,) if shape else ()), ((end - start,) if shape else ()), start
        return
    row = math.prod(shape[1:])
    first, last = start // row, end // row
    if start % row:  # the partial row at the front
        stop = min(end, (first + 1) * row)
        for off, shp, flat in row_major_blocks(shape[1:], start - first * row, stop - first * row):
            yield offset + (first,) + off, (1,) + shp, flat + first * row
        start, first = stop, first + 1
    if last > first:  # whole rows
        yield offset + (first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:]), first * row
        start = last * row
    if start < end:  # the partial row at the back
        for off, shp, flat in row_major_blocks(shape[1:], 0, end - last * row):
            yield offset + (last,) + off, (1,) + shp, flat + last * row


def sharded_parts(sh) -> list:
    """The model param's ShardedTensors with where each starts in the flattened local
    param: ``[(sharded tensor, flat start)]``. A ShardedTensorFactory (SwiGLU's fused fc1
    under TP) is built on a meta tensor to learn its parts without touching data."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if not isinstance(sh, ShardedTensorFactory):
        return [(sh, 0)]
    parts = []
    for part in nested_values(sh.build_fn(sh.key, torch.empty(sh.data.shape, device="meta"),
                                          sh.replica_id, None)):
        if not part.data.is_contiguous():
            raise NotImplementedError(f"{sh.key}: a sharded-tensor factory splitting a param "
                                      "into non-contiguous parts")
        parts.append((part, part.data.storage_offset()))
    return sorted(parts, key=lambda p: p[1])


def model_tensors(model_sd: dict) -> dict:
    """Every model param of a ``sharded_state_dict`` (its tensor) -> its ShardedTensor (or
    ShardedTensorFactory): where the local param lies in model space."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    return {sh.data: sh for sh in nested_values(tensors)}
