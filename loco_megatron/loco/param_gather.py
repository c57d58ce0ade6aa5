"""Compressed parameter all-gather: one all-gather of quantised weight differences.

In place of the distributed optimizer's ``all_gather_into_tensor(param_data, own
shard)``: each rank encodes ``d = new_own - agreed_own``
(:func:`~loco_megatron.loco.param_delta.encode_delta`), one
``all_gather_into_tensor`` of uint8 rows delivers every shard's codes and scales to
every rank, and the work handle's ``wait()`` applies ``agreed_j += D(Q(d_j))`` to every
shard ``j`` of the buffer, the owner's included (so every rank ends with bit-identical
parameters; see :mod:`~loco_megatron.loco.param_delta` for the invariant).

``wait()`` applies the rows (:func:`apply_gathered`): on the fused kernels (C++ on CPU,
Triton on CUDA) in one pass per row that decodes, adds and casts with no delta tensor at
all; on torch chunk by chunk
(:meth:`~loco_megatron.loco.param_delta.DeltaLayout.chunks`), so its temporaries do not
grow with the bucket. The collective goes through a
:class:`~loco_megatron.loco.collectives.CollectiveOps` (tests record it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from loco_megatron.loco.collectives import TORCH_OPS, CollectiveOps
from loco_megatron.loco.param_delta import (AgreedShard, DeltaLayout, add_delta, apply_row, decode_chunk,
                                            encode_delta, row_scales)
from loco_megatron.metrics.comm import WallClock


class ParamGatherWork:
    """Handle of an in-flight compressed parameter all-gather; ``wait()`` completes it.

    After ``wait()``: every ``[S]`` shard of ``buffer`` holds the new agreed values,
    ``stats`` is a float64 ``[3]`` device tensor ``(||agreed_own - new_own||^2,
    ||new_own||^2, shards not applied because non-finite)``, and ``compress_marks`` /
    ``decompress_marks`` / ``done_mark`` are clock marks of what it cost.
    """

    def __init__(self, work, send: torch.Tensor, recv: torch.Tensor, layout: DeltaLayout, buffer: torch.Tensor,
                 shard: AgreedShard, rank: int, clock, compress_marks: tuple):
        # send stays referenced until wait(): an async collective may still read it.
        self._work, self._send, self._recv, self._layout, self._buffer = work, send, recv, layout, buffer
        self._shard, self._rank, self.clock = shard, rank, clock
        self.compress_marks, self.launch_mark = compress_marks, compress_marks[1]
        self.decompress_marks: Optional[tuple] = None
        self.done_mark = None
        self.stats: Optional[torch.Tensor] = None

    def wait(self) -> None:
        if self.done_mark is not None:
            return
        if self._work is not None:
            self._work.wait()
        start = self.clock.mark()
        layout = self._layout
        recv = self._recv.view(layout.world, layout.row_bytes)
        sums, finite = apply_gathered(recv, layout, self._buffer, self._shard, self._rank)
        self.stats = torch.cat([sums, (~finite).sum().double().reshape(1)])
        self._shard.finished()
        self.decompress_marks = (start, self.clock.mark())
        self.done_mark = self.decompress_marks[1]
        self._recv = self._send = None


def apply_gathered(recv: torch.Tensor, layout: DeltaLayout, buffer: torch.Tensor, shard: AgreedShard, rank: int,
                   fused: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the gathered rows (uint8 ``[W, row_bytes]``) to ``buffer`` (``[W*S]``): every
    shard ``j`` gets ``agreed_j += D(Q(d_j))``, the own one with
    :meth:`AgreedShard.finish_slice`'s moves (fused: :meth:`AgreedShard.apply_slots`; then
    the caller calls :meth:`AgreedShard.finished`).
    Returns the float64 ``[2]`` ``(||agreed_own - new_own||^2, ||new_own||^2)`` and the
    bool ``[W]`` mask of the finite rows (a row that is not finite has zeroed scales: its
    delta is zero). ``fused`` (default: on the ``cpu`` and ``triton`` kernels): the fused
    decode-and-apply (:func:`.param_delta.apply_row`, one pass per row, nothing the size
    of a chunk); else decode a chunk (``layout.kernels``' decode), then add it."""
    scales, finite = row_scales(recv, layout)
    rows = buffer.view(layout.world, layout.shard)
    sums = torch.zeros(2, dtype=torch.float64, device=buffer.device)  # ||agreed-new||^2, ||new||^2
    if fused is None:
        fused = layout.kernels != "torch"
    if fused:
        slots = shard.apply_slots()
        for j in range(layout.world):
            if j != rank:  # rows[j] holds the agreed shard j (only gathers write it): in place
                apply_row(recv[j], scales[j], layout, rows[j], rows[j])
                continue
            # The own shard chunk by chunk: its per-chunk norm partials stay chunk-sized.
            for b0, b1, _, _ in layout.chunks():
                sums += apply_row(recv[j], scales[j], layout, slots.src, slots.dst, slots.new, slots.dst2,
                                  slots.swap, (b0, b1))
        return sums, finite
    for j in range(layout.world):
        for b0, b1, lo, hi in layout.chunks():
            delta = decode_chunk(recv[j], scales[j], layout, b0, b1, hi - lo)
            if j != rank:  # rows[j] holds the agreed shard j (only gathers write it)
                # In place, the same bits as add_delta: add_ of an fp32 delta computes in
                # fp32 and rounds once to the parameter dtype (tested).
                rows[j, lo:hi].add_(delta)
                continue
            new = rows[j, lo:hi]  # the optimizer's update, at the parameter dtype
            agreed = add_delta(shard.agreed()[lo:hi], delta)
            # Metrics only (loco/param_rel_error): fp32 norms per chunk, summed in
            # float64 across chunks; float64 elementwise cost as much as the decode.
            sums[0] += torch.linalg.vector_norm(agreed.float() - new.float()).double().square()
            sums[1] += torch.linalg.vector_norm(new, dtype=torch.float32).double().square()
            shard.finish_slice(lo, hi, agreed)
    return sums, finite


def compressed_param_all_gather(buffer: torch.Tensor, shard: AgreedShard, layout: DeltaLayout, group,
                                async_op: bool = True, clock=None,
                                ops: CollectiveOps = TORCH_OPS) -> tuple[ParamGatherWork, int]:
    """Launch the compressed all-gather of flat ``buffer`` (``[W*S]``, parameter dtype)
    over ``group``.

    Before: ``buffer``'s own shard holds this rank's updated values, every other shard
    the agreed values, ``shard.agreed()`` the agreed own shard. Returns the work handle
    and the bytes of the gathered buffer (``W * row_bytes``; each rank contributes one
    row). With ``async_op=False`` the handle is already complete.
    """
    clock = clock or WallClock()
    rank = dist.get_rank(group)
    start = clock.mark()
    send = encode_delta(buffer.view(layout.world, layout.shard)[rank], shard.agreed(), layout,
                        key=layout.noise_key(rank, shard.gathers))
    recv = torch.empty(layout.gathered_bytes, dtype=torch.uint8, device=buffer.device)
    launch = clock.mark()
    work = ops.all_gather_into_tensor(recv, send, group=group, async_op=async_op)
    handle = ParamGatherWork(work if async_op else None, send, recv, layout, buffer, shard, rank, clock,
                             (start, launch))
    if not async_op:
        handle.wait()
    return handle, layout.gathered_bytes
