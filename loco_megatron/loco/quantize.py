"""LoCo's block-wise symmetric quantiser and code packing: pure tensor functions.

No torch.distributed and no megatron here, so every function is testable in one
process and reproducible by an independent implementation of the formulas:

* a flat tensor is split into contiguous blocks of ``block_size`` elements, the last
  one zero-padded;
* per block ``s = max|x_block| / qmax`` with ``qmax = 2**(bits-1) - 1`` (fp32);
* codes ``q = round(x / s)`` (round half to even) clamped to ``[-qmax, qmax]``; a
  block with ``s == 0`` (all zeros, or so small that ``s`` underflows) gets codes 0,
  never NaN;
* codes are stored offset-binary (``q + 2**(bits-1)``) and packed densely and
  *planar* within each row of ``R`` codes (a quantisation block, or the whole tensor
  when packing a flat one): with ``k = 8/bits`` codes per byte, byte ``i`` of a row
  holds codes ``i, i + R/k, ..., i + (k-1)R/k`` in bits ``0, bits, ..., 8-bits``. The
  planes are contiguous, so packing and unpacking are a few vectorised passes rather
  than a strided gather, and a block's codes stay inside its own bytes.

Options (:class:`QuantOptions`, ``--loco-quantizer/-scale/-rotation/-rounding``); the
defaults are exactly the scheme above:

* ``uniform`` quantiser: all ``2**bits`` codes ``q`` in ``[-2**(bits-1), 2**(bits-1)-1]``
  stand for the levels ``q * s``, one of them exactly 0, with the *signed* scale
  ``s = -m / 2**(bits-1)`` where ``m`` is the block's element of largest magnitude (the
  first, on ties): the extra code ``-2**(bits-1)`` lands exactly on ``m``, and the grid
  reaches ``(2**(bits-1) - 1) * |s|`` on the other side (the scale's sign bit says which
  side has the extra level, so nothing is added to the wire). Levels in units of
  ``|m|``, for ``m > 0`` (mirrored for ``m < 0``): 2 bits ``{1, 0.5, 0, -0.5}``; 4 bits
  ``{1, 7/8, ..., 1/8, 0, -1/8, ..., -7/8}``; 8 bits ``k/128`` for ``k`` in
  ``[-127, 128]``. Nearest rounding is ``q = round(x / s)`` (half to even) clamped to the
  code range, so 0 decodes to exactly 0 (a grid of half-integer levels has no zero:
  nearest rounding sent every exact zero to ``+0.5 s``, a bias that error feedback only
  hides); elements beyond ``(2**(bits-1) - 1) * |s|`` on the far side of ``m`` clip there
  (error up to one step);
* ``mse`` scale: per block, the scale among ``c * s_absmax`` for ``c`` in
  :data:`MSE_CLIP_RATIOS` with the least squared quantisation error, found by a descent
  from 0.8/0.7 (:func:`mse_choice`; four candidates evaluated, nearest rounding;
  searched in units of the absmax scale: ``t = x / s_absmax``, level ``round(t / c)``,
  error ``(t - q*c)^2`` summed in the fixed order of :func:`tree_sum_`; ties keep the
  larger ``c``); what clipping loses is carried by the error feedback;
* ``hadamard`` rotation (:mod:`.rotation`): blocks are rotated before quantising and
  unrotated after dequantising; signs from the shared seed, so no side information;
* ``stochastic`` rounding: ``q = floor(x / s + u)`` (then clamped) with ``u`` in
  ``[0, 1)`` hashed from ``(key, element index)`` (:func:`noise_key`: seed, stream, step),
  stateless, so reproducible and bit-exact across a resume.

The wire format is the same for every option: packed codes plus one fp32 scale per block.

Non-finite input is *not* sanitised: a NaN/Inf in a block makes that block's scale
non-finite, so the dequantised block is non-finite and the overflow stays visible to
whoever sums it (LoCo relies on this to let megatron's found-inf check skip the step).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from loco_megatron.loco import rotation as rot

SUPPORTED_BITS = (2, 4, 8)
QUANTIZERS = ("symmetric", "uniform")
SCALES = ("absmax", "mse")
ROTATIONS = ("none", "hadamard")
ROUNDINGS = ("nearest", "stochastic")
MSE_CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
"""Clip ratios the ``mse`` scale tries per block (1.0 = absmax)."""


@dataclasses.dataclass(frozen=True)
class QuantOptions:
    """Quantiser options (see the module docstring); the defaults are today's scheme.

    ``seed`` fixes the Hadamard signs (shared by every rank) and is the base of the
    stochastic-rounding keys."""

    quantizer: str = "symmetric"
    scale: str = "absmax"
    rotation: str = "none"
    rounding: str = "nearest"
    seed: int = 0

    def __post_init__(self):
        for name, allowed in (("quantizer", QUANTIZERS), ("scale", SCALES), ("rotation", ROTATIONS),
                              ("rounding", ROUNDINGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    def non_default(self) -> list[str]:
        """Flags of the options that differ from today's scheme, e.g. ``['--loco-quantizer uniform']``."""
        base = QuantOptions()
        return [f"--loco-{n} {getattr(self, n)}" for n in ("quantizer", "scale", "rotation", "rounding")
                if getattr(self, n) != getattr(base, n)]


DEFAULT_OPTIONS = QuantOptions()


def qmax(bits: int) -> int:
    """Largest code magnitude of the symmetric ``bits``-bit quantiser."""
    return 2 ** (bits - 1) - 1


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def packed_nbytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of packed codes for ``numel`` elements (padded to whole blocks)."""
    return num_blocks(numel, block_size) * block_size * bits // 8


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat ``x`` as fp32 ``[num_blocks, block_size]``, zero-padded at the end."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % block_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def block_scales(blocks: torch.Tensor, bits: int, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 ``[num_blocks]`` scales ``max|block| / qmax`` (NaN/Inf propagate).

    ``scratch`` (same shape and dtype as ``blocks``) receives ``|blocks|`` instead of a
    fresh allocation.
    """
    mag = torch.abs(blocks, out=scratch) if scratch is not None else blocks.abs()
    return divide_(mag.amax(dim=1), qmax(bits))


def divide_(t: torch.Tensor, d: float) -> torch.Tensor:
    """``t /= d`` correctly rounded on every device (in place; returns ``t``).

    On CUDA, torch turns a division by a Python number into a multiplication by its
    reciprocal, which differs from ``t / d`` in the last bit (e.g. ``d = 7``): a CUDA
    rank's scales would not equal a CPU rank's or the fused kernels' (``div_rn``). A 0-dim
    tensor on ``t``'s device takes the true division everywhere; filling it is a kernel
    launch, not a host sync."""
    return t.div_(t.new_full((), float(d)))


def divisor(scales: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, 1]`` divisor for :func:`round_codes_`: ``s``, or ``+inf`` where ``s == 0``
    (the uniform grid's scales are signed).

    ``x / inf == 0`` for every finite ``x``, so an all-zero (or underflowed) block gets
    codes 0 without a select over the whole block.
    """
    return torch.where(scales != 0, scales, torch.full_like(scales, float("inf"))).unsqueeze(1)


def round_codes_(blocks: torch.Tensor, scales: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Float codes ``clamp(round(x / s))`` of fp32 blocks, written into ``out`` (returned).

    Division (not multiplication by 1/s) is the spec's formula; it decides ties, and
    ``torch.round`` rounds half to even. NaN quotients (blocks with a NaN/Inf scale)
    become code 0; the non-finite scale keeps the overflow visible.
    """
    m = qmax(bits)
    return torch.div(blocks, divisor(scales), out=out).round_().clamp_(-m, m).nan_to_num_(0.0)


def quantize_to_int(blocks: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed integer codes (int8 ``[num_blocks, block_size]``) of fp32 blocks."""
    return round_codes_(blocks, scales, bits, torch.empty_like(blocks)).to(torch.int8)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes (int8 ``[rows, R]`` or flat = one row, values in [-qmax, qmax])
    into uint8 bytes, planar within each row (see the module docstring).

    ``R * bits`` must be a multiple of 8 (true for blocks of a multiple of 8 elements).
    """
    rows = (q.view(1, -1) if q.dim() == 1 else q).to(torch.int8)
    if bits == 8:  # offset binary of int8 is its two's complement with the top bit flipped
        return (rows.view(torch.uint8) ^ 0x80).reshape(-1)
    # Offset binary without widening: |q| <= qmax < 64, so q + 2**(bits-1) fits in int8.
    u = (rows + 2 ** (bits - 1)).view(torch.uint8)
    k = 8 // bits
    planes = u.view(u.shape[0], k, -1)
    out = planes[:, 0].clone()
    for i in range(1, k):
        out |= planes[:, i] << (i * bits)
    return out.reshape(-1)


def unpack_codes(packed: torch.Tensor, bits: int, row_codes: Optional[int] = None) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: flat int8 signed codes, ``packed.numel()*8/bits`` of
    them. ``row_codes`` is the packing row length ``R`` (default: one row)."""
    offset = 2 ** (bits - 1)
    if bits == 8:
        return (packed ^ 0x80).view(torch.int8).reshape(-1)  # offset binary <-> two's complement
    k = 8 // bits
    row_bytes = (row_codes or packed.numel() * k) // k
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8).view(1, k, 1)
    u = (packed.reshape(-1, 1, row_bytes) >> shifts) & mask
    return (u - offset).view(torch.int8).reshape(-1)


def _check(bits: int, block_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if block_size <= 0 or block_size % 8:
        raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")


def quantize_blockwise(x: torch.Tensor, bits: int, block_size: int, opts: Optional[QuantOptions] = None,
                       key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise flat ``x`` (any float dtype, N elements); ``opts``/``key``: see :func:`quantize_with`.

    Returns ``(codes, scales)``: ``codes`` uint8 of ``num_blocks*block_size*bits/8``
    packed bytes, ``scales`` fp32 ``[num_blocks]``.
    """
    if opts is not None and opts.non_default():
        return quantize_with(x, bits, block_size, opts, key)
    _check(bits, block_size)
    blocks = _blocks(x, block_size)
    scales = block_scales(blocks, bits)
    return pack_codes(quantize_to_int(blocks, scales, bits), bits), scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                         numel: int, opts: Optional[QuantOptions] = None) -> torch.Tensor:
    """fp32 flat tensor of ``numel`` elements from :func:`quantize_blockwise` output."""
    if opts is not None and opts.non_default():
        return dequantize_with(codes, scales, bits, block_size, numel, opts)
    q = unpack_codes(codes, bits, block_size).view(-1, block_size)
    return torch.mul(q, scales.float().unsqueeze(1)).view(-1)[:numel]


# -- quantiser options ---------------------------------------------------------------
def code_range(bits: int, opts: QuantOptions) -> tuple[int, int]:
    """Smallest and largest signed code."""
    if opts.quantizer == "uniform":
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return -qmax(bits), qmax(bits)


def top_level(bits: int, opts: QuantOptions) -> float:
    """Level magnitude, in units of the scale, that the block's largest magnitude maps onto."""
    return 2 ** (bits - 1) if opts.quantizer == "uniform" else qmax(bits)


def levels_(blocks: torch.Tensor, scales: torch.Tensor, bits: int, opts: QuantOptions, out: torch.Tensor,
            noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Float levels (integer codes ``q``) of fp32 blocks into ``out`` (returned), so that
    ``D = q * s``. ``noise``: fp32 ``[0, 1)`` of the blocks' shape for stochastic rounding.
    Symmetric with nearest rounding is exactly :func:`round_codes_`."""
    if opts.quantizer == "symmetric" and noise is None:
        return round_codes_(blocks, scales, bits, out)
    lo, hi = code_range(bits, opts)
    torch.div(blocks, divisor(scales), out=out)
    if noise is None:
        out.round_()
    else:
        out.add_(noise).floor_()
    return out.clamp_(lo, hi).nan_to_num_(0.0)


def unbiased_scales_(blocks: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor,
                     work: torch.Tensor) -> torch.Tensor:
    """Gain correction: refit each block's scale, in place, to ``s' = |x|^2 / <q, x>`` so
    that the decoded block ``D = q * s'`` projects onto the input with the input's own
    length, ``<D, x> = |x|^2``. Returns ``scales``.

    ``blocks``: fp32 ``[n, B]`` inputs ``x`` (rotated, when the quantiser rotates: the
    rotation is orthogonal, so the inner products are the same); ``levels``: their float
    levels ``q`` (:func:`levels_`); ``scales``: fp32 ``[n]``, signed for the uniform grid
    (``s'`` takes the sign of ``<q, x>``, which is the sign of ``s``); ``work``: fp32
    scratch of the blocks' shape. Why: a nearest-rounding grid with a clipped (``mse``)
    scale, or a 2-bit grid with a zero level, shrinks towards zero, ``<D, x> < |x|^2``
    (about 0.86 x per pass at 2 bits with the mse scale on Gaussian or heavy-tailed
    blocks): used as an outer gradient that is a smaller step, i.e. a lower learning
    rate. The refit costs no bytes (the scale is sent anyway) and leaves the codes alone.
    ``<q, x> >= 0`` term by term (a level never has the opposite sign of its input, under
    nearest or stochastic rounding), so it is 0 only where every level is 0: those blocks
    keep their scale (they decode to 0 either way). A non-finite block stays non-finite."""
    dot = tree_sum_(torch.mul(levels, blocks, out=work)).clone()
    norm2 = tree_sum_(torch.mul(blocks, blocks, out=work))
    # ``norm2 / dot`` where dot != 0 (NaN != 0, so a NaN block keeps a NaN scale).
    return torch.where(dot != 0, norm2 / dot, scales, out=scales)


def level_codes(levels: torch.Tensor, opts: QuantOptions) -> torch.Tensor:
    """int8 signed codes of float levels (exact: levels are integers)."""
    return levels.to(torch.int8)


def dequant_codes(q: torch.Tensor, scales: torch.Tensor, opts: QuantOptions, out=None) -> torch.Tensor:
    """fp32 ``[n, B]`` values ``q * s`` of int8 codes ``[n, B]`` and scales ``[n]``."""
    return torch.mul(q, scales.float().unsqueeze(1), out=out)


def _signed_extreme(blocks: torch.Tensor) -> torch.Tensor:
    """fp32 ``[n]``: each block's element of largest magnitude, with its sign (NaN wins)."""
    return blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True)).squeeze(1)


def option_scales(blocks: torch.Tensor, bits: int, opts: QuantOptions) -> torch.Tensor:
    """fp32 ``[n]`` scales of fp32 ``[n, B]`` blocks for ``opts`` (NaN/Inf propagate;
    uniform: signed, see the module docstring). Default options: exactly :func:`block_scales`."""
    if opts.quantizer == "uniform":
        base = divide_(_signed_extreme(blocks), -top_level(bits, opts))
    else:
        base = divide_(blocks.abs().amax(dim=1), top_level(bits, opts))
    if opts.scale == "absmax":
        return base
    # Searched in units of the base, t = x / base (one division per element, shared by the
    # candidates): candidate c's nearest level is round(t / c) (as t * fp32(1/c)) and its
    # error (t - q*c)^2, the block's error over base^2. The product and the difference are
    # rounded apart and summed in the fixed order of tree_sum_, so every implementation
    # (the fused kernels too) gets the same bits and picks the same candidate. The
    # reference evaluates all six; the choice (mse_choice) reads only the four a fused
    # kernel evaluates.
    lo, hi = code_range(bits, opts)
    t = torch.div(blocks, divisor(base))
    work = torch.empty_like(blocks)
    one = torch.ones((), dtype=torch.float32, device=blocks.device)
    # The ratios as 0-dim device tensors filled by kernels: torch.tensor(MSE_CLIP_RATIOS,
    # device=...) would be a blocking pageable host-to-device copy per chunk.
    ratios = torch.stack([one.new_full((), c) for c in MSE_CLIP_RATIOS])
    errs = []
    for cf in ratios:
        q = torch.mul(t, one / cf, out=work).round_().clamp_(lo, hi)
        torch.sub(t, q.mul_(cf), out=work).square_()
        errs.append(tree_sum_(work).clone())
    return base * ratios[mse_choice(torch.stack(errs))]


def mse_choice(err: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: the index into :data:`MSE_CLIP_RATIOS` that the mse scale takes, from
    fp32 ``[6, n]`` candidate errors in that order (1.0, 0.9, ..., 0.5).

    A descent from the middle rather than the least of six: compare 0.8 with 0.7, then
    step towards the better one while the next ratio is at least as good (towards larger
    ratios: ties keep the larger, as the full search did) or strictly better (towards
    smaller ones), two steps at most. It reads four errors: the pair 0.8/0.7 and the pair
    on the winning side, which is all a fused kernel computes (two sweeps of the block
    instead of three). The block's error is close to unimodal in the ratio, so this is the
    least of six nearly always (``tests/test_quant_options.py`` bounds the quality lost; the
    2-bit study in docs/loco.md was rerun with it). A NaN error never wins: NaN compares
    false, so a non-finite block stops at 0.7 (its scale is non-finite whatever the ratio).
    """
    up = err[2] <= err[3]
    i_up = torch.where(err[1] <= err[2], torch.where(err[0] <= err[1], 0, 1), 2)
    i_down = torch.where(err[4] < err[3], torch.where(err[5] < err[4], 5, 4), 3)
    return torch.where(up, i_up, i_down)


def tree_sum_(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of fp32 ``t`` (``[..., L]``) in a fixed pairwise order, in place:
    while ``L > 1``, ``m = ceil(L/2)`` and ``t[..., i] += t[..., m + i]`` for ``i < L - m``.
    Returns the view ``t[..., 0]`` (overwritten by the next use of ``t``)."""
    n = t.shape[-1]
    while n > 1:
        m = (n + 1) // 2
        t[..., : n - m].add_(t[..., m:n])
        n = m
    return t[..., 0]


_M32 = 0xFFFFFFFF


def _mix32_int(x: int) -> int:
    x &= _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The same 32-bit integer hash as :func:`_mix32_int`, on int64 tensors in [0, 2**32)."""
    x = ((x >> 16) ^ x).mul_(0x45D9F3B).bitwise_and_(_M32)
    x = ((x >> 16) ^ x).mul_(0x45D9F3B).bitwise_and_(_M32)
    return (x >> 16) ^ x


def noise_key(seed: int, stream: int, step: int) -> int:
    """32-bit key of one quantisation call: ``seed`` (the run's), ``stream`` (which buffer
    on which rank) and ``step`` (the compressor's step counter, which is checkpointed)."""
    return _mix32_int(_mix32_int(_mix32_int(seed) ^ stream) + step)


def uniform_noise(num: int, block_size: int, key: int, first_block: int = 0, device=None) -> torch.Tensor:
    """fp32 ``[num, block_size]`` in ``[0, 1)`` for blocks ``first_block ..`` of a buffer:
    a hash of ``(key, element index)``, so any chunking of the buffer sees the same values."""
    start = first_block * block_size
    idx = torch.arange(start, start + num * block_size, dtype=torch.int64, device=device)
    h = _mix32(_mix32((idx & _M32) ^ key).add_(idx >> 32).bitwise_and_(_M32))
    return (h >> 8).float().mul_(2.0 ** -24).view(num, block_size)


def quantize_with(x: torch.Tensor, bits: int, block_size: int, opts: QuantOptions,
                  key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blockwise` with options (same outputs and layout; ``key`` from
    :func:`noise_key` drives stochastic rounding). Rotation needs a power-of-two block."""
    _check(bits, block_size)
    blocks = _blocks(x, block_size)
    if opts.rotation == "hadamard":
        blocks = rot.rotate(blocks, rot.signs(block_size, opts.seed, blocks.device))
    scales = option_scales(blocks, bits, opts)
    noise = (uniform_noise(blocks.shape[0], block_size, key, 0, blocks.device)
             if opts.rounding == "stochastic" else None)
    lv = levels_(blocks, scales, bits, opts, torch.empty_like(blocks), noise)
    return pack_codes(level_codes(lv, opts), bits), scales


def dequantize_with(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, numel: int,
                    opts: QuantOptions) -> torch.Tensor:
    """Inverse of :func:`quantize_with`: fp32 flat ``numel`` elements (unrotated)."""
    q = unpack_codes(codes, bits, block_size).view(-1, block_size)
    y = dequant_codes(q, scales, opts)
    if opts.rotation == "hadamard":
        y = rot.unrotate(y, rot.signs(block_size, opts.seed, y.device))
    return y.reshape(-1)[:numel]
