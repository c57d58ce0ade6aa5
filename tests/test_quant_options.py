"""LoCo's quantiser options (--loco-quantizer/-scale/-rotation/-rounding), in one process
and on 2 gloo ranks; the 2-rank training and resume run is in test_training.py."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loco_megatron.config import ConfigError
from loco_megatron.config.loco import LoCoConfig
from loco_megatron.loco import LoCoCompressor, quantize as qz, rotation as rot
from loco_helpers import decompress_sum, resolve_kernels
from loco_megatron.loco.collectives import ShardLayout, compressed_reduce_scatter
from conftest import free_port

ALL = qz.QuantOptions("uniform", "mse", "hadamard", "stochastic", seed=11)
QUANT_ROT = [qz.QuantOptions(q, "absmax", r) for q in qz.QUANTIZERS for r in qz.ROTATIONS]
EVERY = [qz.QuantOptions(q, s, r, rd, seed=3) for q in qz.QUANTIZERS for s in qz.SCALES
         for r in qz.ROTATIONS for rd in qz.ROUNDINGS]


def _blocks(x, b=256):
    return x.view(-1, b)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("opts", QUANT_ROT, ids=lambda o: f"{o.quantizer}-{o.rotation}")
def test_nearest_round_trip_within_half_step(bits, opts):
    """Guards against a wrong grid or scale (the block's extreme must sit on a level
    exactly) and a rotation that is not undone: with nearest rounding and the absmax scale
    every element inside the grid's span (rotated domain: every block's L2 error) is
    within half a step; the uniform grid's far side clips within one step."""
    torch.manual_seed(bits)
    x = torch.randn(4096) * 3
    x[7] = 40.0  # a single outlier
    codes, scales = qz.quantize_blockwise(x, bits, 256, opts)
    assert codes.numel() == qz.packed_nbytes(4096, bits, 256) and scales.shape == (16,)
    y = qz.dequantize_blockwise(codes, scales, bits, 256, 4096, opts)
    step = scales.abs().unsqueeze(1)
    if opts.rotation == "none":
        lo, hi = qz.code_range(bits, opts)
        levels = torch.stack([lo * scales, hi * scales], dim=1)
        inside = (_blocks(x) >= levels.amin(1, keepdim=True)) & (_blocks(x) <= levels.amax(1, keepdim=True))
        err = _blocks(x - y).abs()
        assert torch.all(err[inside] <= (step / 2).expand_as(err)[inside] * (1 + 1e-6))
        assert torch.all(err <= step * (1 + 1e-6))
        assert y[7].item() == pytest.approx(40.0, rel=1e-6)  # the outlier sits on a level exactly
    else:
        err = torch.linalg.vector_norm(_blocks(x - y), dim=1)
        assert torch.all(err <= step.squeeze(1) / 2 * 16 * (1 + 1e-4))


def test_uniform_codes_match_formula():
    """Guards against the uniform quantiser leaving a code unused or rounding to the wrong
    level: 2 bits, extreme m = 2 -> s = -1, codes q in [-2, 1] are the levels q*s =
    2, 1, 0, -1, q = round(x/s) half to even; the mirrored block (m = -2) likewise."""
    x = torch.tensor([2.0, 0.2, -0.2, -1.5, 0.9, 1.5, -0.7, 0.0])
    o = qz.QuantOptions(quantizer="uniform")
    codes, scales = qz.quantize_blockwise(torch.cat([x, -x]), 2, 8, o)
    assert scales.tolist() == [-1.0, 1.0]
    q = qz.unpack_codes(codes, 2, 8).tolist()
    assert q[:8] == [-2, 0, 0, 1, -1, -2, 1, 0] and q[8:] == q[:8]
    y = qz.dequantize_blockwise(codes, scales, 2, 8, 16, o)
    assert y[:8].tolist() == [2.0, 0.0, 0.0, -1.0, 1.0, 2.0, -1.0, 0.0] and y[8:].tolist() == (-y[:8]).tolist()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_uniform_grid_has_no_bias_for_zeros(bits):
    """Guards against the half-integer uniform grid of issue 21 (levels (q+0.5)s: code 0
    decoded to +0.5s, so without error feedback an element that is always exactly zero
    summed to 50.0 over 100 steps): exact zeros decode to exactly 0 at every step, and a
    block's extreme of either sign is a level exactly."""
    o = qz.QuantOptions(quantizer="uniform")
    total = torch.zeros(256)
    for step in range(100):
        g = torch.randn(256, generator=torch.Generator().manual_seed(step))
        g[::2] = 0.0
        codes, scales = qz.quantize_blockwise(g, bits, 256, o)
        y = qz.dequantize_blockwise(codes, scales, bits, 256, 256, o)
        ext = g[g.abs().argmax()]
        assert (y == ext).any()
        total += y
    assert torch.all(total[::2] == 0)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_uniform_code_range_packs_exactly(bits):
    """Guards against the extra negative code of the uniform grid (-2**(bits-1)) being lost
    or aliased in the offset-binary packing."""
    lo, hi = qz.code_range(bits, qz.QuantOptions(quantizer="uniform"))
    q = torch.randint(lo, hi + 1, (1024,), dtype=torch.int8)
    q[:2] = torch.tensor([lo, hi], dtype=torch.int8)
    assert torch.equal(qz.unpack_codes(qz.pack_codes(q, bits), bits), q)


@pytest.mark.parametrize("quantizer", qz.QUANTIZERS)
def test_mse_scale_never_worse_than_absmax(quantizer):
    """Guards against a clipped-scale search that picks a worse candidate or a scale outside
    the candidate set: per block, squared error <= absmax's, and s = c * s_absmax."""
    torch.manual_seed(5)
    x = torch.randn(8192) * torch.rand(8192).pow(6) * 10  # heavy-tailed blocks
    a, m = qz.QuantOptions(quantizer), qz.QuantOptions(quantizer, "mse")
    ca, sa = qz.quantize_blockwise(x, 2, 256, a)
    cm, sm = qz.quantize_blockwise(x, 2, 256, m)
    ea = _blocks(x - qz.dequantize_blockwise(ca, sa, 2, 256, 8192, a)).square().sum(1)
    em = _blocks(x - qz.dequantize_blockwise(cm, sm, 2, 256, 8192, m)).square().sum(1)
    assert torch.all(em <= ea * (1 + 1e-6)) and em.sum() < 0.85 * ea.sum()  # clipping helps heavy tails
    ratios = torch.tensor(qz.MSE_CLIP_RATIOS)
    assert torch.all(((sm / sa).unsqueeze(1) - ratios).abs().min(dim=1).values < 1e-6)


def test_stochastic_rounding_unbiased_and_keyed():
    """Guards against biased stochastic rounding, noise that depends on how the buffer is
    chunked, or keys that repeat across steps/streams (which would correlate ranks)."""
    torch.manual_seed(6)
    x = torch.randn(512)
    for quantizer in qz.QUANTIZERS:
        o = qz.QuantOptions(quantizer, rounding="stochastic", seed=1)
        outs = []
        for step in range(400):
            c, s = qz.quantize_blockwise(x, 2, 256, o, key=qz.noise_key(1, 0, step))
            y = qz.dequantize_blockwise(c, s, 2, 256, 512, o)
            assert torch.all((_blocks(x - y)).abs() < s.abs().unsqueeze(1) * (1 + 1e-6))
            outs.append(y)
        mean = torch.stack(outs).mean(0)
        # 400 samples, each within one step: the mean is within ~4 sigma of x, wherever the
        # grid reaches (the uniform grid clips the far side of a block's extreme)
        lo, hi = qz.code_range(2, o)
        span = torch.stack([lo * s, hi * s], dim=1)
        inside = (_blocks(x) >= span.amin(1, keepdim=True)) & (_blocks(x) <= span.amax(1, keepdim=True))
        assert inside.float().mean() > 0.8
        ok = (_blocks(mean - x)).abs() <= s.abs().unsqueeze(1) * 0.1
        assert torch.all(ok[inside]), quantizer
    k = qz.noise_key(1, 0, 0)
    whole = qz.uniform_noise(8, 256, k)
    assert torch.equal(qz.uniform_noise(3, 256, k, first_block=5), whole[5:])
    assert whole.min() >= 0 and whole.max() < 1 and abs(whole.mean().item() - 0.5) < 0.03
    keys = {qz.noise_key(1, stream, step) for stream in range(4) for step in range(50)}
    assert len(keys) == 200
    assert not torch.equal(whole, qz.uniform_noise(8, 256, qz.noise_key(1, 1, 0)))


@pytest.mark.parametrize("opts", EVERY, ids=lambda o: f"{o.quantizer}-{o.scale}-{o.rotation}-{o.rounding}")
def test_adversarial_blocks(opts):
    """Guards against 0/0 on all-zero blocks, underflowing scales on denormals, and a NaN/Inf
    being quantised to finite values (megatron's found-inf check must see it) - per option."""
    x = torch.zeros(1024)
    x[300:310] = 1e-44  # denormals
    x[600] = 5.0  # a single outlier in an otherwise zero block
    x[900] = float("nan")
    codes, scales = qz.quantize_blockwise(x, 2, 256, opts, key=7)
    y = qz.dequantize_blockwise(codes, scales, 2, 256, 1024, opts)
    assert scales[0] == 0 and torch.all(y[:256] == 0)
    assert torch.isfinite(y[256:768]).all() and torch.all(y[256:512].abs() <= 1e-30)
    if opts.rotation == "none" and opts.rounding == "nearest" and opts.scale == "absmax":
        assert y[600].item() == pytest.approx(5.0, rel=1e-6)  # (mse may clip it: EF carries the rest)
    assert not torch.isfinite(y[768:]).all()
    x[900] = float("inf")
    _, scales = qz.quantize_blockwise(x, 2, 256, opts, key=7)
    assert not torch.isfinite(scales[3])


def test_rotation_is_an_exact_linear_inverse():
    """Guards against a Walsh-Hadamard transform that is not orthogonal, signs that depend on
    anything but the seed, or a receiver that cannot sum rotated rows: unrotate(rotate(x)) = x,
    rotate(a + b) = rotate(a) + rotate(b), norms kept."""
    torch.manual_seed(8)
    d = rot.signs(256, 4)
    assert torch.equal(d, rot.signs(256, 4)) and not torch.equal(d, rot.signs(256, 5))
    assert set(d.tolist()) == {-1.0, 1.0}
    a, b = torch.randn(5, 256), torch.randn(5, 256)
    torch.testing.assert_close(rot.unrotate(rot.rotate(a, d), d), a, rtol=0, atol=1e-5)
    torch.testing.assert_close(rot.rotate(a + b, d), rot.rotate(a, d) + rot.rotate(b, d), rtol=0, atol=1e-5)
    torch.testing.assert_close(rot.rotate(a, d).norm(dim=1), a.norm(dim=1))
    with pytest.raises(ValueError, match="power-of-two block size, got 24"):
        rot.signs(24, 0)


@pytest.mark.parametrize("opts", [ALL, qz.QuantOptions("uniform", "mse", "hadamard")], ids=["all", "nearest"])
def test_receiver_sum_equals_sum_of_dequantised_rows(opts):
    """Guards against the receiver unrotating per row the wrong way or summing rotated rows
    without unrotating: the decompressed sum of two ranks' rows equals the sum of each row
    dequantised on its own."""
    layout = ShardLayout(4000, 2, 2, 256, options=opts)
    rows = []
    for rank in range(2):
        comp = LoCoCompressor(**layout.compressor_shape(), bits=2, options=opts, stream=rank)
        rows.append(layout.pack(*comp.compress(torch.randn(4000, generator=torch.Generator().manual_seed(rank)))))
    recv = torch.stack([rows[0][1], rows[1][1]])
    got = decompress_sum(recv, layout)
    ref = sum(qz.dequantize_blockwise(*layout.unpack_row(r), 2, 256, layout.shard, opts) for r in recv)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("opts", [ALL, qz.QuantOptions("uniform", "mse")], ids=["all", "no-rotation"])
def test_compressor_matches_spec_chunked_and_telescopes(opts):
    """Guards against the compressor drifting from the pure functions (first step, e = 0),
    results that depend on the chunking, and an error update in the wrong domain (with
    beta 0 and fp32 error, sum(sent) == sum(grads) - final error)."""
    torch.manual_seed(9)
    g = torch.randn(1000)
    whole = LoCoCompressor(1000, bits=2, beta=0.0, error_bits=32, reset_interval=0, options=opts, stream=2)
    chunked = LoCoCompressor(1000, bits=2, beta=0.0, error_bits=32, reset_interval=0, options=opts, stream=2,
                             chunk_elements=256)
    codes, scales = whole.compress(g)
    ref = qz.quantize_blockwise(g, 2, 256, opts, key=qz.noise_key(opts.seed, 2, 0))
    assert torch.equal(codes, ref[0]) and torch.equal(scales, ref[1])
    c2, s2 = chunked.compress(g)
    assert torch.equal(codes, c2) and torch.equal(scales, s2)
    sent, total = qz.dequantize_blockwise(codes, scales, 2, 256, 1000, opts), g.clone()
    for step in range(1, 15):
        g = torch.randn(1000)
        total += g
        codes, scales = whole.compress(g)
        c2, s2 = chunked.compress(g)
        assert torch.equal(codes, c2) and torch.equal(scales, s2), step
        sent += qz.dequantize_blockwise(codes, scales, 2, 256, 1000, opts)
    torch.testing.assert_close(sent, total - whole.error(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("opts", EVERY, ids=lambda o: f"{o.quantizer}-{o.scale}-{o.rotation}-{o.rounding}")
def test_gain_correction_projects_onto_the_input_with_its_length(bits, opts):
    """Guards against a gain correction that does not remove the quantiser's shrink (a
    scale refit in the wrong domain, with the wrong sign for the uniform grid's signed
    scale, or of the wrong quantity): for every option set, width and a heavy-tailed
    input, ``<D, h> = |h|^2`` per block (1e-5 relative), where without it the 2-bit
    mse grid gives about 0.86; the codes are the uncorrected ones; an all-zero block
    keeps its (zero) scale and decodes to zeros; a NaN block stays non-finite."""
    torch.manual_seed(bits)
    x = torch.distributions.StudentT(3.0).sample((16 * 256,))
    x[256:512] = 0.0
    plain = LoCoCompressor(x.numel(), bits=bits, options=opts, error_feedback=False, stream=5)
    fixed = LoCoCompressor(x.numel(), bits=bits, options=opts, error_feedback=False, stream=5, gain_correction=True)
    codes, scales = plain.compress(x)
    codes_g, scales_g = fixed.compress(x)
    assert torch.equal(codes, codes_g)
    d = qz.dequantize_blockwise(codes_g, scales_g, bits, 256, x.numel(), opts)
    h, dv = x.view(-1, 256), d.view(-1, 256)
    if opts.rotation == "hadamard":  # compare in the rotated domain (the same inner products)
        signs = rot.signs(256, opts.seed)
        h, dv = rot.rotate(h.clone(), signs), rot.rotate(dv.clone(), signs)
    live = torch.ones(16, dtype=torch.bool)
    live[1] = False
    torch.testing.assert_close((dv * h).sum(1)[live], (h * h).sum(1)[live], rtol=1e-5, atol=0)
    assert scales_g[1] == 0 and torch.all(d[256:512] == 0)
    if bits == 2 and opts.scale == "mse" and opts.rounding == "nearest":
        shrunk = qz.dequantize_blockwise(codes, scales, bits, 256, x.numel(), opts)
        assert (shrunk @ x) / (x @ x) < 0.95
    x[3] = float("nan")
    assert not torch.isfinite(fixed.compress(x)[1][0])


def test_gain_correction_feeds_the_refit_scale_to_the_error():
    """Guards against an error update that reads the scale from before the refit (the
    error would then carry a remainder that was in fact sent): with beta 0 and fp32
    error, what was sent over 12 steps plus the final error equals the sum of the inputs;
    and kernels without the correction refuse it."""
    torch.manual_seed(4)
    opts = qz.QuantOptions("uniform", "mse", "hadamard", "nearest")
    comp = LoCoCompressor(1000, bits=2, beta=0.0, error_bits=32, reset_interval=0, options=opts,
                          gain_correction=True, chunk_elements=256)
    sent, total = torch.zeros(1000), torch.zeros(1000)
    for _ in range(12):
        g = torch.randn(1000)
        total += g
        codes, scales = comp.compress(g)
        sent += qz.dequantize_blockwise(codes, scales, 2, 256, 1000, opts)
    torch.testing.assert_close(sent + comp.error(), total, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="gain_correction is implemented by the torch kernels only"):
        LoCoCompressor(1000, bits=2, kernels="triton", gain_correction=True)


def test_state_and_option_checks():
    """Guards against resuming a rotated error buffer without (or with another) rotation,
    a kernel choice refusing an option its kernels implement, and bad option values getting through."""
    a = LoCoCompressor(600, bits=2, options=ALL)
    a.compress(torch.randn(600))
    b = LoCoCompressor(600, bits=2, options=ALL)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.error(), b.error()) and b.step == 1
    from loco_megatron.loco.compressor import LoCoStateMismatch

    with pytest.raises(LoCoStateMismatch, match="rotation hadamard"):
        LoCoCompressor(600, bits=2).load_state_dict(a.state_dict())
    # The C++ and the Triton kernels implement every option (auto on CUDA: triton).
    assert resolve_kernels("triton", "cpu", True, 2, 256, 8, True, options=ALL.non_default()) == "triton"
    assert resolve_kernels("auto", "cuda", False, 2, 256, 8, True, options=ALL.non_default()) == "triton"
    assert resolve_kernels("cpu", "cpu", True, 2, 256, 8, True, options=ALL.non_default()) == "cpu"
    assert resolve_kernels("auto", "cpu", True, 2, 256, 8, True, options=ALL.non_default()) == "cpu"
    assert LoCoCompressor(600, bits=2, kernels="triton", options=ALL).options == ALL
    with pytest.raises(ValueError, match="rounding must be one of"):
        qz.QuantOptions(rounding="up")
    with pytest.raises(ConfigError, match="--loco-rotation: hadamard .* needs a power-of-two"):
        LoCoConfig(loco_bits=2, loco_block_size=24)
    assert LoCoConfig(loco_bits=2, loco_block_size=24, loco_rotation="none").loco_quantizer == "uniform"
    with pytest.raises(ConfigError, match="--loco-scale: 'l2' is not one of absmax, mse"):
        LoCoConfig(loco_bits=2, loco_scale="l2")
    # 2 bits default to the study's choice; 4 and 8 bits keep the original scheme unless asked
    opts = lambda c: (c.loco_quantizer, c.loco_scale, c.loco_rotation, c.loco_rounding)  # noqa: E731
    assert opts(LoCoConfig(loco_bits=2)) == ("uniform", "mse", "hadamard", "nearest")
    assert opts(LoCoConfig(loco_bits=4)) == opts(LoCoConfig(loco_bits=8)) == ("symmetric", "absmax", "none", "nearest")
    assert opts(LoCoConfig(loco_bits=2, loco_scale="absmax")) == ("uniform", "absmax", "hadamard", "nearest")



def _worker(rank, port, queue, collected):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        layout = ShardLayout(3000, 2, 2, 256, options=ALL)
        comp = LoCoCompressor(**layout.compressor_shape(), bits=2, options=ALL, stream=rank)
        probe = LoCoCompressor(**layout.compressor_shape(), bits=2, options=ALL, stream=rank)
        g = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
        sent = layout.pack(*probe.compress(g.clone()))  # what this rank transmits
        work, _ = compressed_reduce_scatter(g, comp.compress, layout, None, async_op=False)
        signs = [torch.zeros(256) for _ in range(2)]
        dist.all_gather(signs, rot.signs(256, ALL.seed))
        rows = [torch.zeros_like(sent) for _ in range(2)]
        dist.all_gather(rows, sent)
        queue.put((rank, work.output.clone(), signs, rows))
        collected.wait(timeout=120)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_share_signs_and_reduce_exactly():
    """Guards against ranks rotating with different signs (the sum would be garbage) or the
    reduce-scatter unrotating wrongly: on 2 gloo ranks both derive the same signs, and each
    rank's reduced shard equals the sum of both ranks' rows dequantised independently."""
    ctx = mp.get_context("spawn")
    queue, collected = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue, collected)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (queue.get(timeout=300) for _ in range(2)))
    collected.set()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    layout = ShardLayout(3000, 2, 2, 256, options=ALL)
    for rank, (out, signs, rows) in got.items():
        assert torch.equal(signs[0], signs[1])
        ref = sum(qz.dequantize_blockwise(*layout.unpack_row(r[rank]), 2, 256, layout.shard, ALL) for r in rows)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_training_with_every_option_resumes_bit_exact(cache_dir, tmp_path, cpu_kernels_built):
    """Guards against an option state missing from checkpoints (stochastic-rounding keys
    that restart, signs that change), options not reaching the compressors, or options
    missing from the metrics' config: 2 ranks, 2 bits with all four options on, train 8
    steps; 4 + save + resume 4 reproduces the losses bit for bit."""
    from conftest import TINY, torchrun, train_losses

    args = TINY + ["--train-iters", "8", "--lr-decay-iters", "8", "--loco-bits", "2", "--loco-quantizer", "uniform",
                   "--loco-scale", "mse", "--loco-rotation", "hadamard", "--loco-rounding", "stochastic",
                   "--loco-quant-seed", "5", "--loco-reset-interval", "3"]
    proc, full = torchrun(2, args, cache_dir, tmp_path, name="full")
    assert "LoCo: 2-bit uniform/mse/rotation hadamard/stochastic" in proc.stdout
    assert "kernels: grads cpu, params off (megatron's all-gather)" in proc.stdout  # auto: the fused path
    config = next(m["config"] for m in full if "config" in m)
    assert {k: config[k] for k in ("loco_quantizer", "loco_scale", "loco_rotation", "loco_rounding")} == \
        {"loco_quantizer": "uniform", "loco_scale": "mse", "loco_rotation": "hadamard", "loco_rounding": "stochastic"}
    a = train_losses(full)
    assert a[8] < a[1] - 0.05  # it trains (deterministic: 8.32 -> 8.25 here)
    ck = str(tmp_path / "ck")
    torchrun(2, args + ["--train-iters", "4", "--save", ck], cache_dir, tmp_path, name="first")
    proc, resumed = torchrun(2, args + ["--load", ck], cache_dir, tmp_path, name="resumed")
    assert "resuming from" in proc.stdout
    b = train_losses(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    assert all(a[it] == b[it] for it in b), (a, b)


def _search_before_the_fused_kernels(blocks, bits, opts):
    """The mse search as it was: each candidate's levels round(x / (c*s)) and error by
    torch's own (unspecified-order) sum, six full passes."""
    base = qz.option_scales(blocks, bits, dataclasses.replace(opts, scale="absmax"))
    nearest = dataclasses.replace(opts, rounding="nearest")
    work = torch.empty_like(blocks)
    best_s = best_err = None
    for c in qz.MSE_CLIP_RATIOS:
        s = base * c
        lv = qz.levels_(blocks, s, bits, nearest, out=work)
        err = torch.addcmul(blocks, lv, s.unsqueeze(1), value=-1.0).square_().sum(dim=1)
        if best_s is None:
            best_s, best_err = s, err
        else:
            better = err < best_err
            best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)
    return best_s


def test_mse_search_quality_equals_the_full_search():
    """Guards against the search the fused kernels run (one division per element, errors in
    units of the base scale, and the descent of mse_choice that evaluates four of the six
    ratios) losing quality: over gradient-like blocks (Gaussian with log-normal block
    scales, Student-t tails, sparse), rotated or not, 2 and 4 bits, both grids, the mean
    squared quantisation error with its scales is within 0.5% of the six-pass search."""
    gen = torch.Generator().manual_seed(0)
    n = 128
    gauss = torch.randn(n, 256, generator=gen) * torch.randn(n, 1, generator=gen).exp()
    chi2 = torch.randn(3, n, 256, generator=gen).square().sum(0)
    t3 = torch.randn(n, 256, generator=gen) / (chi2 / 3).sqrt()  # Student-t, 3 degrees of freedom
    sparse = torch.randn(n, 256, generator=gen) * (torch.rand(n, 256, generator=gen) < 0.1) + \
        1e-3 * torch.randn(n, 256, generator=gen)
    signs = rot.signs(256, 0)
    for name, x in (("gauss", gauss), ("student-t", t3), ("sparse", sparse)):
        for rotated in (False, True):
            blocks = rot.rotate(x, signs) if rotated else x
            for bits, quantizer in ((2, "uniform"), (2, "symmetric"), (4, "symmetric")):
                opts = qz.QuantOptions(quantizer, "mse")
                errs = []
                for s in (qz.option_scales(blocks, bits, opts), _search_before_the_fused_kernels(blocks, bits, opts)):
                    lv = qz.levels_(blocks, s, bits, opts, torch.empty_like(blocks))
                    errs.append(float((blocks - lv * s.unsqueeze(1)).square().mean()))
                assert abs(errs[0] / errs[1] - 1) <= 0.005, (name, rotated, bits, quantizer, errs)


def test_mse_choice_is_the_descent():
    """Guards against an mse choice that reads other errors than the four the fused kernels
    compute, or breaks ties the other way: 0.8 vs 0.7 first (ties go up), then up while at
    least as good, down only while strictly better; a NaN never wins; only the winning
    side's pair is read (the other pair is garbage here and must not matter)."""
    nan = float("nan")
    # columns: errors for ratios 1.0, 0.9, 0.8, 0.7, 0.6, 0.5
    cases = [
        ([9, 9, 3, 5, -1, -1], 2),      # 0.8 beats 0.7, 0.9 worse: stay (the down pair is ignored)
        ([2, 2, 3, 5, -1, -1], 0),      # up twice, ties move up
        ([1, 2, 3, 5, -1, -1], 0),
        ([3, 2, 3, 5, -1, -1], 1),
        ([9, 1, 4, 4, 0, 0], 1),        # 0.8 ties 0.7: goes up (and reads 1.0/0.9, not 0.6/0.5)
        ([-1, -1, 5, 3, 4, 0], 3),      # 0.7 beats 0.8, 0.6 worse: stay (0.5 is not read)
        ([-1, -1, 5, 3, 3, 0], 3),      # a tie does not move down
        ([-1, -1, 5, 3, 2, 2], 4),
        ([-1, -1, 5, 3, 2, 1], 5),
        ([0, 0, nan, nan, 0, 0], 3),    # NaN: stops at 0.7
        ([0, 0, 0, 0, 0, 0], 0),        # a zero block: all ties, up to 1.0 (scale 0 either way)
    ]
    err = torch.tensor([c for c, _ in cases], dtype=torch.float32).T
    assert qz.mse_choice(err).tolist() == [want for _, want in cases]
