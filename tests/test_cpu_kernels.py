"""Fused C++ CPU kernels (``loco/cpu_kernels.py``, ``loco/csrc/loco_cpu.cpp``) vs the torch
reference. The extension is built once per machine (torch's extensions cache) and loaded
once per test session; see ``benchmarks/kernels.py`` for its speed."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from conftest import REPO, TINY, torchrun, train_losses
from loco_helpers import resolve_kernels
from loco_megatron.loco import collectives, cpu_kernels
from loco_megatron.loco import quantize as qz
from loco_megatron.loco.collectives import ShardLayout, decompress_into
from loco_megatron.loco.compressor import LoCoCompressor
from loco_megatron.loco.kernel_choice import choose_kernels, kernels_line
from test_triton_kernels import _inputs


@pytest.fixture(scope="module")
def ext(cpu_kernels_built):
    return cpu_kernels_built


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
    instead of one line for a shape they cannot run, a missing compiler failing the run
    (it must fall back to torch, printing one line, once), and the start-up kernels line
    misnaming what runs or not saying why torch does."""
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
    assert choose_kernels("auto", "cpu", False, 4, 256, 8, True, cpu_builder=no_compiler) == \
        ("torch", "the C++ CPU kernels could not be built")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "could not be built" in lines[0] and "torch reference" in lines[0], lines
    # the start-up line names what runs, and why torch does where a fused path might have
    assert kernels_line("cpu", True, 4, None) == "kernels: grads cpu, params cpu"
    assert kernels_line("cpu", False, 0, None) == \
        "kernels: grads off (megatron's reduce-scatter), params off (megatron's all-gather)"
    assert choose_kernels("auto", "cpu", False, 4, 16384, 8, True) == \
        ("torch", "--loco-kernels cpu needs a --loco-block-size that is a multiple of 8 up to 8192, got 16384")


def test_training_with_cpu_kernels_matches_torch(cache_dir, tmp_path, monkeypatch, cpu_kernels_built):
    """Guards against a wiring bug between the C++ kernels and megatron's buckets (2-rank
    training with --loco-kernels cpu must give exactly the torch path's losses: codes,
    scales, error and sums are bit-identical), and against a missing compiler stopping
    training: with CXX pointing nowhere and an empty extensions cache each rank prints the
    fallback line once, the start-up line says torch runs and why, and it trains on the
    torch path; rank 0 announces the (first-use) build before trying it."""
    args = TINY + ["--train-iters", "3", "--lr-decay-iters", "3", "--loco-bits", "4"]
    _, ref = torchrun(2, args + ["--loco-kernels", "torch"], cache_dir, tmp_path, name="torch")
    _, fused = torchrun(2, args + ["--loco-kernels", "cpu"], cache_dir, tmp_path, name="cpu")
    assert train_losses(ref) == train_losses(fused) and sorted(train_losses(ref)) == [1, 2, 3]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    proc, fallback = torchrun(2, args + ["--loco-kernels", "cpu"], cache_dir, tmp_path, name="fallback")
    both = proc.stdout + proc.stderr
    assert both.count("loco: the C++ CPU kernels could not be built") == 2  # one per rank
    assert proc.stdout.count("building LoCo's C++ CPU kernels (first use only") == 1  # rank 0, before the try
    assert proc.stdout.count("kernels: grads torch, params off (megatron's all-gather); torch because the C++ "
                             "CPU kernels could not be built") == 1  # rank 0's start-up line
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


# -- quantiser options (uniform grid, mse scale, Hadamard rotation, stochastic rounding) --
EVERY = [qz.QuantOptions(q, s, r, rd, seed=3) for q in qz.QUANTIZERS for s in qz.SCALES
         for r in qz.ROTATIONS for rd in qz.ROUNDINGS]
TWO_BIT = qz.QuantOptions("uniform", "mse", "hadamard", "nearest")
"""The --loco-bits 2 default (config.loco.LOCO_DEFAULT_OPTIONS)."""


def _name(o: qz.QuantOptions) -> str:
    return "/".join((o.quantizer, o.scale, o.rotation, o.rounding))


def _assert_exact(ref: LoCoCompressor, want, got, err, err_s, tag):
    """Codes, scales (NaN where the reference has NaN) and the stored error bit for bit."""
    (ca, sa), (cb, sb) = want, got[:2]
    assert torch.equal(ca, cb), tag
    assert torch.equal(sa.isnan(), sb.isnan()) and torch.equal(sa.nan_to_num(), sb.nan_to_num()), tag
    sd = ref.state_dict()
    assert torch.equal(sd["error"], err) and torch.equal(sd["error_scales"], err_s), tag


@pytest.mark.parametrize("opts", EVERY, ids=_name)
def test_options_compress_matches_reference(ext, opts):
    """Guards against any divergence of the fused compress from the reference for every
    combination of quantiser options (signed uniform scale and its tie rule, the mse search
    and its summation order, the rotation's butterflies and scaling, the rotated error
    re-read, the stochastic-rounding hash and its key): codes, scales and the stored error
    bit-identical over steps, for 2, 4 and 8 bits, a size off the block grid, zero and
    denormal blocks, 3e38 and exact ties, in every instruction-set copy and both schemes."""
    n = 2567
    nb = qz.num_blocks(n, 256)
    for i, bits in enumerate((2, 4, 8)):
        for j, kind in enumerate(("random", "adversarial", "ties")):
            isa, one_pass = ISAS[(i + j) % 3], (i + j) % 2 == 0
            ref = LoCoCompressor(n, bits=bits, options=opts, stream=5)
            err, err_s = _state(n, nb)
            scratch = (torch.empty_like(err), torch.empty_like(err_s)) if one_pass else (None, None)
            for step in range(2):
                g = _inputs(n, step)[kind]
                want = ref.compress(g)
                got = cpu_kernels.compress(g, err, err_s, 0.8, bits, 256, n, *scratch, isa=isa, options=opts,
                                           key=qz.noise_key(opts.seed, 5, step))
                _assert_exact(ref, want, got, err, err_s, (bits, kind, step))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_options_non_finite_gradient(ext, bad):
    """Guards against a NaN/Inf entering the (rotated) error or being hidden by the mse
    search or the signed uniform scale: the whole error stays as it was, the scales carry
    the overflow exactly where the reference's do, codes equal, metrics zero."""
    opts = dataclasses.replace(TWO_BIT, rounding="stochastic")
    n = 4096
    ref = LoCoCompressor(n, bits=2, options=opts)
    fused = LoCoCompressor(n, bits=2, options=opts, kernels="cpu")
    g = torch.randn(n)
    for step in range(2):
        if step:
            g[3000] = bad
        before = fused.state_dict()["error"].clone()
        want, got = ref.compress(g), fused.compress(g)
        _assert_exact(ref, want, got, fused.error_buffer.values, fused.error_buffer.scales, step)
    assert not want[1].isfinite().all() and torch.equal(fused.error_buffer.values, before)
    assert torch.equal(fused.last_stats, torch.zeros(4))


@pytest.mark.parametrize("opts", [TWO_BIT, qz.QuantOptions("uniform", "mse", "none", "stochastic", seed=1)], ids=_name)
@pytest.mark.parametrize("numel,rows,block", [(5, 4, 16), (3001, 3, 64), (9001, 2, 2048), (1001, 2, 24),
                                              (41, 2, 8), (1001, 3, 256)])
def test_options_rows_blocks_and_decompress(ext, opts, numel, rows, block):
    """Guards against the options path mishandling rows (ragged last row, padding), block
    sizes (the 8-element butterflies alone with the signs and scale fused in, and with
    more passes, long blocks, the tree sum of a non-power-of-two block, the 2-bit copy
    compiled for 256-element blocks with partial blocks at the rows' ends), the chunked two-pass reference disagreeing with the one-pass kernel, and the
    fused decompress-and-sum not unrotating (or unrotating after the scaling): compress
    and then decompress every rank's shard bit-identically to the reference."""
    if opts.rotation == "hadamard" and block & (block - 1):
        opts = dataclasses.replace(opts, rotation="none")
    world = rows
    bits = 2 if block % 16 == 0 else 4  # the wire's fp32 scales need 4-byte aligned code rows
    lay = ShardLayout(numel, world, bits, block, options=opts)
    rows_sent = []
    for r in range(world):
        g = torch.randn(numel, generator=torch.Generator().manual_seed(r)) * (r + 1)
        ref = LoCoCompressor(**lay.compressor_shape(), bits=bits, block_size=block, chunk_elements=4 * block,
                             options=opts, stream=r)
        fused = LoCoCompressor(**lay.compressor_shape(), bits=bits, block_size=block, kernels="cpu", options=opts,
                               stream=r)
        for step in range(2):
            want = ref.compress(g)
            got = fused.compress(g)
            _assert_exact(ref, want, got, fused.error_buffer.values, fused.error_buffer.scales, (r, step))
        rows_sent.append(lay.pack(*got))
    for j in range(world):
        recv = torch.stack([s[j] for s in rows_sent]).contiguous()
        a, b = lay.row_range(j)
        for out_dtype in (torch.float32, torch.bfloat16):
            want = torch.full((lay.piece + 3,), 42.0, dtype=out_dtype)
            got = want.clone()
            decompress_into(recv, lay, want[: b - a], 1.0 / world)
            cpu_kernels.decompress_sum(recv, lay, got[: b - a], 1.0 / world, isa=ISAS[j % 3])
            assert torch.equal(want, got), (j, out_dtype)


def test_two_hop_layouts_with_the_two_bit_default(ext):
    """Guards against the fused kernels breaking two-hop LoCo's layouts (hop 1: rows grouped
    by local rank, pieces = nodes; hop 2: padded shards): compress and decompress-and-sum
    of both hops with the 2-bit default equal the reference bit for bit."""
    from loco_megatron.loco.two_hop import TwoHopLayout

    lay = TwoHopLayout(5000, nodes=2, per_node=2, intra_bits=2, inter_bits=2, block_size=256, options=TWO_BIT)
    for hop in (lay.intra, lay.inter):
        sent = []
        for r in range(hop.world):
            g = torch.randn(hop.numel, generator=torch.Generator().manual_seed(r))
            ref = LoCoCompressor(**hop.compressor_shape(), bits=2, options=TWO_BIT, stream=r)
            fused = LoCoCompressor(**hop.compressor_shape(), bits=2, options=TWO_BIT, kernels="cpu", stream=r)
            want, got = ref.compress(g), fused.compress(g)
            _assert_exact(ref, want, got, fused.error_buffer.values, fused.error_buffer.scales, r)
            sent.append(hop.pack(*got))
        recv = torch.stack([s[0] for s in sent]).contiguous()
        want, got = torch.empty(hop.shard), torch.empty(hop.shard)
        decompress_into(recv, hop, want, 0.5)
        cpu_kernels.decompress_sum(recv, hop, got, 0.5)
        assert torch.equal(want, got)


def test_training_two_bit_default_on_cpu_kernels_matches_torch(cache_dir, tmp_path, cpu_kernels_built):
    """Guards against the 2-bit default (uniform/mse/hadamard) silently running on torch
    under --loco-kernels auto, or its fused path differing from the reference in training:
    2 ranks, auto picks the C++ kernels (named on the start-up line) and the losses equal
    the torch path's exactly."""
    args = TINY + ["--train-iters", "3", "--lr-decay-iters", "3", "--loco-bits", "2"]
    _, ref = torchrun(2, args + ["--loco-kernels", "torch"], cache_dir, tmp_path, name="torch")
    proc, fused = torchrun(2, args, cache_dir, tmp_path, name="auto")
    assert "kernels: grads cpu, params off (megatron's all-gather)" in proc.stdout
    assert train_losses(ref) == train_losses(fused) and sorted(train_losses(ref)) == [1, 2, 3]


@pytest.mark.parametrize("ef", [True, False])
def test_options_bf16_gradient_and_no_error_feedback(ext, ef):
    """Guards against the options path misreading a bf16 gradient or touching an error
    buffer the ablation does not have: bf16 in, the 2-bit default with stochastic rounding,
    codes, scales (and the error) bit-identical to the reference over steps."""
    opts = dataclasses.replace(TWO_BIT, rounding="stochastic", seed=9)
    ref = LoCoCompressor(3000, bits=2, error_feedback=ef, options=opts, stream=2)
    fused = LoCoCompressor(3000, bits=2, error_feedback=ef, options=opts, stream=2, kernels="cpu")
    for step in range(3):
        g = torch.randn(3000, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        a, b = ref.compress(g), fused.compress(g)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), step
    if ef:
        assert torch.equal(ref.state_dict()["error"], fused.state_dict()["error"])
    torch.testing.assert_close(ref.last_stats, fused.last_stats, rtol=1e-4, atol=0)


_KILLED_BUILD = """
import os, pathlib, signal, sys
from torch.utils.file_baton import FileBaton
from loco_megatron.loco import cpu_kernels
build_dir = pathlib.Path(sys.argv[1])
with cpu_kernels.build_lock(build_dir):
    assert FileBaton(str(build_dir / "lock")).try_acquire()  # torch's own lock, as its build takes it
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-build: torch's lock file stays behind
"""

_LOAD = """
import pathlib, sys
from torch.utils import cpp_extension
from loco_megatron.loco import cpu_kernels
build_dir = pathlib.Path(sys.argv[1])
with cpu_kernels.build_lock(build_dir):
    cpp_extension.load(name="tiny", sources=[sys.argv[2]], build_directory=str(build_dir),
                       is_python_module=False)
print("loaded")
"""


def test_a_killed_build_does_not_hang_later_starts(tmp_path):
    """Guards against a first build of the C++ kernels that was killed (Ctrl-C, a job time
    limit) leaving torch's build lock file behind, so that every later start waits on it
    forever: a process killed while holding the lock, then a real torch extension build in
    the same folder completes, printing one line that says it removed the stale lock; a
    second load, with no stale lock, prints nothing about it."""
    import subprocess
    import sys

    build_dir = tmp_path / "ext"
    src = tmp_path / "tiny.cpp"
    src.write_text('extern "C" int loco_tiny() { return 1; }\n')
    killed = subprocess.run([sys.executable, "-c", _KILLED_BUILD, str(build_dir)], capture_output=True, text=True,
                            timeout=120)
    assert killed.returncode == -9 and (build_dir / "lock").exists(), killed.stderr
    for stale in (True, False):
        proc = subprocess.run([sys.executable, "-c", _LOAD, str(build_dir), str(src)], capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-2000:]
        removed = [ln for ln in proc.stderr.splitlines() if "build lock left by an interrupted build" in ln]
        assert len(removed) == (1 if stale else 0), proc.stderr
        assert not (build_dir / "lock").exists()


def test_the_avx512_unit_is_built_only_for_a_cpu_that_has_it(tmp_path):
    """Guards against the build leaving out the AVX-512 copy on a CPU that has it (a slower
    kernel), compiling it where it can never run (a third of the build time for nothing), or
    two kinds of CPU sharing one extensions folder with one build: the flag that says which
    copies are compiled is in the compiler flags, and so in the build folder's key."""
    def info(flags: str) -> str:
        path = tmp_path / f"cpuinfo{len(flags)}"
        path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
        return str(path)

    assert cpu_kernels.max_isa(info("fpu sse2 avx2 fma")) == 1
    assert cpu_kernels.max_isa(info("fpu avx2 fma avx512f avx512bw avx512vl")) == 1  # no avx512dq
    assert cpu_kernels.max_isa(info("fpu avx2 fma avx512f avx512bw avx512vl avx512dq")) == 2
    assert cpu_kernels.max_isa(str(tmp_path / "absent")) == 2  # not asked: every copy
    here = cpu_kernels.max_isa()
    assert ("isa_avx512.cpp" in [f.name for f in cpu_kernels.units()]) == (here == 2)
    assert f"-DLOCO_MAX_ISA={here}" in cpu_kernels.cflags()
    ext = cpu_kernels.extension()
    assert ext is not None and ext.isa() <= here


OTHER_NINJA = """#!/bin/sh
# Another ninja first on PATH (the system's 1.11, as a launch by absolute path finds it):
# records each call; answers the version check, fails a build.
echo "$@" >> {record}
case "$1" in --version) echo 1.11.1; exit 0;; esac
exit 1
"""


def _other_ninja_first(tmp_path, monkeypatch) -> pathlib.Path:
    """PATH with :data:`OTHER_NINJA` first and without this interpreter's folder (a launch by
    absolute path); returns the file its calls go to (absent until one is made)."""
    import os
    import sys

    record = tmp_path / "other_ninja_calls"
    fake = tmp_path / "other_bin" / "ninja"
    fake.parent.mkdir()
    fake.write_text(OTHER_NINJA.format(record=record))
    fake.chmod(0o755)
    here = os.path.dirname(sys.executable)
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != here]
    monkeypatch.setenv("PATH", os.pathsep.join([str(fake.parent), *rest]))
    return record


def _build_files() -> list[tuple[str, bytes, int]]:
    """This session's build: ninja's log and the module (name, bytes, mtime), and the build
    mark's contents (every load rewrites it)."""
    folder = cpu_kernels.build_directory()
    files = [folder / ".ninja_log", folder / f"{cpu_kernels.NAME}.so"]
    mark = folder / cpu_kernels.BUILT_MARK
    return [(f.name, f.read_bytes(), f.stat().st_mtime_ns) for f in files] + [(mark.name, mark.read_bytes(), 0)]


_FRESH_LOAD = """
import os
from loco_megatron.loco import cpu_kernels
path = os.environ["PATH"]
assert not cpu_kernels.needs_build()
assert cpu_kernels._build_with_torch() is not None
print(cpu_kernels.pinned_ninja()[0], os.environ["PATH"] == path)
"""


def test_the_build_runs_the_pinned_ninja_whatever_is_first_on_path(ext, tmp_path, monkeypatch):
    """Guards against the build (and every process's first load, which runs ninja too)
    running whichever ninja is first on PATH: another version takes the build's
    ``.ninja_log`` for changed commands and rebuilds every unit. With another ninja first,
    a fresh process's load runs the ``ninja`` package's (next to the interpreter), rebuilds
    nothing, never calls the other one (ninja's log and the module untouched), and leaves
    that process's PATH as it was."""
    import os
    import subprocess
    import sys

    import ninja

    record = _other_ninja_first(tmp_path, monkeypatch)
    before = _build_files()
    proc = subprocess.run([sys.executable, "-c", _FRESH_LOAD], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == f"{os.path.join(ninja.BIN_DIR, 'ninja')} True\n", proc.stdout
    assert not record.exists(), record.read_text()
    assert _build_files() == before


def test_a_launch_by_absolute_path_trains_on_the_kernels_without_building(cache_dir, tmp_path, monkeypatch, ext):
    """Guards against two kinds of launch rebuilding each other's C++ kernels in the
    foreground: a venv's torchrun started by absolute path got the system's ninja, the
    same run with the venv's bin on PATH the pinned one, each took the other's build for
    changed commands, and ``auto`` (whose build mark said built) waited for the rebuild
    (14 minutes at an elastic replica's start). After this session's build, a 2-rank
    ``auto`` run launched by absolute path with another ninja first on PATH trains on the
    kernels at once: that ninja never runs, ninja's log, the module and the build mark's
    ninja are untouched, no build is announced."""
    record = _other_ninja_first(tmp_path, monkeypatch)
    before = _build_files()
    args = TINY + ["--train-iters", "3", "--lr-decay-iters", "3", "--loco-bits", "4", "--loco-kernels", "auto"]
    proc, metrics = torchrun(2, args, cache_dir, tmp_path, name="absolute", plain=True)
    assert proc.stdout.count(kernels_line("cpu", True, 0, None) + "\n") == 1, proc.stdout
    building = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "building" in ln and "C++" in ln]
    assert building == [] and sorted(train_losses(metrics)) == [1, 2, 3], building
    assert not record.exists(), record.read_text()
    assert _build_files() == before
