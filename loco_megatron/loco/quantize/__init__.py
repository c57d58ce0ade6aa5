"""LoCo's block-wise symmetric quantiser and code packing: pure tensor functions, the maths
under the gradient and parameter sync of the data flow (CLI > config > set-up > train step >
gradient/parameter sync > checkpoint and metrics): :mod:`loco_megatron.loco.compressor` and
the collectives call it, the fused kernels reproduce it bit for bit.

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
* ``hadamard`` rotation (:mod:`loco_megatron.loco.rotation`): blocks are rotated before
  quantising and unrotated after dequantising; signs from the shared seed, so no side
  information;
* ``stochastic`` rounding: ``q = floor(x / s + u)`` (then clamped) with ``u`` in
  ``[0, 1)`` hashed from ``(key, element index)`` (:func:`noise_key`: seed, stream, step),
  stateless, so reproducible and bit-exact across a resume.

The wire format is the same for every option: packed codes plus one fp32 scale per block.

Non-finite input is *not* sanitised: a NaN/Inf in a block makes that block's scale
non-finite, so the dequantised block is non-finite and the overflow stays visible to
whoever sums it (LoCo relies on this to let megatron's found-inf check skip the step).

Modules: :mod:`.options` (the options and their allowed values), :mod:`.scales` (the grid
and each block's scale, the ``mse`` search, the gain correction), :mod:`.rounding` (scale to
codes: nearest and stochastic rounding with its noise, and back to values), :mod:`.packing`
(codes to bytes and back), :mod:`.blockwise` (the whole quantise/dequantise of a flat tensor).
"""

from loco_megatron.loco.quantize.blockwise import (dequantize_blockwise, dequantize_with, quantize_blockwise,
                                                   quantize_with)
from loco_megatron.loco.quantize.options import (DEFAULT_OPTIONS, QUANTIZERS, ROTATIONS, ROUNDINGS, SCALES,
                                                 SUPPORTED_BITS, QuantOptions)
from loco_megatron.loco.quantize.packing import num_blocks, pack_codes, packed_nbytes, unpack_codes
from loco_megatron.loco.quantize.rounding import (dequant_codes, level_codes, levels_, noise_key, quantize_to_int,
                                                  round_codes_, uniform_noise)
from loco_megatron.loco.quantize.scales import (MSE_CLIP_RATIOS, block_scales, code_range, divide_, divisor,
                                                mse_choice, option_scales, qmax, top_level, tree_sum_,
                                                unbiased_scales_)

__all__ = ["dequantize_blockwise", "dequantize_with", "quantize_blockwise", "quantize_with", "DEFAULT_OPTIONS",
           "QUANTIZERS", "ROTATIONS", "ROUNDINGS", "SCALES", "SUPPORTED_BITS", "QuantOptions", "num_blocks",
           "pack_codes", "packed_nbytes", "unpack_codes", "dequant_codes", "level_codes", "levels_", "noise_key",
           "quantize_to_int", "round_codes_", "unbiased_scales_", "uniform_noise", "MSE_CLIP_RATIOS",
           "block_scales", "code_range", "divide_", "divisor", "mse_choice", "option_scales", "qmax", "top_level",
           "tree_sum_"]
