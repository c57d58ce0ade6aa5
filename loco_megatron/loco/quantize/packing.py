"""LoCo's wire format: signed codes packed densely, offset-binary and planar within each
row (see :mod:`loco_megatron.loco.quantize`), and its sizes: the last stage of quantising
(blocks > scales > codes > **packed bytes**) before the gradient and parameter sync's
collectives send them; the receivers unpack with the inverse."""

from __future__ import annotations

from typing import Optional

import torch

def num_blocks(numel: int, block_size: int) -> int:
    """Blocks of ``block_size`` that hold ``numel`` elements (the last one zero-padded)."""
    return -(-numel // block_size)


def packed_nbytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of packed codes for ``numel`` elements (padded to whole blocks)."""
    return num_blocks(numel, block_size) * block_size * bits // 8


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes (int8 ``[rows, R]`` or flat = one row, values in [-qmax, qmax])
    into uint8 bytes, planar within each row (see :mod:`loco_megatron.loco.quantize`).

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
