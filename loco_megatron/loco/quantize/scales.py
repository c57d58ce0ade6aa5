"""The quantiser's grid and each block's scale: the code range and top level of each
quantiser, the scale ``s`` of a block (absmax, the signed scale of the uniform grid, the
``mse`` search over clip ratios in a fixed summation order) and the gain correction that
refits it. The first stage of quantising a block (blocks > **scales** > codes > packed
bytes) in LoCo's gradient and parameter sync; the fused kernels reproduce it bit for bit."""

from __future__ import annotations

from typing import Optional

import torch

from loco_megatron.loco.quantize.options import QuantOptions

MSE_CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
"""Clip ratios the ``mse`` scale tries per block (1.0 = absmax)."""


def qmax(bits: int) -> int:
    """Largest code magnitude of the symmetric ``bits``-bit quantiser."""
    return 2 ** (bits - 1) - 1


def code_range(bits: int, opts: QuantOptions) -> tuple[int, int]:
    """Smallest and largest signed code."""
    if opts.quantizer == "uniform":
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return -qmax(bits), qmax(bits)


def top_level(bits: int, opts: QuantOptions) -> float:
    """Level magnitude, in units of the scale, that the block's largest magnitude maps onto."""
    return 2 ** (bits - 1) if opts.quantizer == "uniform" else qmax(bits)


def divide_(t: torch.Tensor, d: float) -> torch.Tensor:
    """``t /= d`` correctly rounded on every device (in place; returns ``t``).

    On CUDA, torch turns a division by a Python number into a multiplication by its
    reciprocal, which differs from ``t / d`` in the last bit (e.g. ``d = 7``): a CUDA
    rank's scales would not equal a CPU rank's or the fused kernels' (``div_rn``). A 0-dim
    tensor on ``t``'s device takes the true division everywhere; filling it is a kernel
    launch, not a host sync."""
    return t.div_(t.new_full((), float(d)))


def divisor(scales: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, 1]`` divisor for :func:`~.rounding.round_codes_`: ``s``, or ``+inf`` where ``s == 0``
    (the uniform grid's scales are signed).

    ``x / inf == 0`` for every finite ``x``, so an all-zero (or underflowed) block gets
    codes 0 without a select over the whole block.
    """
    return torch.where(scales != 0, scales, torch.full_like(scales, float("inf"))).unsqueeze(1)


def block_scales(blocks: torch.Tensor, bits: int, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 ``[num_blocks]`` scales ``max|block| / qmax`` (NaN/Inf propagate).

    ``scratch`` (same shape and dtype as ``blocks``) receives ``|blocks|`` instead of a
    fresh allocation.
    """
    mag = torch.abs(blocks, out=scratch) if scratch is not None else blocks.abs()
    return divide_(mag.amax(dim=1), qmax(bits))


def _signed_extreme(blocks: torch.Tensor) -> torch.Tensor:
    """fp32 ``[n]``: each block's element of largest magnitude, with its sign (NaN wins)."""
    return blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True)).squeeze(1)


def option_scales(blocks: torch.Tensor, bits: int, opts: QuantOptions) -> torch.Tensor:
    """fp32 ``[n]`` scales of fp32 ``[n, B]`` blocks for ``opts`` (NaN/Inf propagate;
    uniform: signed, see :mod:`loco_megatron.loco.quantize`). Default options: exactly :func:`block_scales`."""
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


def unbiased_scales_(blocks: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor,
                     work: torch.Tensor) -> torch.Tensor:
    """Gain correction: refit each block's scale, in place, to ``s' = |x|^2 / <q, x>`` so
    that the decoded block ``D = q * s'`` projects onto the input with the input's own
    length, ``<D, x> = |x|^2``. Returns ``scales``.

    ``blocks``: fp32 ``[n, B]`` inputs ``x`` (rotated, when the quantiser rotates: the
    rotation is orthogonal, so the inner products are the same); ``levels``: their float
    levels ``q`` (:func:`~.rounding.levels_`); ``scales``: fp32 ``[n]``, signed for the uniform grid
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
