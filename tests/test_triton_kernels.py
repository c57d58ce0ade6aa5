"""Fused Triton kernels vs the pure-torch reference, on CPU under TRITON_INTERPRET=1.

The same checks run on CUDA (without the interpreter) when a GPU is present; see
``benchmarks/kernels.py`` for their speed.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from conftest import TINY, torchrun, train_losses
from loco_megatron.loco.collectives import ShardLayout, decompress_into
from loco_megatron.loco.compressor import LoCoCompressor
from loco_helpers import resolve_kernels
from loco_megatron.loco.kernel_choice import choose_kernels, kernels_line

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tk():
    """The kernels module (interpreted on CPU: conftest sets TRITON_INTERPRET=1 before
    anything imports triton)."""
    if DEVICE == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"
    return importlib.import_module("loco_megatron.loco.triton_kernels")


def _inputs(n: int, step: int) -> dict[str, torch.Tensor]:
    """Random and adversarial gradients: zero blocks, huge values, denormals, mixed scales."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(step)) * 10 ** (step % 3)
    adversarial = g.clone()
    adversarial[:256] = 0.0                  # an all-zero block
    adversarial[256:266] = 1e-42             # denormals: the scale underflows
    adversarial[600] = 3e38                  # near fp32 max
    adversarial[900:1000] *= 1e-6            # tiny next to large in one block
    half_ties = torch.full((n,), 0.5)        # exact ties: round half to even
    half_ties[::256] = 7.0
    return {"random": g, "adversarial": adversarial, "ties": half_ties}


def _pair(n, bits, **kw):
    ref = LoCoCompressor(n, bits=bits, device=DEVICE, **kw)
    fused = LoCoCompressor(n, bits=bits, device=DEVICE, kernels="triton", **kw)
    return ref, fused


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [2048, 2567])
@pytest.mark.parametrize("kind", ["random", "adversarial", "ties"])
def test_compress_matches_reference(tk, bits, n, kind):
    """Guards against any divergence of the fused compress from the reference: codes and
    scales bit-identical over several steps (so the error feeds back), the stored error
    within one int8 step, the metric sums equal - also for sizes off the block grid.

    (The residual ``h - q*s`` may differ by an ulp of ``h``: the kernel computes it with
    one FMA, as torch's addcmul does on CPU, but on CUDA torch rounds ``q*s`` first
    (measured on an H200) and the interpreter cannot fuse. That only shows where the error
    itself is ulp-sized, e.g. next to 3e38, hence the ulp term; and where that ulp-sized
    residual is the largest in its block (3e38 next to O(1) values) it sets the block's
    int8 error scale, so the error is bounded by the larger of the two error steps.)"""
    ref, fused = _pair(n, bits)
    for step in range(3):
        g = _inputs(n, step)[kind].to(DEVICE)
        h = g.abs() + ref.error().abs()
        ca, sa = ref.compress(g)
        cb, sb = fused.compress(g)
        assert torch.equal(ca, cb) and torch.equal(sa, sb), step
        step_size = torch.maximum(ref.state_dict()["error_scales"],
                                  fused.state_dict()["error_scales"]).repeat_interleave(256)[:n]
        ulps = 2 * torch.finfo(torch.float32).eps * h
        assert torch.all((ref.error() - fused.error()).abs() <= step_size * 1.001 + ulps + 1e-30), step
        # Squares of the ulp-sized residuals next to 3e38 overflow in one and not the other.
        finite = torch.isfinite(ref.last_stats) & torch.isfinite(fused.last_stats)
        tiny = float(ref.last_stats[2].clamp(max=1e30)) * 1e-9  # e.g. ulp-level errors of exact ties
        torch.testing.assert_close(ref.last_stats[finite], fused.last_stats[finite], rtol=1e-4, atol=tiny)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_and_no_error_feedback(tk, dtype):
    """Guards against the kernel assuming fp32 gradients or reading an error buffer that
    the no-error-feedback ablation does not have."""
    ref, fused = _pair(3000, 4, error_feedback=False)
    g = torch.randn(3000).to(dtype).to(DEVICE)
    assert all(torch.equal(a, b) for a, b in zip(ref.compress(g), fused.compress(g)))
    assert fused.error_nbytes() == 0 and fused.last_stats[0] == 0


def test_non_finite_gradient_leaves_error_untouched(tk):
    """Guards against a NaN/Inf leaking into the error (the whole buffer's error must stay
    as it was) or being hidden from the optimizer's overflow check."""
    ref, fused = _pair(2048, 4)
    g = torch.randn(2048, device=DEVICE)
    ref.compress(g)
    fused.compress(g)
    before = fused.state_dict()
    bad = torch.randn(2048, device=DEVICE)
    bad[1500] = float("nan")
    bad[10] = float("inf")
    ca, sa = ref.compress(bad)
    cb, sb = fused.compress(bad)
    assert torch.equal(ca, cb) and torch.equal(sa.isfinite(), sb.isfinite())
    assert torch.equal(sa[sa.isfinite()], sb[sb.isfinite()])
    assert not torch.isfinite(sb).all()
    after = fused.state_dict()
    assert torch.equal(before["error"], after["error"]) and torch.equal(before["error_scales"], after["error_scales"])
    assert torch.equal(fused.last_stats, torch.zeros(4, device=DEVICE))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_decompress_sum_matches_reference(tk, bits, out_dtype):
    """Guards against wrong unpacking, scale offsets, summation order or padding writes in
    the fused decompress-and-sum: bit-identical to the reference, padding untouched."""
    world, shard = 3, 700  # 700 is not a multiple of the block: padded shards
    layout = ShardLayout(world * shard, world, bits, 256)
    rows = []
    for r in range(world):
        comp = LoCoCompressor(layout.compressed_numel, bits=bits, device=DEVICE)
        rows.append(layout.pack(*comp.compress(torch.randn(layout.compressed_numel, device=DEVICE) * (r + 1)))[1])
    recv = torch.stack(rows).contiguous()
    want = torch.full((shard + 5,), 42.0, dtype=out_dtype, device=DEVICE)
    got = want.clone()
    decompress_into(recv, layout, want[:shard], 1.0 / world)
    tk.decompress_sum(recv, layout, got[:shard], 1.0 / world)
    assert torch.equal(want, got)
    assert torch.all(got[shard:] == 42.0)


def test_kernel_selection():
    """Guards against silently running the slow interpreter, or failing with a traceback,
    when --loco-kernels asks for something this machine cannot do, and against auto on
    CUDA leaving the quantiser options (the 2-bit default) or the parameter gather to the
    slower torch path."""
    assert resolve_kernels("auto", "cpu", False, 4, 256, 8, True) == "cpu"  # the C++ kernels on CPU
    assert resolve_kernels("auto", "cpu", True, 4, 256, 8, True) == "cpu"  # never auto-interpret
    assert resolve_kernels("torch", "cuda", False, 4, 256, 8, True) == "torch"
    assert resolve_kernels("auto", "cuda", False, 4, 192, 8, True) == "torch"  # unsupported shape
    assert resolve_kernels("triton", "cpu", True, 4, 256, 8, True) == "triton"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_kernels("triton", "cpu", False, 4, 256, 8, True)
    with pytest.raises(ValueError, match="power-of-two"):
        resolve_kernels("triton", "cuda", False, 4, 192, 8, True)
    # 8-bit gradients fit 16-element blocks, 2-bit parameters on the same kernels do not
    assert resolve_kernels("triton", "cuda", False, 8, 16, 8, True) == "triton"
    with pytest.raises(ValueError, match="power-of-two --loco-block-size, got 16"):
        resolve_kernels("triton", "cuda", False, 8, 16, 8, True, param_gather_bits=2)
    with pytest.raises(ValueError, match="int8 error buffer"):
        resolve_kernels("triton", "cuda", False, 4, 256, 32, True)
    # auto on CUDA with the 2-bit default options: the Triton kernels implement them
    two_bit = ["--loco-quantizer uniform", "--loco-scale mse", "--loco-rotation hadamard"]
    assert choose_kernels("auto", "cuda", False, 2, 256, 8, True, options=two_bit) == ("triton", None)
    assert choose_kernels("auto", "cuda", False, 4, 256, 8, True) == ("triton", None)
    # the parameter gather runs on the Triton kernels too (encode and decode-and-apply)
    assert kernels_line("triton", True, 2, None) == "kernels: grads triton, params triton"
    # a shape they cannot serve still falls back on auto, saying why
    kernels, why = choose_kernels("auto", "cuda", False, 2, 192, 8, True, options=two_bit)
    assert (kernels, why) == ("torch", "--loco-kernels triton needs a power-of-two --loco-block-size, got 192")
    assert kernels_line(kernels, True, 4, why) == f"kernels: grads torch, params torch; torch because {why}"


def test_jit_functions_read_only_constexpr_globals(tk):
    """Guards against a kernel that passes every interpreted test and does not compile on a
    GPU: the Triton compiler refuses any global a @triton.jit function reads unless it is a
    ``tl.constexpr`` (or another jit function / a module), while TRITON_INTERPRET=1 runs
    plain Python and accepts it. The first H200 run failed all kernels on a plain-float
    ``_ROUND_MAGIC``; this is its CPU twin (benchmarks/gpu_check.sh compiles them for real)."""
    import types

    import triton
    import triton.language as tl

    from triton.runtime.interpreter import InterpretedFunction

    kinds = (triton.runtime.jit.JITFunction, InterpretedFunction)  # compiled / interpreted
    modules = [tk] + [m for m in vars(tk).values() if isinstance(m, types.ModuleType)
                      and m.__name__.startswith(tk.__name__ + ".")]
    jitted = {f"{m.__name__}.{name}": obj for m in modules for name, obj in vars(m).items() if isinstance(obj, kinds)}
    names = {name.rsplit(".", 1)[1] for name in jitted}
    assert {"_compress_kernel", "_decompress_sum_kernel", "round_half_even", "wht", "mse_scale", "mix32"} <= names
    bad = []
    for name, fn in jitted.items():
        code, glb = fn.fn.__code__, fn.fn.__globals__
        for ref in code.co_names:
            if ref not in glb:
                continue  # an attribute name (tl.max) or a builtin (float)
            val = glb[ref]
            if not isinstance(val, (types.ModuleType, *kinds, tl.constexpr)):
                bad.append(f"{name} reads {ref} ({type(val).__name__})")
    assert not bad, bad


@pytest.mark.parametrize("bits", ["4", "2"])
def test_training_with_triton_kernels_matches_torch(cache_dir, tmp_path, monkeypatch, bits):
    """Guards against a wiring bug between the kernels and megatron's buckets: 2-rank
    training with --loco-kernels triton (interpreted) follows the torch path - equal
    losses while the error is still zero or identical, close afterwards. 2 bits runs the
    2-bit default options (uniform grid, mse scale, Hadamard rotation) on both paths: the
    options and the rotated receive side must reach the kernels through the hooks."""
    args = TINY + ["--train-iters", "3", "--lr-decay-iters", "3", "--loco-bits", bits]
    _, ref = torchrun(2, args + ["--loco-kernels", "torch"], cache_dir, tmp_path, name="torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _, fused = torchrun(2, args + ["--loco-kernels", "triton"], cache_dir, tmp_path, name="triton")
    a, b = train_losses(ref), train_losses(fused)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert a[1] == b[1] and a[2] == b[2]
    assert b[3] == pytest.approx(a[3], rel=1e-3)


def test_tile_offsets_are_64_bit(tk):
    """Guards against int32 offsets in the kernels: a bucket of 2**31 elements or more
    (one stage as one bucket with --no-overlap-grad-reduce) would wrap to negative
    addresses. The kernels' tile helper, run for a program whose blocks start at element
    2**32 + 1024, must give that offset exactly."""
    import triton
    import triton.language as tl

    globals()["_tile_under_test"] = tk.jit.tile  # a jit function resolves callees from its globals

    @triton.jit
    def probe(out_ptr, pid, ROWS: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
        blocks, offs = _tile_under_test(pid, ROWS, K, BK)  # noqa: F821
        tl.store(out_ptr + tl.arange(0, 1), tl.min(tl.min(tl.min(offs, axis=2), axis=1), axis=0))

    out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    rows, bits, block = 4, 4, 256
    pid = 2 ** 32 // block // rows + 1  # its first block starts at element 2**32 + 1024
    probe[(1,)](out, pid, ROWS=rows, K=8 // bits, BK=block * bits // 8)
    assert int(out[0]) == pid * rows * block > 2 ** 32


@pytest.mark.parametrize("rows,numel", [(3, 3000), (4, 5)])
def test_row_padded_layout_matches_reference(tk, rows, numel):
    """Guards against the fused kernel reading across rows or past a ragged last row: with
    rows padded to whole blocks in place (no padded copy), codes, scales and the error
    equal the torch reference's."""
    g = torch.randn(numel, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref = LoCoCompressor(numel, bits=4, rows=rows, block_size=8 if numel < 100 else 256, device=DEVICE)
    fused = LoCoCompressor(numel, bits=4, rows=rows, block_size=8 if numel < 100 else 256, device=DEVICE,
                           kernels="triton")
    for _ in range(2):
        a, b = ref.compress(g), fused.compress(g)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (ref.error() - fused.error()).abs().max() <= ref.error().abs().max() / 100 + 1e-6


@pytest.mark.parametrize("rows,numel", [(2, 3584), (3, 3000)])
def test_many_tiles_per_program_match_reference(tk, monkeypatch, rows, numel):
    """Guards against the compress's per-program tile loop (several tiles of blocks per
    program, as on a GPU) skipping, repeating or overrunning blocks, on rows of whole blocks
    (the EVEN path: block space is the buffer) and on padded rows: 2 blocks per tile, 3 tiles
    per program, over 14 and 12 blocks (the last program partly empty); codes and scales
    equal the torch reference's, the error within 1%."""
    monkeypatch.setattr(tk, "_rows", lambda t: 2)
    monkeypatch.setattr(tk, "_tiles", lambda t: 3)
    g = torch.randn(numel, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ref = LoCoCompressor(numel, bits=4, rows=rows, device=DEVICE)
    fused = LoCoCompressor(numel, bits=4, rows=rows, device=DEVICE, kernels="triton")
    for _ in range(2):
        a, b = ref.compress(g), fused.compress(g)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (ref.error() - fused.error()).abs().max() <= ref.error().abs().max() / 100 + 1e-6
    torch.testing.assert_close(ref.last_stats, fused.last_stats, rtol=1e-4, atol=1e-6)
