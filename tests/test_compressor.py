"""LoCoCompressor: compensation, error update, reset, checkpointing, memory."""

import pytest
import torch

from loco_megatron.loco import LoCoCompressor, dequantize_blockwise, quantize_blockwise


def _transmitted(c, codes, scales):
    return dequantize_blockwise(codes, scales, c.bits, c.block_size, c.numel)


def test_beta0_error_feedback_telescopes():
    """Guards against a wrong compensation or error update: with beta=0 (classic error
    feedback) and fp32 error storage, sum(transmitted) == sum(grads) - final error."""
    torch.manual_seed(0)
    c = LoCoCompressor(1000, bits=2, beta=0.0, error_bits=32, reset_interval=0)
    sent, total = torch.zeros(1000), torch.zeros(1000)
    for _ in range(20):
        g = torch.randn(1000)
        total += g
        sent += _transmitted(c, *c.compress(g))
    torch.testing.assert_close(sent, total - c.error(), rtol=0, atol=1e-4)


def test_int8_error_storage_tracks_fp32_within_a_step():
    """Guards against a broken int8 error quantiser: the identity holds up to the int8
    rounding of the error (half an int8 step per element per update)."""
    torch.manual_seed(1)
    c = LoCoCompressor(2048, bits=4, beta=0.0, error_bits=8, reset_interval=0)
    sent, total = torch.zeros(2048), torch.zeros(2048)
    for _ in range(10):
        g = torch.randn(2048)
        total += g
        sent += _transmitted(c, *c.compress(g))
    gap = (sent - (total - c.error())).abs().max().item()
    assert gap < 10 * (1.0 / 127)  # ten updates, each at most ~half an int8 step of |e|<=1


def test_moving_average_formula():
    """Guards against beta applied to the wrong term: e = beta*e + (1-beta)*(h - Q(h))."""
    torch.manual_seed(2)
    c = LoCoCompressor(512, bits=4, beta=0.8, error_bits=32, reset_interval=0)
    g1, g2 = torch.randn(512), torch.randn(512)
    codes, scales = c.compress(g1)
    e1 = 0.2 * (g1 - _transmitted(c, codes, scales))
    torch.testing.assert_close(c.error(), e1)
    h2 = g2 + e1
    codes2, scales2 = c.compress(g2)
    ref_codes, ref_scales = quantize_blockwise(h2, 4, 256)
    assert torch.equal(codes2, ref_codes) and torch.equal(scales2, ref_scales)
    torch.testing.assert_close(c.error(), 0.8 * e1 + 0.2 * (h2 - _transmitted(c, codes2, scales2)))


def test_no_error_feedback_is_plain_quantisation():
    """Guards against the ablation baseline still compensating."""
    c = LoCoCompressor(300, bits=2, error_feedback=False)
    for seed in range(3):
        g = torch.randn(300, generator=torch.Generator().manual_seed(seed))
        codes, scales = c.compress(g)
        ref = quantize_blockwise(g, 2, 256)
        assert torch.equal(codes, ref[0]) and torch.equal(scales, ref[1])
    assert c.error_nbytes() == 0


def test_reset_interval_zeroes_error():
    """Guards against a reset that never fires (or fires every step)."""
    c = LoCoCompressor(256, bits=2, beta=0.5, reset_interval=3)
    for _ in range(3):
        c.compress(torch.randn(256))
    assert c.error().abs().sum() > 0
    c.compress(torch.zeros(256))  # step 3: reset first, then h = 0 -> e stays 0
    assert c.error().abs().sum() == 0


@pytest.mark.parametrize("error_bits", [8, 16, 32])
def test_nan_gradient_leaves_error_untouched(error_bits):
    """Guards against an Inf/NaN entering the error buffer."""
    c = LoCoCompressor(600, bits=4, error_bits=error_bits)
    c.compress(torch.randn(600))
    before = c.state_dict()
    g = torch.randn(600)
    g[5] = float("nan")
    codes, scales = c.compress(g)
    assert not torch.isfinite(scales).all()
    after = c.state_dict()
    assert torch.equal(before["error"], after["error"])
    if error_bits == 8:
        assert torch.equal(before["error_scales"], after["error_scales"])


def test_state_dict_round_trip_continues_identically():
    """Guards against error buffers or the reset counter missing from checkpoints."""
    torch.manual_seed(3)
    a = LoCoCompressor(1000, bits=4, reset_interval=4)
    for _ in range(3):
        a.compress(torch.randn(1000))
    b = LoCoCompressor(1000, bits=4, reset_interval=4)
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        g = torch.randn(1000)
        ca, cb = a.compress(g), b.compress(g)
        assert torch.equal(ca[0], cb[0]) and torch.equal(ca[1], cb[1])
    assert torch.equal(a.error(), b.error())
    with pytest.raises(ValueError, match="numel"):
        LoCoCompressor(999).load_state_dict(a.state_dict())


def test_error_memory_is_about_one_byte_per_element():
    """Guards against keeping fp32 error copies across steps (spec: <= ~1.1 B/element)."""
    c = LoCoCompressor(1 << 20, bits=4)
    assert c.error_nbytes() / (1 << 20) <= 1.1


def test_last_stats_match_direct_computation():
    """Guards against wrong loco/error_rms or loco/quant_rel_error inputs: the sums the
    compressor reports equal the error and residual computed from scratch."""
    torch.manual_seed(5)
    c = LoCoCompressor(1000, bits=4, beta=0.8, error_bits=32)
    c.compress(torch.randn(1000))
    e0 = c.error()
    g = torch.randn(1000)
    codes, scales = c.compress(g)
    h = g + e0
    resid = h - dequantize_blockwise(codes, scales, 4, 256, 1000)
    err_sq, resid_sq, h_sq, numel = c.last_stats.tolist()
    assert numel == 1000
    assert h_sq == pytest.approx(float((h * h).sum()), rel=1e-5)
    assert resid_sq == pytest.approx(float((resid * resid).sum()), rel=1e-4)
    assert err_sq == pytest.approx(float((c.error() ** 2).sum()), rel=1e-4)
    bad = g.clone()
    bad[7] = float("nan")
    c.compress(bad)
    assert torch.equal(c.last_stats, torch.zeros(4))  # a skipped step adds nothing to the metrics
