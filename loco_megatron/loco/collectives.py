"""LoCo's compressed reduce-scatter: one all-to-all of low-bit codes, fp32 sum.

Modelled on megatron-core's ``reduce_scatter_with_fp32_accumulation``: the call
launches the collective and returns a work handle whose ``wait()`` finishes the
reduction. Layout for a flat buffer of ``N`` elements over ``W`` ranks
(:class:`ShardLayout`):

* the buffer is ``W * pieces`` consecutive rows of ``S = ceil(N / (W*pieces))``
  elements (the last rows may be shorter, or empty, when ``N`` does not divide: without
  the distributed optimizer megatron does not pad its buckets); row ``i`` goes to rank
  ``i % W``. ``pieces = 1`` is the plain reduce-scatter (row ``j`` = shard ``j``);
  two-hop LoCo's intra-node hop uses ``pieces = nodes``;
* each row is zero-padded to whole quantisation blocks (``P = ceil(S/B)*B``) inside
  the compressor, so no element is ever sent uncompressed, block boundaries never
  straddle two rows, and no padded copy of the buffer is made;
* the send buffer is ``uint8 [W, pieces * (code_bytes + 4*P/B)]``: row ``j`` holds this
  rank's packed codes for its rows ``i % W == j`` followed by their fp32 scales' bytes;
* one ``all_to_all_single`` delivers row ``j`` of every rank to rank ``j``;
* ``wait()`` dequantises the ``W`` received rows and sums them in fp32 in rank
  order (deterministic), then writes the result (cast to the output's dtype). With
  ``--loco-rotation hadamard`` the rows were rotated before quantising: the sum is
  unrotated once (the rotation is linear), before the ``average`` scaling.

The payload is the same for every quantiser option: ``code_bytes`` of packed codes
(``bits/8`` per padded element) plus 4 bytes of fp32 scale per block; the rotation's
signs come from a seed every rank shares and stochastic rounding needs nothing on the
receiving side, so no option adds side information.

Collectives are issued through a :class:`CollectiveOps` (plain ``torch.distributed``
by default; tests inject a recording one), in program order only: nothing here
decides what to launch by polling a handle.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.loco import quantize as qz
from loco_megatron.loco import rotation as rot
from loco_megatron.metrics.comm import WallClock


def _current(name: str) -> Callable:
    """``torch.distributed.<name>`` as it is when called (the platform layer may stage it)."""
    return lambda *args, **kwargs: getattr(dist, name)(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class CollectiveOps:
    """The ``torch.distributed`` collectives LoCo issues (swap in a wrapper to record or
    delay them; each has torch's signature and returns torch's work handle)."""

    all_to_all_single: Callable = _current("all_to_all_single")
    all_gather: Callable = _current("all_gather")
    all_gather_into_tensor: Callable = _current("all_gather_into_tensor")
    all_reduce: Callable = _current("all_reduce")
    get_rank: Callable = _current("get_rank")
    """``get_rank(group)``: this rank's place in ``group`` (a group outside torch.distributed's
    registry, as torchft's, answers through its own ops)."""
    get_world_size: Callable = _current("get_world_size")


TORCH_OPS = CollectiveOps()


class ShardLayout:
    """Sizes of one bucket's compressed reduce-scatter (see the module docstring).

    ``piece``/``piece_padded``: ``S`` and ``P`` of one row. What one destination
    receives from each source: ``shard`` elements to write (``S`` for ``pieces = 1``;
    ``pieces * P`` otherwise, padding included), in ``shard_blocks`` blocks,
    ``code_bytes`` of codes then ``4 * shard_blocks`` of scales (``row_bytes``).
    """

    def __init__(self, numel: int, world: int, bits: int, block_size: int, pieces: int = 1,
                 options: Optional[qz.QuantOptions] = None):
        self.numel, self.world, self.bits, self.block_size = numel, world, bits, block_size
        self.options = options or qz.DEFAULT_OPTIONS
        """How the rows were quantised (the receiver needs the quantiser and the rotation)."""
        self._signs: dict = {}  # device -> Hadamard signs, derived once (not per bucket per step)
        self.pieces = pieces
        self.rows = world * pieces
        self.piece = -(-numel // self.rows)
        self.piece_blocks = qz.num_blocks(self.piece, block_size)
        self.piece_padded = self.piece_blocks * block_size
        self.shard = self.piece if pieces == 1 else pieces * self.piece_padded
        self.shard_blocks = pieces * self.piece_blocks
        self.padded_shard = pieces * self.piece_padded
        self.code_bytes = self.padded_shard * bits // 8
        self.row_bytes = self.code_bytes + 4 * self.shard_blocks

    def rotation_signs(self, device) -> Optional[torch.Tensor]:
        """fp32 ``[block_size]`` Hadamard signs on ``device`` (None without rotation)."""
        if self.options.rotation != "hadamard":
            return None
        if device not in self._signs:
            self._signs[device] = rot.signs(self.block_size, self.options.seed, device)
        return self._signs[device]

    @property
    def divides(self) -> bool:
        """True when every row holds exactly ``S`` elements."""
        return self.piece * self.rows == self.numel

    @property
    def compressed_numel(self) -> int:
        """Elements the compressor quantises: every row padded to whole blocks."""
        return self.rows * self.piece_padded

    def row_range(self, i: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of the buffer in row ``i`` (empty past the end)."""
        start = min(i * self.piece, self.numel)
        return start, min(start + self.piece, self.numel)

    def compressor_shape(self) -> dict:
        """Keyword arguments that make a :class:`LoCoCompressor` for this layout."""
        return {"numel": self.numel, "rows": self.rows}

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` as ``[rows, P]``, zero-padded (a copy; for tests and benchmarks)."""
        out = torch.zeros(self.rows, self.piece_padded, dtype=flat.dtype, device=flat.device)
        for i in range(self.rows):
            a, b = self.row_range(i)
            out[i, : b - a] = flat[a:b]
        return out

    def pack(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """One uint8 ``[W, row_bytes]`` send buffer from per-buffer codes and scales
        (row ``i`` of the buffer goes to destination ``i % W``)."""
        c = codes.view(self.pieces, self.world, -1).transpose(0, 1).reshape(self.world, -1)
        s = scales.float().view(torch.uint8).view(self.pieces, self.world, -1).transpose(0, 1)
        return torch.cat([c, s.reshape(self.world, -1)], dim=1)

    def unpack_row(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return row[: self.code_bytes], row[self.code_bytes:].contiguous().view(torch.float32)


CHUNK_ELEMENTS = 1 << 16
"""Elements per slice of :func:`decompress_into`: its fp32 temporaries (256 KiB each) stay in
cache and are reused, instead of shard-sized ones allocated (fresh pages, faulted in on
first touch) and streamed through memory on every call."""


def decompress_into(recv: torch.Tensor, layout: ShardLayout, out: torch.Tensor, scale: float = 1.0) -> None:
    """``out = scale * sum_r D(row r of recv)``, summed in fp32 in rank order and cast to
    ``out``'s dtype (the reference path). ``out`` may be shorter than ``layout.shard``
    (a ragged last row): only its prefix is written.

    Works through the shard in slices of whole blocks (:data:`CHUNK_ELEMENTS`); every
    element sees the same fp32 operations in the same order as a whole-shard
    ``acc = part_0; acc += part_r; acc *= scale`` would, so the slicing changes no bit.
    """
    B, bits, opts = layout.block_size, layout.bits, layout.options
    signs = layout.rotation_signs(recv.device)
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
            qz.dequant_codes(q, scales[r][b0:b0 + nb], opts, out=acc if r == 0 else part)
            if r:
                acc.add_(part)
        if signs is not None:
            acc.copy_(rot.unrotate(acc, signs))
        if scale != 1.0:
            acc.mul_(scale)
        start = b0 * B
        n = min(nb * B, out.numel() - start)
        if n <= 0:
            break
        out[start:start + n].copy_(acc.view(-1)[:n])


def gather_rows(buffer: torch.Tensor, mine: torch.Tensor, layout: ShardLayout, group,
                ops: CollectiveOps = TORCH_OPS) -> int:
    """Without the distributed optimizer every rank needs the whole reduced buffer: all-
    gather every rank's reduced row (``layout.pieces == 1``: row ``j`` on group rank ``j``)
    into ``buffer`` at its dtype. Synchronous. Returns the bytes this rank handed over."""
    send = torch.zeros(layout.piece, dtype=buffer.dtype, device=buffer.device)
    send[: mine.numel()] = mine  # a copy: the collective reads it while buffer is written
    if layout.divides:
        ops.all_gather_into_tensor(buffer, send, group=group)
    else:  # ragged last rows: receive them into temporaries and copy the valid prefix
        outs, ragged = [], []
        for i in range(layout.rows):
            a, b = layout.row_range(i)
            if b - a == layout.piece:
                outs.append(buffer[a:b])
            else:
                outs.append(torch.empty_like(send))
                ragged.append((outs[-1], a, b))
        ops.all_gather(outs, send, group=group)
        for tmp, a, b in ragged:
            buffer[a:b] = tmp[: b - a]
    return send.numel() * send.element_size()


class CompressedReduceScatterWork:
    """Handle of an in-flight compressed reduce-scatter; ``wait()`` completes it.

    After ``wait()``: ``out`` holds this rank's reduced rows (and, with ``gather_into``,
    the full buffer holds every reduced row). The clock marks ``launch_mark``,
    ``decompress_marks`` (start, end) and ``done_mark`` describe what it cost (see
    :mod:`loco_megatron.metrics.comm`); ``gather_bytes`` what the all-gather handed over.
    """

    def __init__(self, work, send: torch.Tensor, recv: torch.Tensor, layout: ShardLayout, out: torch.Tensor,
                 group, gather_into: Optional[torch.Tensor], scale: float, clock, launch_mark,
                 decompress: Callable = decompress_into, ops: CollectiveOps = TORCH_OPS):
        # send stays referenced until wait(): the collective may read it until it completes
        # (a backend that does not track its inputs' lifetime would read freed memory).
        self._work, self._send, self._recv, self._layout, self._out = work, send, recv, layout, out
        self._decompress, self._ops = decompress, ops
        self._group, self._gather_into, self._scale = group, gather_into, scale
        self.clock, self.launch_mark = clock, launch_mark
        self.done_mark = None
        self.decompress_marks: Optional[tuple] = None
        self.gather_bytes = 0

    def set_output(self, out: torch.Tensor) -> None:
        """Where ``wait()`` writes the reduced rows (when not given at launch)."""
        self._out = out

    @property
    def output(self) -> torch.Tensor:
        return self._out

    def wait(self) -> None:
        if self.done_mark is not None:
            return
        assert self._out is not None, "set_output() before wait()"
        if self._work is not None:
            self._work.wait()
        start = self.clock.mark()
        self._decompress(self._recv, self._layout, self._out, self._scale)
        self.decompress_marks = (start, self.clock.mark())
        if self._gather_into is not None:
            self.gather_bytes = gather_rows(self._gather_into, self._out, self._layout, self._group, self._ops)
        self.done_mark = self.clock.mark()
        self._recv = self._send = None


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
    out: Optional[torch.Tensor] = None,
    ops: CollectiveOps = TORCH_OPS,
    scale: Optional[float] = None,
) -> tuple[CompressedReduceScatterWork, int]:
    """Launch the compressed reduce-scatter of flat ``buffer`` over ``group``.

    ``compress`` maps the flat ``buffer`` to ``(codes, scales)`` of its rows, each padded
    to whole blocks (a :class:`LoCoCompressor` built with ``layout.compressor_shape()``).
    The reduced row lands in this rank's row of ``buffer`` (``pieces = 1``) or in ``out``
    (fp32 ``[layout.shard]``; when ``pieces > 1`` it may be set later with
    ``handle.set_output``, before ``wait()``); with ``all_gather`` every
    row lands in ``buffer``. Returns the work handle and the payload bytes this rank
    handed to the all-to-all (the all-gather's are ``handle.gather_bytes`` once
    waited). With ``async_op=False`` the handle is already complete, unless its output
    is still to be set (then the transfer is done and ``wait()`` only decompresses). ``clock`` marks
    launch and completion (wall-clock by default). The reduced rows are multiplied by
    ``scale`` (default: ``1 / world`` with ``average``, else 1).
    """
    clock = clock or WallClock()
    rank = ops.get_rank(group)
    codes, scales = compress(buffer)
    send = layout.pack(codes, scales)
    recv = torch.empty_like(send)
    launch = clock.mark()
    work = ops.all_to_all_single(recv, send, group=group, async_op=async_op)
    if out is None and layout.pieces == 1:
        a, b = layout.row_range(rank)
        out = buffer[a:b]
    handle = CompressedReduceScatterWork(
        work, send, recv, layout, out, group, buffer if all_gather else None,
        scale if scale is not None else (1.0 / layout.world if average else 1.0), clock, launch, decompress, ops)
    if not async_op and out is not None:  # else the caller sets the output, then waits
        handle.wait()
    return handle, send.numel()


def gathered_layout(numel: int, world: int, bits: int, block_size: int,
                    options: Optional[qz.QuantOptions] = None) -> ShardLayout:
    """Layout of :func:`compressed_all_gather_sum`: ``world`` rows, each one rank's whole
    ``numel``-element buffer (``S = numel``, padded to whole blocks, exactly as a
    ``rows = 1`` :class:`LoCoCompressor` of ``numel`` pads it), so ``row_bytes`` is one
    rank's packed codes + scales and the decompress-and-sum kernels apply unchanged."""
    return ShardLayout(numel * world, world, bits, block_size, options=options)


class CodeGather:
    """An all-gather of every rank's codes and scales (one packed uint8 row each: codes, then
    the fp32 scales' bytes), with a work handle. ``send`` stays referenced until
    :meth:`wait`: the collective may read it until it completes."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, world: int, group, async_op: bool,
                 ops: CollectiveOps = TORCH_OPS):
        self.send = torch.cat([codes.reshape(-1), scales.float().reshape(-1).view(torch.uint8)])
        self.recv = torch.empty(world * self.send.numel(), dtype=torch.uint8, device=self.send.device)
        self.world, self.row_bytes = world, self.send.numel()
        # flat: gloo wants the output 1-D
        self._work = ops.all_gather_into_tensor(self.recv, self.send, group=group, async_op=async_op)

    def wait(self) -> torch.Tensor:
        """uint8 ``[world, row_bytes]``: row ``r`` from group rank ``r``."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.send = None
        return self.recv.view(self.world, -1)


def decode_rows_into(rows: torch.Tensor, layout: ShardLayout, row_layout: ShardLayout, out: torch.Tensor,
                     decompress: Callable = decompress_into) -> None:
    """Row ``r`` of the gathered ``rows`` (uint8 ``[world, row_bytes]``, each one row of
    ``row_layout``) decoded into its place ``layout.row_range(r)`` of the flat ``out``
    (``layout.numel`` elements): every rank decodes the same bytes, so all of them hold
    the same values, bit for bit."""
    for r in range(layout.world):
        a, b = layout.row_range(r)
        if b > a:
            decompress(rows[r:r + 1], row_layout, out[a:b])


def compressed_all_gather_sum(
    buffer: torch.Tensor,
    compress: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    layout: ShardLayout,
    group,
    average: bool = False,
    clock=None,
    decompress: Callable = decompress_into,
    ops: CollectiveOps = TORCH_OPS,
) -> tuple[tuple, int]:
    """All-reduce of flat ``buffer`` over ``group`` by gathering compressed codes:
    ``buffer = scale * sum_r D(C_r(buffer_r))``, summed in fp32 in rank order, so every
    rank ends with bit-identical values. Synchronous.

    ``compress`` maps the whole ``buffer`` (``layout.piece`` elements) to ``(codes,
    scales)`` of one row (a ``rows = 1`` :class:`LoCoCompressor`); ``layout`` is
    :func:`gathered_layout`. One ``all_gather_into_tensor`` of the uint8 ``[row_bytes]``
    row into ``[world * row_bytes]`` (row ``r`` from group rank ``r``). Returns the clock marks ``(start, launch,
    decompress start, end)`` and the bytes this rank sent: ``(world - 1) * row_bytes``.
    """
    clock = clock or WallClock()
    start = clock.mark()
    assert buffer.numel() == layout.piece, (buffer.numel(), layout.piece)
    codes, scales = compress(buffer)
    launch = clock.mark()
    gather = CodeGather(codes, scales, layout.world, group, async_op=False, ops=ops)
    assert gather.row_bytes == layout.row_bytes, (gather.row_bytes, layout.row_bytes)
    dstart = clock.mark()
    decompress(gather.wait(), layout, buffer, 1.0 / layout.world if average else 1.0)
    return (start, launch, dstart, clock.mark()), (layout.world - 1) * layout.row_bytes
