"""The Triton kernels with the quantiser options (uniform grid, mse scale, Hadamard rotation,
stochastic rounding) vs the pure-torch reference, on CPU under TRITON_INTERPRET=1, and the
kernels compiled for a real GPU (sm_90) without one."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from loco_megatron.loco import quantize as qz
from loco_megatron.loco.collectives import ShardLayout, decompress_into
from loco_megatron.loco.compressor import LoCoCompressor
from loco_megatron.loco.triton_kernels import jit as J  # after conftest chose the interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
O = qz.QuantOptions
DEFAULT_2BIT = O("uniform", "mse", "hadamard", "nearest", seed=7)
CASES = {  # name -> options; each option alone, the 2-bit default, the default + stochastic
    "uniform": O("uniform", seed=7), "mse": O(scale="mse", seed=7), "hadamard": O(rotation="hadamard", seed=7),
    "stochastic": O(rounding="stochastic", seed=7), "default2": DEFAULT_2BIT,
    "default2+stochastic": O("uniform", "mse", "hadamard", "stochastic", seed=7),
}


@pytest.fixture(scope="module")
def tk():
    """The kernels package (interpreted on CPU: conftest sets TRITON_INTERPRET=1)."""
    if DEVICE == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"
    return importlib.import_module("loco_megatron.loco.triton_kernels")


def _grad(n: int, step: int, dtype=torch.float32) -> torch.Tensor:
    """Random values with a zero block, denormals, a huge value (step 2), tiny next to
    large, and exact ties of the nearest rounding."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(step)) * 10 ** (step % 3)
    g[:256] = 0.0
    g[256:266] = 1e-42
    # near fp32 max, in the last step only: there the residual h - q*s is one FMA in the kernel
    # and in torch's CPU addcmul, but rounded twice in the interpreter and in CUDA torch, so
    # the stored errors differ by an ulp of 3e38, which later steps' codes would inherit
    g[600] = 3e38 if step == 2 else -5.0
    g[900:1000] *= 1e-6
    g[1300:1400] = 0.5
    return g.to(dtype).to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 as int32 bits: torch.equal says -0.0 == 0.0; the kernels must keep the sign too."""
    return t.float().contiguous().view(torch.int32)


def _stored(c: LoCoCompressor) -> torch.Tensor:
    """fp32 ``[nb, B]`` stored error, in the domain it is kept (rotated with the rotation)."""
    return c.error_buffer.blocks()


def _check_steps(ref, fused, grads):
    """Codes and scales bit-identical every step (the error feeds back), the stored error
    within one int8 step plus ulps of the block, the metric sums close."""
    for step, g in enumerate(grads):
        ca, sa = ref.compress(g)
        cb, sb = fused.compress(g)
        assert torch.equal(ca, cb) and torch.equal(_bits(sa), _bits(sb)), step
        ea, eb = _stored(ref), _stored(fused)
        step_size = torch.maximum(ref.error_buffer.scales, fused.error_buffer.scales).unsqueeze(1)
        gb = torch.nn.functional.pad(g.float(), (0, ref.padded_numel - g.numel())).view_as(ea)
        ulps = 2 * torch.finfo(torch.float32).eps * (gb.norm(dim=1, keepdim=True) + ea.abs())
        assert torch.all((ea - eb).abs() <= step_size * 1.001 + ulps + 1e-30), step
        finite = torch.isfinite(ref.last_stats) & torch.isfinite(fused.last_stats)
        tiny = float(ref.last_stats[2].clamp(max=1e30)) * 1e-9
        torch.testing.assert_close(ref.last_stats[finite], fused.last_stats[finite], rtol=1e-4, atol=tiny)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_options_compress_matches_reference(tk, case, bits):
    """Guards against the fused compress diverging from the reference for any quantiser
    option: a wrong signed extreme (first on ties, sign of zero), a different mse candidate
    (order of the tree sum, ties, NaN), butterflies in another order, noise at another
    element index, the rotated error updated from h - R(g) instead of re-read - over three
    steps of a size off the block grid, with zero blocks, denormals and exact ties."""
    n, opts = 2567, CASES[case]
    ref = LoCoCompressor(n, bits=bits, options=opts, stream=3, device=DEVICE)
    fused = LoCoCompressor(n, bits=bits, options=opts, stream=3, device=DEVICE, kernels="triton")
    _check_steps(ref, fused, [_grad(n, s) for s in range(3)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_options_without_error_feedback(tk, dtype):
    """Guards against the options' kernel path assuming fp32 input or an error buffer:
    bf16 and fp32 gradients, no error feedback, the 2-bit default + stochastic rounding."""
    opts = CASES["default2+stochastic"]
    ref = LoCoCompressor(3000, bits=2, options=opts, error_feedback=False, device=DEVICE)
    fused = LoCoCompressor(3000, bits=2, options=opts, error_feedback=False, device=DEVICE, kernels="triton")
    for step in range(2):  # the noise key moves with the step
        g = _grad(3000, step, dtype)
        (ca, sa), (cb, sb) = ref.compress(g), fused.compress(g)
        assert torch.equal(ca, cb) and torch.equal(_bits(sa), _bits(sb)), step
    assert fused.error_nbytes() == 0 and fused.last_stats[0] == 0


def test_options_non_finite_leaves_error_untouched(tk):
    """Guards against a NaN/Inf entering the (rotated) error with the options, or a
    non-finite block getting a finite scale (the rotation spreads a NaN over its block;
    the uniform grid's signed extreme must be the NaN)."""
    opts = DEFAULT_2BIT
    ref = LoCoCompressor(2048, bits=2, options=opts, device=DEVICE)
    fused = LoCoCompressor(2048, bits=2, options=opts, device=DEVICE, kernels="triton")
    g = torch.randn(2048, device=DEVICE)
    ref.compress(g)
    fused.compress(g)
    before = fused.state_dict()
    bad = torch.randn(2048, device=DEVICE)
    bad[1500], bad[10] = float("nan"), float("inf")
    (ca, sa), (cb, sb) = ref.compress(bad), fused.compress(bad)
    assert torch.equal(ca, cb) and torch.equal(sa.isfinite(), sb.isfinite()) and not sb.isfinite().all()
    assert torch.equal(sa.isnan(), sb.isnan())
    assert torch.equal(_bits(sa[sa.isfinite()]), _bits(sb[sb.isfinite()]))
    after = fused.state_dict()
    assert torch.equal(before["error"], after["error"]) and torch.equal(before["error_scales"], after["error_scales"])
    assert torch.equal(fused.last_stats, torch.zeros(4, device=DEVICE))


@pytest.mark.parametrize("rows,numel,block", [(3, 3000, 256), (4, 50, 32)])
def test_options_ragged_rows_match_reference(tk, rows, numel, block):
    """Guards against the options' kernel path reading across rows, past a ragged last row,
    or hashing the noise at a buffer index instead of the block-space index (rows padded to
    whole blocks): codes and scales equal the reference's over two steps."""
    opts = CASES["default2+stochastic"]
    ref = LoCoCompressor(numel, bits=2, rows=rows, block_size=block, options=opts, device=DEVICE)
    fused = LoCoCompressor(numel, bits=2, rows=rows, block_size=block, options=opts, device=DEVICE,
                           kernels="triton")
    g = torch.randn(numel, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    _check_steps(ref, fused, [g, -g])


@pytest.mark.parametrize("bits,case", [(2, "default2"), (4, "uniform"), (4, "hadamard")])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_options_decompress_sum_matches_reference(tk, bits, case, out_dtype):
    """Guards against the fused decompress-and-sum dropping the sign of uniform scales,
    unrotating per rank instead of once (or after the scaling), or turning a -0.0 sum
    into +0.0: bit-identical to the reference (signed zeros included), padding untouched."""
    world, shard = 3, 700
    opts = CASES[case]
    layout = ShardLayout(world * shard, world, bits, 256, options=opts)
    rows = []
    for r in range(world):
        comp = LoCoCompressor(layout.compressed_numel, bits=bits, device=DEVICE, options=opts)
        g = torch.randn(layout.compressed_numel, device=DEVICE) * (r + 1)
        g[:512] = 0.0  # zero blocks (in row 0, the one kept): their uniform scale is -0.0, so D = -0.0
        rows.append(layout.pack(*comp.compress(g))[0])
    recv = torch.stack(rows).contiguous()
    want = torch.full((shard + 5,), 42.0, dtype=out_dtype, device=DEVICE)
    got = want.clone()
    decompress_into(recv, layout, want[:shard], 1.0 / world)
    tk.decompress_sum(recv, layout, got[:shard], 1.0 / world)
    as_int = torch.int32 if out_dtype == torch.float32 else torch.int16
    assert torch.equal(want.view(as_int), got.view(as_int))
    assert torch.all(got[shard:] == 42.0)


def test_mse_constants():
    """Guards against the kernels' clip ratios drifting from quantize.MSE_CLIP_RATIOS or
    their reciprocals from torch's fp32(1 / fp32(c)) (a silent change of the mse search)."""
    for i, c in enumerate(qz.MSE_CLIP_RATIOS):
        cf = torch.tensor(c, dtype=torch.float32)
        assert getattr(J, f"CLIP{i}").value == float(cf)
        assert getattr(J, f"INV{i}").value == float(torch.ones((), dtype=torch.float32) / cf)


def test_mse_pick_is_the_descent(tk):
    """Guards against the Triton mse choice drifting from quantize.mse_choice (the CPU
    kernel and torch take the descent; a least-of-six here would pick other scales in the
    rare blocks where the two differ, and no random-gradient test would notice): errors
    with many ties and NaNs, picked by the jit helper in a small kernel, equal torch's."""
    import triton
    import triton.language as tl

    @triton.jit
    def pick(err_ptr, out_ptr, ROWS: tl.constexpr):
        r, k = tl.arange(0, ROWS), tl.arange(0, 8)
        tl.store(out_ptr + r, J.mse_pick(tl.load(err_ptr + r[:, None] * 8 + k[None, :]), k))

    gen = torch.Generator().manual_seed(3)
    err = torch.randint(0, 3, (256, 8), generator=gen).float()  # 3 values: ties everywhere
    err[torch.rand(256, 8, generator=gen) < 0.05] = float("nan")
    out = torch.empty(256, dtype=torch.int32, device=DEVICE)
    pick[(1,)](err.to(DEVICE), out, ROWS=256)
    assert torch.equal(out.cpu().long(), qz.mse_choice(err[:, :6].T))


def test_kernels_compile_for_sm90():
    """Guards against kernels that pass every interpreted test and do not compile on a GPU
    (the interpreter accepts code the compiler refuses), and against the products the
    reference rounds being fused into FMAs: one subprocess without TRITON_INTERPRET
    compiles compress and decompress for sm_90 (the original 4-bit scheme, with rows of
    whole blocks too, the 2-bit
    default with error feedback, + stochastic rounding, bf16-out decompress with the
    rotation) and the parameter gather's decode-and-apply (4-bit fp32 in place, 2-bit
    Hadamard bf16 own shard); each gives a cubin, and its PTX holds the explicit mul.rn
    (without it the delta q*s would be contracted into the add of the parameter); and
    against a compress whose gradient loads are not vectorised (16-byte ``ld.global.v4``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-m", "loco_megatron.loco.triton_kernels.ahead"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 8 and all(": ok ptx" in ln and ln.endswith("mul.rn True") for ln in lines), out.stdout
    assert sum(ln.startswith("param apply") for ln in lines) == 2, out.stdout
    # Memory speed needs wide loads: every compress reads its fp32 gradient 16 bytes at a time.
    compress = [ln for ln in lines if ln.startswith("compress")]
    assert len(compress) == 4 and all(int(ln.split(" v4-loads ")[1].split()[0]) > 0 for ln in compress), out.stdout
    assert all(int(ln.split(" cubin ")[1].split()[0]) > 0 for ln in lines)
