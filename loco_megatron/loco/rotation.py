"""Block-wise randomized Hadamard rotation (``--loco-rotation hadamard``): pure tensor maths.

A block ``x`` of ``B`` elements (``B`` a power of two) is rotated as
``y = H (d * x) / sqrt(B)`` and restored as ``x = d * (H y) / sqrt(B)``, where ``H`` is
the ``B x B`` Walsh-Hadamard matrix (``H H = B I``) and ``d`` a fixed vector of signs
``+-1`` drawn from a seed. The map is orthogonal and linear, so

* a heavy-tailed block is spread evenly over its ``B`` coordinates (its absmax falls
  towards its RMS), which is what a low-bit absmax quantiser wants;
* sums survive it: ``unrotate(sum_r rotate(x_r)) == sum_r x_r`` (up to fp32 rounding),
  so the receiver may sum rotated, dequantised rows first and unrotate once;
* it needs no side information on the wire: every rank derives the same ``d`` from the
  same seed (``torch.Generator``, seeded at construction: nothing changes between steps,
  so there is nothing to checkpoint).
"""

from __future__ import annotations

import functools

import torch


def check_block_size(block_size: int) -> None:
    """ValueError (one line) unless ``block_size`` is a power of two."""
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two block size, got {block_size}")


def signs(block_size: int, seed: int, device=None) -> torch.Tensor:
    """fp32 ``[block_size]`` of ``+-1`` from ``seed`` (the same on every rank and machine:
    CPU generator, then moved). Read-only: derived once per (block, seed, device), since
    the move is a blocking host-to-device copy that a per-call derivation would put on the
    hot path (the quantiser's rotated encode and decode)."""
    check_block_size(block_size)
    return _signs(block_size, seed, torch.device(device or "cpu"))


@functools.lru_cache(maxsize=64)
def _signs(block_size: int, seed: int, device: torch.device) -> torch.Tensor:
    bits = torch.randint(0, 2, (block_size,), generator=torch.Generator().manual_seed(seed))
    return (bits.float() * 2 - 1).to(device)


def _wht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform of every row of fp32 ``[n, B]``
    (returns a new tensor; log2(B) butterfly passes)."""
    n, B = x.shape
    h = 1
    while h < B:
        v = x.view(n, B // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).view(n, B)
        h *= 2
    return x


def rotate(blocks: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``H (d * x) / sqrt(B)`` of every row of fp32 ``[n, B]`` (new tensor)."""
    return _wht(blocks * d).mul_(blocks.shape[1] ** -0.5)


def unrotate(blocks: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``d * (H y) / sqrt(B)`` (new tensor)."""
    return _wht(blocks).mul_(blocks.shape[1] ** -0.5).mul_(d)
