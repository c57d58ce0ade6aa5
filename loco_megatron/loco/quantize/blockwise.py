"""Quantise and dequantise a whole flat tensor: blocks > scales > codes > packed bytes, and
back (the reference the compressor, the collectives and the fused kernels are tested
against; also what the uncompressed-state paths of the gradient and parameter sync call).
Returns and takes the wire format of :mod:`.packing`: packed codes plus one fp32 scale per
block."""

from __future__ import annotations

from typing import Optional

import torch

from loco_megatron.loco import rotation as rot
from loco_megatron.loco.quantize.options import SUPPORTED_BITS, QuantOptions
from loco_megatron.loco.quantize.packing import pack_codes, unpack_codes
from loco_megatron.loco.quantize.rounding import (dequant_codes, level_codes, levels_, quantize_to_int,
                                                  uniform_noise)
from loco_megatron.loco.quantize.scales import block_scales, option_scales

def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat ``x`` as fp32 ``[num_blocks, block_size]``, zero-padded at the end."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % block_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)


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


def quantize_with(x: torch.Tensor, bits: int, block_size: int, opts: QuantOptions,
                  key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blockwise` with options (same outputs and layout; ``key`` from
    :func:`~.rounding.noise_key` drives stochastic rounding). Rotation needs a power-of-two block."""
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
