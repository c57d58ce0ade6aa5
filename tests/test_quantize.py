"""LoCo's quantiser and packing, in one process."""

import torch
import pytest

from loco_megatron.loco import dequantize_blockwise, quantize_blockwise
from loco_megatron.loco import quantize as qz


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4099])
def test_round_trip_within_half_step(bits, numel):
    """Guards against wrong scales, wrong rounding or mis-ordered packing: every element
    comes back within half a quantisation step of its block."""
    torch.manual_seed(bits * 7 + numel)
    x = torch.randn(numel) * 3
    codes, scales = quantize_blockwise(x, bits, 256)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32
    assert codes.numel() == qz.packed_nbytes(numel, bits, 256)
    y = dequantize_blockwise(codes, scales, bits, 256, numel)
    step = scales.repeat_interleave(256)[:numel]
    assert torch.all((x - y).abs() <= step / 2 * (1 + 1e-6) + 1e-12)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [8, 24, 1000])
def test_packing_is_exact(bits, n):
    """Guards against lost or swapped codes in dense packing (two 4-bit or four 2-bit per byte)."""
    m = qz.qmax(bits)
    q = torch.randint(-m, m + 1, (n,), dtype=torch.int8)
    packed = qz.pack_codes(q, bits)
    assert packed.numel() == n * bits // 8
    assert torch.equal(qz.unpack_codes(packed, bits), q)


def test_zero_and_tiny_blocks_give_no_nan():
    """Guards against 0/0 in all-zero blocks and underflowing scales on denormals."""
    x = torch.zeros(600)
    x[300:310] = 1e-44  # denormals: max/qmax underflows
    codes, scales = quantize_blockwise(x, 4, 256)
    y = dequantize_blockwise(codes, scales, 4, 256, 600)
    assert torch.isfinite(y).all()
    assert scales[0] == 0 and torch.all(y[:256] == 0)


def test_ties_round_to_even_and_codes_match_formula():
    """Guards against round-half-away-from-zero or multiply-by-reciprocal deviations from the spec."""
    x = torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 2)
    codes, scales = quantize_blockwise(x, 4, 8)  # qmax 7, scale 1.0
    assert scales.item() == 1.0
    assert qz.unpack_codes(codes, 4).tolist() == [7, 0, 2, 2, 0, -2, 0, 0]


def test_non_finite_input_stays_visible():
    """Guards against a NaN/Inf gradient being silently quantised to finite values
    (the optimizer's found-inf check must see it)."""
    x = torch.randn(512)
    x[3] = float("inf")
    codes, scales = quantize_blockwise(x, 4, 256)
    y = dequantize_blockwise(codes, scales, 4, 256, 512)
    assert not torch.isfinite(y[:256]).all()
    assert torch.isfinite(y[256:]).all()
