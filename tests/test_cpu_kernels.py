"""Fused C++ CPU kernels (``loco/cpu_kernels.py``, ``loco/csrc/loco_cpu.cpp``) vs the torch
reference. The extension is built once per machine (torch's extensions cache) and loaded
once per test session; see ``benchmarks/kernels.py`` for its speed."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, torchrun, train_losses
from loco_megatron.loco import collectives, cpu_kernels
from loco_megatron.loco import quantize as qz
from loco_megatron.loco.collectives import ShardLayout, decompress_into
from loco_megatron.loco.compressor import LoCoCompressor
from loco_megatron.loco.kernel_choice import resolve_kernels
from test_triton_kernels import _inputs


@pytest.fixture(scope="module")
def ext():
    built = cpu_kernels.extension()
    assert built is not None, "the C++ CPU kernels did not build on this machine"
    return built


def _state(n: int, nblocks: int):
    return torch.zeros(nblocks, 256, dtype=torch.int8), torch.zeros(nblocks)


def _assert_same_step(ref: LoCoCompressor, ref_out, err, err_s, got, tag):
    """Codes and scales bit for bit, error within one int8 step, metric sums close."""
    (ca, sa), (cb, sb, stats) = ref_out, got
    assert torch.equal(ca, cb), tag
    assert torch.equal(sa.isfinite(), sb.isfinite()) and torch.equal(sa[sa.isfinite()], sb[sb.isfinite()]), tag
    sd = ref.state_dict()
    step = sd["error_scales"].unsqueeze(1)
    diff = (sd["error"].float() * step - err.float() * err_s.unsqueeze(1)).abs()
    assert torch.all(diff <= step * 1.001 + 1e-30), tag
    finite = ref.last_stats.isfinite() & stats.isfinite()
    tiny = float(ref.last_stats[2].clamp(max=1e30)) * 1e-9
    torch.testing.assert_close(ref.last_stats[finite], stats[finite], rtol=1e-4, atol=tiny)


ISAS = [0, 1, 2]
"""Instruction-set copies of the kernels (baseline, AVX2+FMA, AVX-512); one the CPU lacks
runs the best it has."""


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("kind", ["random", "adversarial", "ties"])
def test_compress_matches_reference(ext, bits, kind, one_pass, isa):
    """Guards against any divergence of the fused compress from the reference (rounding
    of ties, division vs reciprocal, denormal/zero blocks, 3e38, the FMA in the residual
    and error update, packing, int8 re-quantisation) over several steps, in both the
    two-pass (in place) and the one-pass (int8 scratch) scheme, for a size off the block
    grid, in every instruction-set copy (a CPU of another kind runs another one)."""
    n = 2567
    nb = qz.num_blocks(n, 256)
    ref = LoCoCompressor(n, bits=bits)
    err, err_s = _state(n, nb)
    scratch = (torch.empty_like(err), torch.empty_like(err_s)) if one_pass else (None, None)
    for step in range(3):
        g = _inputs(n, step)[kind]
        got = cpu_kernels.compress(g, err, err_s, 0.8, bits, 256, n, *scratch, isa=isa)
        _assert_same_step(ref, ref.compress(g), err, err_s, got, (kind, step))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_padded_in_place(ext, dtype):
    """Guards against blocks straddling rows, a wrong padded-row offset (64-bit row*S) or
    a bf16 read: a [W, S] gradient with a partial last block per row compresses exactly as
    the reference does on the zero-padded [W, P] copy, for the lead's bucket views."""
    world, shard = 3, 700
    layout = ShardLayout(world * shard, world, 4, 256)
    ref = LoCoCompressor(layout.compressed_numel, bits=4)
    err, err_s = _state(0, world * layout.shard_blocks)
    for step in range(2):
        g = (torch.randn(world, shard, generator=torch.Generator().manual_seed(step)) * 3).to(dtype)
        want = ref.compress(layout.padded(g.float().reshape(-1)).reshape(-1))
        got = cpu_kernels.compress(g, err, err_s, 0.8, 4, 256, layout.compressed_numel)
        _assert_same_step(ref, want, err, err_s, got, step)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_error_feedback_and_compressor_branch(ext, dtype):
    """Guards against the kernel reading an error buffer the ablation does not have, and
    against LoCoCompressor(kernels='cpu') diverging from kernels='torch' (both settings)."""
    for ef in (False, True):
        ref = LoCoCompressor(3000, bits=4, error_feedback=ef)
        fused = LoCoCompressor(3000, bits=4, error_feedback=ef, kernels="cpu")
        for step in range(2):
            g = torch.randn(3000, generator=torch.Generator().manual_seed(step)).to(dtype)
            assert all(torch.equal(a, b) for a, b in zip(ref.compress(g), fused.compress(g)))
        torch.testing.assert_close(ref.last_stats, fused.last_stats, rtol=1e-4, atol=0)
        assert fused.error_nbytes() == ref.error_nbytes() and fused.step == 2
        if ef:
            assert torch.equal(ref.state_dict()["error"], fused.state_dict()["error"])
    assert fused.last_stats[3] == 3000


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_gradient_leaves_error_untouched(ext, bad, one_pass):
    """Guards against a NaN/Inf leaking into the error (the whole buffer's error must stay
    exactly as it was, also in blocks before the bad one) or being hidden from the
    optimizer's overflow check, and against non-zero metrics on a skipped step."""
    n = 4096
    ref = LoCoCompressor(n, bits=4)
    err, err_s = _state(n, n // 256)
    scratch = (torch.empty_like(err), torch.empty_like(err_s)) if one_pass else (None, None)
    g = torch.randn(n)
    _assert_same_step(ref, ref.compress(g), err, err_s, cpu_kernels.compress(g, err, err_s, 0.8, 4, 256, n, *scratch), 0)
    before = err.clone(), err_s.clone()
    g = torch.randn(n)
    g[3000] = bad
    want = ref.compress(g)
    codes, scales, stats = cpu_kernels.compress(g, err, err_s, 0.8, 4, 256, n, *scratch)
    assert torch.equal(want[0], codes) and not scales.isfinite().all()
    assert torch.equal(want[1][:11], scales[:11]) and torch.equal(scales.isfinite(), want[1].isfinite())
    assert torch.equal(err, before[0]) and torch.equal(err_s, before[1])
    assert torch.equal(stats, torch.zeros(4))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decompress_sum_matches_reference(ext, bits, out_dtype, monkeypatch):
    """Guards against wrong unpacking, scale offsets, summation order, scaling or casts in
    the fused decompress-and-sum (bit-identical to the reference in every instruction-set
    copy, padding of ``out`` untouched), and against the reference's slicing changing a
    bit (small slices forced)."""
    world, shard = 3, 1700  # not a multiple of the block: padded shards, a partial last block
    layout = ShardLayout(world * shard, world, bits, 256)
    rows = []
    for r in range(world):
        comp = LoCoCompressor(layout.compressed_numel, bits=bits)
        g = torch.randn(layout.compressed_numel, generator=torch.Generator().manual_seed(r)) * (r + 1)
        rows.append(layout.pack(*comp.compress(g))[1])
    recv = torch.stack(rows).contiguous()
    # The whole-shard formula the reference slices: acc = part_0; acc += part_r; *= scale.
    parts = [qz.dequantize_blockwise(*layout.unpack_row(recv[r]), bits, 256, shard) for r in range(world)]
    whole = parts[0].clone()
    for p in parts[1:]:
        whole.add_(p)
    want = torch.full((shard + 5,), 42.0, dtype=out_dtype)
    want[:shard] = whole.mul_(1.0 / world)
    monkeypatch.setattr(collectives, "CHUNK_ELEMENTS", 512)
    ref = want.clone().fill_(42.0)
    decompress_into(recv, layout, ref[:shard], 1.0 / world)
    assert torch.equal(want, ref)
    for isa in ISAS:
        got = want.clone().fill_(42.0)
        cpu_kernels.decompress_sum(recv, layout, got[:shard], 1.0 / world, isa=isa)
        assert torch.equal(want, got), isa


def test_kernel_selection_and_fallback(ext, capsys):
    """Guards against --loco-kernels auto not picking the C++ kernels on CPU, a traceback
    instead of one line for a shape they cannot run, and a missing compiler failing the
    run (it must fall back to torch, printing one line, once)."""
    assert resolve_kernels("auto", "cpu", False, 4, 256, 8, True) == "cpu"
    assert resolve_kernels("cpu", "cpu", False, 2, 264, 8, False) == "cpu"
    assert resolve_kernels("auto", "cpu", False, 4, 256, 32, True) == "torch"  # fp32 error: reference
    for device, block, error_bits, why in [("cpu", 256, 16, "supports the int8 error buffer only"),
                                           ("cpu", 16384, 8, "needs a --loco-block-size"),
                                           ("cuda", 256, 8, "needs a CPU device")]:
        with pytest.raises(ValueError, match=f"^--loco-kernels cpu {why}"):
            resolve_kernels("cpu", device, False, 4, block, error_bits, True)

    def no_compiler():
        raise RuntimeError("Error building extension 'loco_cpu_kernels': c++: not found")

    capsys.readouterr()
    assert resolve_kernels("cpu", "cpu", False, 4, 256, 8, True, cpu_builder=no_compiler) == "torch"
    assert resolve_kernels("auto", "cpu", False, 4, 256, 8, True, cpu_builder=no_compiler) == "torch"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "could not be built" in lines[0] and "torch reference" in lines[0], lines


def test_training_with_cpu_kernels_matches_torch(cache_dir, tmp_path, monkeypatch):
    """Guards against a wiring bug between the C++ kernels and megatron's buckets (2-rank
    training with --loco-kernels cpu must give exactly the torch path's losses: codes,
    scales, error and sums are bit-identical), and against a missing compiler stopping
    training: with CXX pointing nowhere and an empty extensions cache each rank prints the
    fallback line once and trains on the torch path."""
    args = TINY + ["--train-iters", "3", "--lr-decay-iters", "3", "--loco-bits", "4"]
    _, ref = torchrun(2, args + ["--loco-kernels", "torch"], cache_dir, tmp_path, name="torch")
    _, fused = torchrun(2, args + ["--loco-kernels", "cpu"], cache_dir, tmp_path, name="cpu")
    assert train_losses(ref) == train_losses(fused) and sorted(train_losses(ref)) == [1, 2, 3]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    proc, fallback = torchrun(2, args + ["--loco-kernels", "cpu"], cache_dir, tmp_path, name="fallback")
    assert (proc.stdout + proc.stderr).count("C++ CPU kernels could not be built") == 2  # one per rank
    assert train_losses(fallback) == train_losses(ref)


@pytest.mark.parametrize("numel,rows,block", [(5, 4, 8), (300_001, 3, 256), (1001, 2, 256)])
def test_ragged_rows_match_the_reference(ext, numel, rows, block):
    """Guards against the fused kernel reading past a ragged last row (a bucket that does
    not divide by DP without the distributed optimizer) or into the next row: codes and
    scales equal the chunked torch reference's bit for bit, the error within one int8 step,
    and decompressing the last (short) row writes only its prefix."""
    g = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    ref = LoCoCompressor(numel, bits=4, rows=rows, block_size=block, chunk_elements=4096)
    fused = LoCoCompressor(numel, bits=4, rows=rows, block_size=block, kernels="cpu")
    for _ in range(2):
        a, b = ref.compress(g), fused.compress(g)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (ref.error() - fused.error()).abs().max() <= ref.error().abs().max() / 60 + 1e-7
    lay = ShardLayout(numel, rows, 4, block)
    recv = lay.pack(*fused.compress(g)).repeat(1, 1)
    last = lay.row_range(rows - 1)
    want = torch.full((lay.piece,), -1.0)
    got = torch.full((lay.piece,), -1.0)
    decompress_into(recv, lay, want[: last[1] - last[0]])
    cpu_kernels.decompress_sum(recv, lay, got[: last[1] - last[0]])
    assert torch.equal(want, got) and (got[last[1] - last[0]:] == -1.0).all()
