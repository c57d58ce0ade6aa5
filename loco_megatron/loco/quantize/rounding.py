"""From a block and its scale to integer codes and back: nearest rounding (half to even)
and stochastic rounding with its stateless noise (a hash of the run's seed, the buffer,
the step and the element index, so a resumed run rounds exactly as an uninterrupted one),
and the dequantised values ``q * s``. The second stage of quantising a block (blocks >
scales > **codes** > packed bytes) in LoCo's gradient and parameter sync."""

from __future__ import annotations

from typing import Optional

import torch

from loco_megatron.loco.quantize.options import QuantOptions
from loco_megatron.loco.quantize.scales import code_range, divisor, qmax

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


def level_codes(levels: torch.Tensor, opts: QuantOptions) -> torch.Tensor:
    """int8 signed codes of float levels (exact: levels are integers)."""
    return levels.to(torch.int8)


def dequant_codes(q: torch.Tensor, scales: torch.Tensor, opts: QuantOptions, out=None) -> torch.Tensor:
    """fp32 ``[n, B]`` values ``q * s`` of int8 codes ``[n, B]`` and scales ``[n]``."""
    return torch.mul(q, scales.float().unsqueeze(1), out=out)


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
