"""LoCo's block-wise symmetric quantiser and code packing: pure tensor functions.

No torch.distributed and no megatron here, so every function is testable in one
process and reproducible by an independent implementation of the formulas:

* a flat tensor is split into contiguous blocks of ``block_size`` elements, the last
  one zero-padded;
* per block ``s = max|x_block| / qmax`` with ``qmax = 2**(bits-1) - 1`` (fp32);
* codes ``q = round(x / s)`` (round half to even) clamped to ``[-qmax, qmax]``; a
  block with ``s == 0`` (all zeros, or so small that ``s`` underflows) gets codes 0,
  never NaN;
* codes are stored offset-binary (``q + 2**(bits-1)``) and packed densely, little end
  first: two 4-bit codes per byte, four 2-bit codes per byte, one 8-bit code per byte.

Non-finite input is *not* sanitised: a NaN/Inf in a block makes that block's scale
non-finite, so the dequantised block is non-finite and the overflow stays visible to
whoever sums it (LoCo relies on this to let megatron's found-inf check skip the step).
"""

from __future__ import annotations

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


def block_scales(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 ``[num_blocks]`` scales ``max|block| / qmax`` (NaN/Inf propagate)."""
    return blocks.abs().amax(dim=1) / qmax(bits)


def quantize_to_int(blocks: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed integer codes (int8 ``[num_blocks, block_size]``) of fp32 blocks."""
    s = scales.unsqueeze(1)
    # Division (not multiplication by 1/s) is the spec's formula; it decides ties.
    q = torch.where(s > 0, blocks / s, torch.zeros_like(blocks))
    m = qmax(bits)
    return torch.round(q).clamp_(-m, m).nan_to_num_(0.0).to(torch.int8)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes (any int tensor, values in [-qmax, qmax]) into uint8 bytes.

    ``q.numel() * bits`` must be a multiple of 8 (true for whole blocks of a multiple
    of 8 elements).
    """
    u = (q.reshape(-1).to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)
    if bits == 8:
        return u
    per_byte = 8 // bits
    u = u.view(-1, per_byte)
    out = u[:, 0].clone()
    for i in range(1, per_byte):
        out |= u[:, i] << (i * bits)
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int8 signed codes, ``packed.numel()*8/bits`` of them."""
    offset = 2 ** (bits - 1)
    if bits == 8:
        return (packed.to(torch.int16) - offset).to(torch.int8)
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    u = (packed.reshape(-1, 1) >> shifts) & mask
    return (u.reshape(-1).to(torch.int16) - offset).to(torch.int8)


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
    q = unpack_codes(codes, bits).view(-1, block_size)
    return (q.float() * scales.float().unsqueeze(1)).view(-1)[:numel]
