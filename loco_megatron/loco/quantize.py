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

Non-finite input is *not* sanitised: a NaN/Inf in a block makes that block's scale
non-finite, so the dequantised block is non-finite and the overflow stays visible to
whoever sums it (LoCo relies on this to let megatron's found-inf check skip the step).
"""

from __future__ import annotations

from typing import Optional

import torch

SUPPORTED_BITS = (2, 4, 8)


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
    return mag.amax(dim=1).div_(qmax(bits))


def divisor(scales: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, 1]`` divisor for :func:`round_codes_`: ``s``, or ``+inf`` where ``s == 0``.

    ``x / inf == 0`` for every finite ``x``, so an all-zero (or underflowed) block gets
    codes 0 without a select over the whole block.
    """
    return torch.where(scales > 0, scales, torch.full_like(scales, float("inf"))).unsqueeze(1)


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


def quantize_blockwise(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise flat ``x`` (any float dtype, N elements).

    Returns ``(codes, scales)``: ``codes`` uint8 of ``num_blocks*block_size*bits/8``
    packed bytes, ``scales`` fp32 ``[num_blocks]``.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if block_size <= 0 or block_size % 8:
        raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
    blocks = _blocks(x, block_size)
    scales = block_scales(blocks, bits)
    return pack_codes(quantize_to_int(blocks, scales, bits), bits), scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                         numel: int) -> torch.Tensor:
    """fp32 flat tensor of ``numel`` elements from :func:`quantize_blockwise` output."""
    q = unpack_codes(codes, bits, block_size).view(-1, block_size)
    return torch.mul(q, scales.float().unsqueeze(1)).view(-1)[:numel]
