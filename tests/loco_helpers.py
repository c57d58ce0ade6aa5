"""Reference helpers the tests check LoCo's chunked and fused paths against (the package
never builds these whole-buffer results itself)."""

from __future__ import annotations

import torch

from loco_megatron.loco.collectives import ShardLayout, decompress_into
from loco_megatron.loco.kernel_choice import choose_kernels
from loco_megatron.loco.param_delta import AgreedShard, DeltaLayout, decode_chunk, row_scales


def resolve_kernels(*args, **kwargs) -> str:
    """The kernels of :func:`choose_kernels` (same arguments), without the reason."""
    return choose_kernels(*args, **kwargs)[0]


def decompress_sum(recv: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """fp32 ``[S]``: the sum over ranks, in rank order, of the dequantised rows of ``recv``."""
    out = torch.empty(layout.shard, dtype=torch.float32, device=recv.device)
    decompress_into(recv, layout, out)
    return out


def decode_rows(rows: torch.Tensor, layout: DeltaLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-bucket fp32 deltas ``[W, S]`` and the finite mask: the reference the chunked
    decode is checked against (the gather itself never builds this)."""
    scales, finite = row_scales(rows, layout)
    deltas = torch.empty(layout.world, layout.shard, dtype=torch.float32, device=rows.device)
    for j in range(layout.world):
        for b0, b1, lo, hi in layout.chunks():
            deltas[j, lo:hi] = decode_chunk(rows[j], scales[j], layout, b0, b1, hi - lo)
    return deltas, finite


def finish_shard(shard: AgreedShard, new_agreed: torch.Tensor) -> None:
    """:meth:`AgreedShard.finish_slice` of the whole shard, then :meth:`AgreedShard.finished`."""
    shard.finish_slice(0, shard.own.numel(), new_agreed)
    shard.finished()
