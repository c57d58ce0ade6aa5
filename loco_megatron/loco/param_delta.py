"""Weight-difference quantisation for the parameter all-gather: pure tensor functions.

No torch.distributed and no megatron here. A bucket's flat parameter buffer of
``N = W * S`` elements is split into ``W`` shards of ``S`` elements; rank ``j`` owns
shard ``j`` (the distributed optimizer updates it). Every rank holds the *agreed*
parameters ``A`` (``[W, S]``, the parameter dtype), bit-identical on all ranks.

One gather, for the owner of shard ``j`` with updated values ``P_j``:

* ``d_j = P_j - A_j`` in fp32, zero-padded to whole blocks of ``B`` elements;
* ``(codes_j, scales_j) = quantize_blockwise(d_j, options)`` (LoCo's quantiser, one
  fp32 scale per block: at 8/4 bits the original symmetric absmax scheme, round half to
  even; at 2 bits the quantiser options of :attr:`DeltaLayout.options`, e.g. uniform grid,
  mse scale, Hadamard rotation; a rotated delta is unrotated by the decode, so ``D(Q(d))``
  is always in the parameter domain);
* every rank, the owner included, sets ``A_j <- cast(float(A_j) + D(Q(d_j)))``.

Invariant: every input of that update (``A_j``, codes, scales) is bit-identical on
all ranks and the arithmetic is elementwise and deterministic, so ``A`` stays
bit-identical on every rank. Because ``d`` is always taken against ``A``, rounding
does not accumulate: after a gather ``P_j - A_j`` is one quantisation of one
difference (plus the cast to the parameter dtype).

Non-finite differences: a shard whose scales are not all finite is *not* applied
(``A_j`` unchanged on every rank - the decision depends only on the gathered scales,
so it is identical everywhere) and is counted, so the caller can fail loudly.

Wire row of one shard: ``uint8 [code_bytes + 4 * blocks]`` = packed codes followed by
the fp32 scales' bytes.

Memory: encode and decode work through each shard in chunks of whole blocks
(:data:`DECODE_CHUNK` elements), so their temporaries are at most
``CHUNK_TEMP_BYTES_PER_ELEMENT * DECODE_CHUNK`` bytes (12 MiB) whatever the bucket size
(the fused apply, :func:`apply_row`, needs none: one block per thread on the stack, or
in a Triton tile); :meth:`DeltaLayout.transient_bytes` adds the wire rows.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from loco_megatron.loco import quantize as qz
from loco_megatron.loco import rotation as rot

PARAM_GATHER_BITS = (2, 4, 8)


DECODE_CHUNK = 1 << 18
"""Elements of one shard handled at a time by the encode and the decode: their
temporaries are sized by this, not by the bucket (megatron gives every pipeline stage
after the first, and any run with --no-overlap-grad-reduce, one bucket for the stage).
Large enough that the per-chunk launch cost of the dozen tensor ops of an encode or a
decode stays small against their work: that cost is fixed per chunk, so a chunk much
smaller than this spends as long launching as computing."""

CHUNK_TEMP_BYTES_PER_ELEMENT = 48
"""Upper bound on the temporaries one chunk element needs at once, in bytes: the fp32
delta (4), int8 codes and their unpack temporaries (<= 3), the fp32 agreed value and the
fp32 sum (8), the cast result (<= 4), and the error and norm terms (fp32, <= 24)."""

OPTIONS_CHUNK_TEMP_BYTES_PER_ELEMENT = 96
"""The same bound with quantiser options (torch reference): the rotated blocks, the mse
search's quotient and work buffers, the levels and the stochastic-rounding noise with its
int64 hash temporaries add fp32 and int64 tensors of the chunk's size (at most 48 more)."""


class DeltaLayout:
    """Sizes of one bucket's compressed parameter all-gather."""

    def __init__(self, numel: int, world: int, bits: int, block_size: int, kernels: str = "torch",
                 chunk: int = DECODE_CHUNK, options: qz.QuantOptions = qz.DEFAULT_OPTIONS, stream: int = 0):
        """``kernels``: ``"torch"`` (the reference), ``"cpu"`` (the fused C++ kernels of
        :mod:`.cpu_kernels`) or ``"triton"`` (the fused Triton kernels, CUDA): the encode
        through the compress kernel without error feedback, the apply through the fused
        decode-and-apply (:func:`apply_row`); the same codes, scales and parameters, bit for bit.
        ``chunk``: elements per encode/decode slice (rounded down to whole blocks, so a
        rotation block never straddles chunks). ``options``: the quantiser options (the
        same on every rank); ``stream``: this bucket's part of the stochastic-rounding key
        (:meth:`noise_key`)."""
        if bits not in PARAM_GATHER_BITS:
            raise ValueError(f"param-gather bits must be one of {PARAM_GATHER_BITS}, got {bits}")
        if options.rotation == "hadamard":
            rot.check_block_size(block_size)
        self.options, self.stream = options, stream
        self.plain = not options.non_default()
        if numel % world:
            raise ValueError(f"buffer of {numel} elements does not split over {world} ranks")
        self.numel, self.world, self.bits, self.block_size = numel, world, bits, block_size
        self.kernels = kernels
        self.shard = numel // world
        self.blocks = qz.num_blocks(self.shard, block_size)
        self.code_bytes = qz.packed_nbytes(self.shard, bits, block_size)
        self.row_bytes = self.code_bytes + 4 * self.blocks
        self.chunk_blocks = max(1, chunk // block_size)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the gathered ``[W, row_bytes]`` buffer (the all-gather's output)."""
        return self.world * self.row_bytes

    def chunks(self):
        """``(b0, b1, lo, hi)``: blocks ``[b0, b1)`` of a shard, elements ``[lo, hi)``."""
        B = self.block_size
        for b0 in range(0, self.blocks, self.chunk_blocks):
            b1 = min(b0 + self.chunk_blocks, self.blocks)
            yield b0, b1, b0 * B, min(b1 * B, self.shard)

    def chunk_bytes(self, b0: int, b1: int) -> tuple[int, int]:
        """Bytes ``[start, end)`` of blocks ``[b0, b1)``'s codes in a row (codes are packed
        per block, so a block's codes are whole bytes of their own)."""
        per_block = self.block_size * self.bits // 8
        return b0 * per_block, b1 * per_block

    def noise_key(self, rank: int, gathers: int) -> int:
        """Stochastic-rounding key of ``rank``'s row in its ``gathers``-th gather of this
        bucket (0 when rounding is nearest): a hash of the seed, the bucket, the owner and
        the checkpointed gather count, so a resumed run rounds exactly as an unbroken one."""
        if self.options.rounding != "stochastic":
            return 0
        return qz.noise_key(self.options.seed ^ self.stream, rank, gathers)

    def chunk_temp_bytes(self) -> int:
        """Most bytes of temporaries one encode or decode chunk holds at once."""
        per = CHUNK_TEMP_BYTES_PER_ELEMENT if self.plain else OPTIONS_CHUNK_TEMP_BYTES_PER_ELEMENT
        return per * min(self.chunk_blocks, self.blocks) * self.block_size

    def transient_bytes(self) -> int:
        """Most bytes one gather of this bucket holds besides the model and the agreed copy:
        the sent row and the ``W`` gathered rows (``bits / 8 + 4 / block`` bytes per
        element: the wire itself), two copies of the gathered scales (``8 / block`` per
        element) and :meth:`chunk_temp_bytes`, which does not grow with the bucket."""
        return self.row_bytes * (self.world + 1) + 8 * self.world * self.blocks + self.chunk_temp_bytes()


class _ChunkLayout(NamedTuple):
    """What :func:`.cpu_kernels.decompress_sum` reads of a layout, for one chunk's row."""

    code_bytes: int
    bits: int
    block_size: int
    options: qz.QuantOptions


def encode_delta(new: torch.Tensor, agreed: torch.Tensor, layout: DeltaLayout,
                 out: Optional[torch.Tensor] = None, key: int = 0) -> torch.Tensor:
    """One shard's wire row (uint8 ``[row_bytes]``, into ``out`` when given) for ``d = new
    - agreed``, quantised chunk by chunk (blocks never straddle chunks, so the row is the
    same as one pass's).

    ``new``, ``agreed``: ``[S]`` of any float dtype (compared in fp32). ``key``
    (:meth:`DeltaLayout.noise_key`): stochastic rounding; chunk ``b0``'s noise is keyed by
    ``(key, b0)`` and indexed from the chunk's start on both paths, so torch and the C++
    kernels round alike (the row then depends on the chunk size, fixed per run).
    """
    row = out if out is not None else torch.empty(layout.row_bytes, dtype=torch.uint8, device=new.device)
    scales = row[layout.code_bytes:].view(torch.float32)
    for b0, b1, lo, hi in layout.chunks():
        d = new[lo:hi].float() - agreed[lo:hi].float()
        ck = qz.noise_key(key, b0, 0) if key else 0
        if layout.kernels == "cpu":  # the LoCo compress kernel without error feedback quantises d
            from loco_megatron.loco import cpu_kernels

            codes, s, _ = cpu_kernels.compress(d, None, None, 0.0, layout.bits, layout.block_size, d.numel(),
                                               options=None if layout.plain else layout.options, key=ck)
        elif layout.kernels == "triton":  # the same, Triton (its per-block metric sums are unused)
            from loco_megatron.loco import triton_kernels

            stats = torch.empty(b1 - b0, 3, dtype=torch.float32, device=d.device)
            codes, s = triton_kernels.compress(d, None, None, 0.0, layout.bits, layout.block_size, None, None,
                                               stats, options=layout.options, key=ck)
        else:
            codes, s = qz.quantize_blockwise(d, layout.bits, layout.block_size, layout.options, ck)
        c0, c1 = layout.chunk_bytes(b0, b1)
        row[c0:c1].copy_(codes)
        scales[b0:b1].copy_(s)
    return row


def row_scales(rows: torch.Tensor, layout: DeltaLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered rows (uint8 ``[W, row_bytes]``) -> fp32 ``[W, blocks]`` scales with the rows
    that are not all finite zeroed (their deltas decode to exactly 0, a no-op) and the bool
    ``[W]`` mask of the finite ones."""
    scales = rows[:, layout.code_bytes:].contiguous().view(torch.float32)  # [W, blocks]: 4 B per block
    finite = torch.isfinite(scales).all(dim=1)
    return torch.where(finite.unsqueeze(1), scales, torch.zeros_like(scales)), finite


def decode_chunk(row: torch.Tensor, scales: torch.Tensor, layout: DeltaLayout, b0: int, b1: int,
                 numel: int) -> torch.Tensor:
    """fp32 deltas of blocks ``[b0, b1)`` of one gathered row (its first ``numel``
    elements), unrotated (the parameter domain); ``scales``: that row's ``[blocks]`` from
    :func:`row_scales`."""
    c0, c1 = layout.chunk_bytes(b0, b1)
    if layout.kernels == "cpu":  # the fused dequantise (zeroed scales: a zero delta)
        from loco_megatron.loco import cpu_kernels

        part = torch.cat([row[c0:c1], scales[b0:b1].contiguous().view(torch.uint8)]).unsqueeze(0)
        out = torch.empty(numel, dtype=torch.float32, device=row.device)
        cpu_kernels.decompress_sum(part, _ChunkLayout(c1 - c0, layout.bits, layout.block_size, layout.options), out)
        return out
    if not layout.plain:
        return qz.dequantize_with(row[c0:c1], scales[b0:b1], layout.bits, layout.block_size, numel, layout.options)
    q = qz.unpack_codes(row[c0:c1], layout.bits, layout.block_size).view(b1 - b0, layout.block_size)
    return torch.mul(q, scales[b0:b1].unsqueeze(1)).view(-1)[:numel]


def add_delta(agreed: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``cast(float(agreed) + delta)`` at ``agreed``'s dtype: the one formula every rank uses."""
    return (agreed.float() + delta).to(agreed.dtype)


def apply_row(row: torch.Tensor, scales: torch.Tensor, layout: DeltaLayout, src: torch.Tensor, dst: torch.Tensor,
              new: Optional[torch.Tensor] = None, dst2: Optional[torch.Tensor] = None, swap: bool = False,
              blocks: Optional[tuple[int, int]] = None) -> Optional[torch.Tensor]:
    """The fused decode-and-apply of blocks ``blocks`` (default: all) of one gathered row on
    ``layout.kernels`` (``"cpu"`` or ``"triton"``): ``dst = add_delta(src, decode_chunk(...))``
    bit for bit, with no fp32 delta tensor. ``row``: uint8 ``[row_bytes]``; ``scales``: its
    ``[blocks]`` from :func:`row_scales`; ``src``/``dst``: the shard ``[S]`` (the same
    tensor for another rank's shard). The own shard (``new`` set) returns the float64
    ``[2]`` metric sums ``(||result - new||^2, ||new||^2)`` on ``src``'s device; see
    :meth:`AgreedShard.apply_slots` for what goes where."""
    if layout.kernels == "triton":
        from loco_megatron.loco import triton_kernels

        return triton_kernels.param_apply(row, scales, layout, src, dst, new, dst2, swap, blocks)
    from loco_megatron.loco import cpu_kernels

    sums = cpu_kernels.param_apply(row, scales, layout, src, dst, new, dst2, swap, blocks)
    return torch.tensor(sums, dtype=torch.float64) if new is not None else None


class ApplySlots(NamedTuple):
    """Where the own shard's fused apply reads and writes (:func:`apply_row`'s arguments)."""

    src: torch.Tensor   # the agreed shard from before the step
    new: torch.Tensor   # the optimizer's new values (read before dst is written: it is dst)
    dst: torch.Tensor   # receives the new agreed values
    dst2: torch.Tensor  # receives new (swap) or the new agreed values
    swap: bool


class AgreedShard:
    """The one extra shard per bucket the owner keeps between gathers.

    ``buffer`` is the bucket's flat parameter buffer; ``own`` its rank's ``[S]`` view.
    Two modes, depending on whether the optimizer's fp32 main parameters *are* that
    view (fp32 models: megatron's distributed optimizer steps the model buffer itself):

    * ``main_aliased=False`` (bf16/fp16 params, separate fp32 main params): ``spare``
      holds the agreed own shard; the optimizer's copy-back overwrites ``own`` with the
      new values before the gather;
    * ``main_aliased=True`` (fp32 params): between gathers ``own`` holds the agreed
      shard (what the model computes with) and ``spare`` the exact main shard;
      :meth:`begin_step` before the optimizer step exchanges them, so the optimizer updates
      the exact values and ``spare`` holds the agreed shard during the gather.

    Extra memory: ``S`` elements of the parameter dtype per bucket, i.e. ``element_size
    / W`` bytes per parameter.
    """

    def __init__(self, own: torch.Tensor, main_aliased: bool):
        self.own, self.main_aliased = own, main_aliased
        self.spare = own.detach().clone()
        self.pending = False
        """True between :meth:`begin_step` and the gather (or :meth:`cancel_step`)."""
        self.gathers = 0
        """Gathers completed (checkpointed): the step of the stochastic-rounding key."""

    def _exchange(self) -> None:
        if not self.main_aliased:
            return
        # Swapped chunk by chunk: a whole-shard temporary would be S elements more at every
        # step (a whole pipeline stage's shard where megatron makes it one bucket).
        n = self.own.numel()
        tmp = torch.empty(min(n, DECODE_CHUNK), dtype=self.own.dtype, device=self.own.device)
        for lo in range(0, n, DECODE_CHUNK):
            hi = min(lo + DECODE_CHUNK, n)
            t = tmp[: hi - lo]
            t.copy_(self.own[lo:hi])
            self.own[lo:hi].copy_(self.spare[lo:hi])
            self.spare[lo:hi].copy_(t)

    def begin_step(self) -> None:
        """Before the optimizer step: an update of ``own`` is coming (aliased: put the
        exact main shard where the optimizer reads it)."""
        if not self.pending:
            self._exchange()
            self.pending = True

    def cancel_step(self) -> None:
        """The step was skipped: no update to gather (aliased: agreed shard back in place)."""
        if self.pending:
            self._exchange()
            self.pending = False

    def agreed(self) -> torch.Tensor:
        """The agreed own shard (from before the step) while an update is pending."""
        return self.spare

    def finish_slice(self, lo: int, hi: int, new_agreed: torch.Tensor) -> None:
        """After the gather, elements ``[lo, hi)``: ``own`` <- the new agreed values; ``spare``
        <- exact main (aliased) or the agreed values (not aliased). Elementwise, so the
        gather applies it chunk by chunk; :meth:`finished` once every slice is done."""
        if self.main_aliased:
            self.spare[lo:hi].copy_(self.own[lo:hi])
        else:
            self.spare[lo:hi].copy_(new_agreed)
        self.own[lo:hi].copy_(new_agreed)

    def apply_slots(self) -> ApplySlots:
        """:meth:`finish_slice` as the fused apply does it in one pass (``new``: ``own``'s
        update, ``dst``: ``own``; ``dst2``: ``spare``, which gets the exact main values when
        aliased, the new agreed ones when not)."""
        return ApplySlots(self.spare, self.own, self.own, self.spare, self.main_aliased)

    def finished(self) -> None:
        self.pending = False
        self.gathers += 1

    def agree_on_model(self) -> None:
        """The loaded model shard becomes both agreed and main (nothing else to go by: a
        checkpoint without usable state for this hook)."""
        self.pending = False
        self.spare.copy_(self.own)

    def state_dict(self) -> dict:
        """Aliased: the exact main shard; else the agreed own shard (clones)."""
        assert not self.pending, "checkpoint taken with a parameter update pending"
        return {"spare": self.spare.clone(), "main_aliased": self.main_aliased, "gathers": self.gathers}

    def fits(self, sd: dict) -> bool:
        """Whether ``sd`` (from :meth:`state_dict`) can be restored here: same shard size,
        same kind of main weights."""
        return sd["main_aliased"] == self.main_aliased and tuple(sd["spare"].shape) == tuple(self.spare.shape)

    def load_state_dict(self, sd: dict) -> None:
        """Restore a state that :meth:`fits` (else :meth:`agree_on_model`)."""
        assert self.fits(sd)
        self.pending = False
        self.gathers = sd.get("gathers", 0)  # absent: written before stochastic rounding existed here
        if self.main_aliased:
            self.spare.copy_(sd["spare"])  # the exact main shard: per-rank state, only here
        else:
            # The loaded model shard *is* the agreed one (saved as what every rank computed
            # with), and it is what the other ranks of the data-parallel group loaded for it.
            # The saved copy is not used: for parameters TP replicates, torch_dist loads TP
            # rank 0's copy on every TP rank, so another TP rank's saved agreed shard could
            # differ from what its peers hold (a TP gap left by the compressed gather) and
            # they would stay apart for good.
            self.spare.copy_(self.own)
