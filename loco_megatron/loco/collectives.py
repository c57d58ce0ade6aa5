"""LoCo's compressed reduce-scatter: one all-to-all of low-bit codes, fp32 sum.

Modelled on megatron-core's ``reduce_scatter_with_fp32_accumulation``: the call
launches the collective and returns a work handle whose ``wait()`` finishes the
reduction. Layout for a flat buffer of ``N = W * S`` elements over ``W`` ranks:

* shard ``j`` is elements ``[j*S, (j+1)*S)``; each shard is zero-padded to whole
  quantisation blocks (``P = ceil(S/B)*B``) so that no element is ever sent
  uncompressed and block boundaries never straddle two shards;
* the send buffer is ``uint8 [W, code_bytes + 4*P/B]``: row ``j`` holds this rank's
  packed codes for shard ``j`` followed by the fp32 scales' bytes;
* one ``all_to_all_single`` delivers row ``j`` of every rank to rank ``j``;
* ``wait()`` dequantises the ``W`` received rows and sums them in fp32 in rank
  order (deterministic), then writes the shard (cast to the buffer dtype).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.loco import quantize as qz
from loco_megatron.metrics.comm import WallClock


class ShardLayout:
    """Sizes of one bucket's compressed reduce-scatter."""

    def __init__(self, numel: int, world: int, bits: int, block_size: int):
        if numel % world:
            raise ValueError(f"buffer of {numel} elements does not split over {world} ranks")
        self.numel, self.world, self.bits, self.block_size = numel, world, bits, block_size
        self.shard = numel // world
        self.shard_blocks = qz.num_blocks(self.shard, block_size)
        self.padded_shard = self.shard_blocks * block_size
        self.code_bytes = self.padded_shard * bits // 8
        self.row_bytes = self.code_bytes + 4 * self.shard_blocks

    @property
    def compressed_numel(self) -> int:
        """Elements the compressor sees: every shard padded to whole blocks."""
        return self.world * self.padded_shard

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` as ``[W, P]`` (a view when no padding is needed)."""
        rows = flat.view(self.world, self.shard)
        if self.padded_shard == self.shard:
            return rows
        return torch.nn.functional.pad(rows, (0, self.padded_shard - self.shard))

    def pack(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """One uint8 ``[W, row_bytes]`` send buffer from per-buffer codes and scales."""
        return torch.cat([codes.view(self.world, self.code_bytes),
                          scales.float().view(torch.uint8).view(self.world, -1)], dim=1)

    def unpack_row(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return row[: self.code_bytes], row[self.code_bytes:].contiguous().view(torch.float32)


CHUNK_ELEMENTS = 1 << 16
"""Elements per slice of :func:`decompress_into`: its fp32 temporaries (256 KiB each) stay in
cache and are reused, instead of shard-sized ones allocated (fresh pages, faulted in on
first touch) and streamed through memory on every call."""


def decompress_into(recv: torch.Tensor, layout: ShardLayout, out: torch.Tensor, scale: float = 1.0) -> None:
    """``out = scale * sum_r D(row r of recv)``, summed in fp32 in rank order and cast to
    ``out``'s dtype (the reference path; ``out`` has ``layout.shard`` elements).

    Works through the shard in slices of whole blocks (:data:`CHUNK_ELEMENTS`); every
    element sees the same fp32 operations in the same order as a whole-shard
    ``acc = part_0; acc += part_r; acc *= scale`` would, so the slicing changes no bit.
    """
    B, bits = layout.block_size, layout.bits
    step = max(1, CHUNK_ELEMENTS // B)  # blocks per slice
    nblk_total = layout.shard_blocks
    scales = [layout.unpack_row(recv[r])[1] for r in range(layout.world)]
    acc_buf = torch.empty(min(step, nblk_total) * B, dtype=torch.float32, device=recv.device)
    part_buf = torch.empty_like(acc_buf)
    for b0 in range(0, nblk_total, step):
        nb = min(step, nblk_total - b0)
        acc, part = acc_buf[: nb * B].view(nb, B), part_buf[: nb * B].view(nb, B)
        lo, hi = b0 * B * bits // 8, (b0 + nb) * B * bits // 8
        for r in range(layout.world):
            q = qz.unpack_codes(recv[r, lo:hi], bits, B).view(nb, B)
            torch.mul(q, scales[r][b0:b0 + nb].unsqueeze(1), out=acc if r == 0 else part)
            if r:
                acc.add_(part)
        if scale != 1.0:
            acc.mul_(scale)
        start = b0 * B
        n = min(nb * B, layout.shard - start)
        out[start:start + n].copy_(acc.view(-1)[:n])


def decompress_sum(recv: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """fp32 ``[S]``: the sum over ranks, in rank order, of the dequantised rows of ``recv``."""
    out = torch.empty(layout.shard, dtype=torch.float32, device=recv.device)
    decompress_into(recv, layout, out)
    return out


class CompressedReduceScatterWork:
    """Handle of an in-flight compressed reduce-scatter; ``wait()`` completes it.

    After ``wait()``: ``out`` holds this rank's reduced shard (and, with
    ``all_gather_group``, the full buffer holds every reduced shard). The clock marks
    ``launch_mark``, ``decompress_marks`` (start, end) and ``done_mark`` describe what
    it cost (see :mod:`loco_megatron.metrics.comm`).
    """

    def __init__(self, work, recv: torch.Tensor, layout: ShardLayout, out: torch.Tensor,
                 group, gather_into: Optional[torch.Tensor], scale: float, clock, launch_mark,
                 decompress: Callable = decompress_into):
        self._work, self._recv, self._layout, self._out = work, recv, layout, out
        self._decompress = decompress
        self._group, self._gather_into, self._scale = group, gather_into, scale
        self.clock, self.launch_mark = clock, launch_mark
        self.done_mark = None
        self.decompress_marks: Optional[tuple] = None

    def is_completed(self) -> bool:
        """True when the transfer is done (``wait()`` then only decompresses); never blocks."""
        return self.done_mark is not None or self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self.done_mark is not None:
            return
        if self._work is not None:
            self._work.wait()
        start = self.clock.mark()
        self._decompress(self._recv, self._layout, self._out, self._scale)
        self.decompress_marks = (start, self.clock.mark())
        if self._gather_into is not None:
            # Without the distributed optimizer every rank needs the whole reduced
            # buffer: gather the reduced shards at the gradient dtype.
            dist.all_gather_into_tensor(self._gather_into, self._out.clone(), group=self._group)
        self.done_mark = self.clock.mark()
        self._recv = None


def compressed_reduce_scatter(
    buffer: torch.Tensor,
    compress: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    layout: ShardLayout,
    group,
    async_op: bool = True,
    all_gather: bool = False,
    average: bool = False,
    clock=None,
    decompress: Callable = decompress_into,
) -> tuple[CompressedReduceScatterWork, int]:
    """Launch the compressed reduce-scatter of flat ``buffer`` over ``group``.

    ``compress`` maps the ``[W*P]`` padded buffer to ``(codes, scales)`` (a
    :class:`LoCoCompressor`'s ``compress``). The reduced shard lands in this rank's
    shard of ``buffer``; with ``all_gather`` every shard does. Returns the work handle
    and the number of payload bytes this rank sent. With ``async_op=False`` the
    handle is already complete. ``clock`` marks launch and completion (wall-clock
    by default).
    """
    clock = clock or WallClock()
    rank = dist.get_rank(group)
    codes, scales = compress(layout.padded(buffer).reshape(-1))
    send = layout.pack(codes, scales)
    recv = torch.empty_like(send)
    launch = clock.mark()
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    out = buffer.view(layout.world, layout.shard)[rank]
    handle = CompressedReduceScatterWork(
        work, recv, layout, out, group, buffer if all_gather else None,
        1.0 / layout.world if average else 1.0, clock, launch, decompress)
    if not async_op:
        handle.wait()
    return handle, send.numel()
