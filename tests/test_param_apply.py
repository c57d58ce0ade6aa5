"""The parameter gather's fused decode-and-apply (C++ ``csrc/param_apply.h`` and the Triton
kernel, interpreted on CPU) vs the torch reference (decode a chunk, then ``add_`` /
``add_delta``), bit for bit, and two-rank training on the fused path vs torch."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from conftest import TINY, torchrun, train_losses
from loco_megatron.loco import cpu_kernels
from loco_megatron.loco.param_delta import AgreedShard, DeltaLayout, encode_delta, row_scales
from loco_megatron.loco.param_gather import apply_gathered
from loco_megatron.loco.quantize import QuantOptions as O

S, W, BLOCK = 1001, 4, 256  # 4 blocks per shard, the last one partial (233 elements)
CHUNK = 512  # 2 blocks per chunk: the own shard's chunk boundaries fall inside the shard

OPTIONS = {  # name -> (bits, options): every decode the gather has, and encodes that differ
    "8bit": (8, O()), "4bit": (4, O()), "2bit-symmetric": (2, O()),
    "2bit-default": (2, O("uniform", "mse", "hadamard", "nearest", seed=5)),
    "2bit-uniform": (2, O("uniform", seed=5)), "2bit-hadamard": (2, O(rotation="hadamard", seed=5)),
    "2bit-mse": (2, O(scale="mse", seed=5)),
    "2bit-default-stochastic": (2, O("uniform", "mse", "hadamard", "stochastic", seed=5)),
    "4bit-uniform-hadamard": (4, O("uniform", rotation="hadamard", seed=5)),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ("moved", "unmoved", "not finite", "partly moved")
"""What each of the W rows is: every block updated; no block (all scales zero); a NaN in
the update (scales zeroed, codes left); blocks 1 and 2 unchanged (zero scales there)."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (torch.equal says -0.0 == 0.0; the apply must keep the sign too)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _gather(bits: int, opts: O, dtype, seed: int = 0):
    """``(agreed [W, S], new [W, S], recv [W, row_bytes])``: agreed parameters holding -0.0 in
    updated and in unchanged blocks, every rank's update (of the kinds in :data:`KINDS`),
    and the gathered rows (torch encode; stochastic rounding keyed per row)."""
    layout = DeltaLayout(S * W, W, bits, BLOCK, options=opts, chunk=CHUNK, stream=3)
    g = torch.Generator().manual_seed(seed)
    agreed = torch.randn(W, S, generator=g).to(dtype)
    agreed[:, :5] = -0.0  # block 0, updated in every moving row
    agreed[:, 260:270] = -0.0  # block 1: zero scales in the unmoved and the partly moved row
    agreed[:, 600] = 0.0
    new = (agreed.float() + 1e-2 * torch.randn(W, S, generator=g)).to(dtype)
    new[:, 3] = -0.0  # d = -0.0 - (-0.0) = +0.0 inside a moving block
    new[1] = agreed[1]  # unmoved
    new[2, 7] = float("nan")  # not finite: its scales are zeroed, its codes stay
    new[3, 256:768] = agreed[3, 256:768]  # partly moved: blocks 1 and 2 unchanged
    recv = torch.stack([encode_delta(new[j], agreed[j], layout, key=layout.noise_key(j, 1)) for j in range(W)])
    return agreed, new, recv


def _apply(kernels: str, bits: int, opts: O, agreed, new, recv, rank: int, aliased: bool, fused=None):
    """One gather's apply on ``kernels`` as :class:`.ParamGatherWork` runs it: the buffer
    holds the agreed shards and, in ``rank``'s row, the update; returns ``(buffer, spare,
    sums, finite)``."""
    layout = DeltaLayout(S * W, W, bits, BLOCK, kernels=kernels, options=opts, chunk=CHUNK, stream=3)
    buffer = agreed.clone().reshape(-1)
    shard = AgreedShard(buffer.view(W, S)[rank], main_aliased=aliased)
    shard.begin_step()
    buffer.view(W, S)[rank].copy_(new[rank])  # the optimizer's update
    sums, finite = apply_gathered(recv, layout, buffer, shard, rank, fused)
    return buffer.view(W, S), shard.spare, sums, finite


def _assert_same(ref, got, tag):
    (buf_a, spare_a, sums_a, fin_a), (buf_b, spare_b, sums_b, fin_b) = ref, got
    for j in range(W):
        assert torch.equal(_bits(buf_a[j]), _bits(buf_b[j])), (tag, j, KINDS[j])
    assert torch.equal(_bits(spare_a), _bits(spare_b)), tag
    assert torch.equal(fin_a, fin_b) and fin_a.tolist() == [True, True, False, True], tag
    # Metrics: another summation order (NaN where the own update is not finite).
    torch.testing.assert_close(sums_a, sums_b, rtol=1e-5, atol=1e-12, equal_nan=True)


@pytest.fixture(scope="module")
def ext(cpu_kernels_built):
    return cpu_kernels_built


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", list(OPTIONS))
def test_cpu_apply_is_the_reference(ext, case, dtype):
    """Guards against the fused C++ apply differing from decode-then-add_ by one bit (ranks
    on different paths, or a resume that switches, would break the agreed parameters):
    for every width and 2-bit option (the rotated ones must be unrotated, a stochastic
    encode changes only the codes), fp32/bf16/fp16 parameters, a partial last block,
    chunk boundaries in the own shard, a row that did not move, one that moved in part,
    and one that is not finite (zeroed scales: not applied); -0.0 parameters in blocks
    with and without a zero scale (-0.0 + +0.0 is +0.0: a zero-scale block skipped
    without looking at its source keeps a -0.0 the reference clears); each row in turn
    the own shard, aliased (fp32 main in the model buffer) and not."""
    bits, opts = OPTIONS[case]
    agreed, new, recv = _gather(bits, opts, dtype)
    for rank in range(W):
        aliased = rank % 2 == 0
        ref = _apply("torch", bits, opts, agreed, new, recv, rank, aliased)
        _assert_same(ref, _apply("cpu", bits, opts, agreed, new, recv, rank, aliased), (case, rank))
        buf = ref[0]
        assert torch.equal(buf[2], agreed[2])  # the non-finite row is not applied (as values)
        assert torch.equal(buf[1], agreed[1])  # the unmoved row neither
        assert torch.equal(_bits(ref[1]), _bits(new[rank] if aliased else buf[rank]))  # spare: exact main or agreed


@pytest.mark.parametrize("isa", [0, 1, 2])
def test_cpu_apply_every_isa_copy(ext, isa):
    """Guards against an instruction-set copy of the apply (baseline, AVX2+FMA, AVX-512: a
    CPU of another kind runs another one) computing other bits - a contracted multiply-add,
    another rounding of the bf16/fp16 cast, a vector tail - in place and for the own
    shard, for the 4-bit scheme and the 2-bit default (rotated), fp32/bf16/fp16."""
    for case in ("4bit", "2bit-default"):
        bits, opts = OPTIONS[case]
        layout = DeltaLayout(S * W, W, bits, BLOCK, kernels="cpu", options=opts, chunk=CHUNK)
        for dtype in DTYPES:
            agreed, new, recv = _gather(bits, opts, dtype, seed=1)
            want = _apply("torch", bits, opts, agreed, new, recv, 0, False)
            scales, _ = row_scales(recv, layout)
            for j in range(1, W):  # in place
                got = agreed[j].clone()
                cpu_kernels.param_apply(recv[j], scales[j], layout, got, got, isa=isa)
                assert torch.equal(_bits(got), _bits(want[0][j])), (case, dtype, j)
            own, spare = new[0].clone(), agreed[0].clone()  # own shard, not aliased: both get the result
            sums = cpu_kernels.param_apply(recv[0], scales[0], layout, spare, own, own, spare, False, isa=isa)
            assert torch.equal(_bits(own), _bits(want[0][0])) and torch.equal(_bits(spare), _bits(want[1]))
            torch.testing.assert_close(torch.tensor(sums, dtype=torch.float64), want[2], rtol=1e-5, atol=1e-12)


def test_cpu_apply_zero_scale_blocks_and_negative_zero(ext):
    """Guards against the zero-scale shortcut changing a result: a block whose scale is
    +0.0 (the symmetric quantiser's unchanged block) decodes to +0.0, which turns a -0.0
    parameter into +0.0 in the reference; one whose scale is -0.0 (the uniform grid's)
    decodes to -0.0 and keeps it; a block with other parameters is left as it was. Also
    out of place (dst != src): a skipped block's values still reach dst."""
    layout = DeltaLayout(3 * 256, 1, 4, 256, kernels="cpu", options=O())
    src = torch.tensor([-0.0, 0.0, 1.5, -2.0] * 192)
    codes = torch.full((layout.code_bytes,), 0x88, dtype=torch.uint8)  # code 0 everywhere
    scales = torch.tensor([0.0, -0.0, 0.0])
    src[512:] = 1.0  # block 2: no -0.0, skipped as is
    got = src.clone()
    cpu_kernels.param_apply(codes, scales, layout, got, got)
    want = src.clone()
    want[:256] += torch.zeros(256)  # + (+0.0): -0.0 -> +0.0
    want[256:512] += torch.full((256,), -0.0)  # + (-0.0): unchanged, -0.0 included
    assert torch.equal(_bits(got), _bits(want))
    assert _bits(got[0]).item() == 0 and _bits(got[256]).item() == _bits(torch.tensor(-0.0)).item()
    out = torch.full_like(src, 7.0)
    cpu_kernels.param_apply(codes, scales, layout, src, out)
    assert torch.equal(_bits(out), _bits(want))


@pytest.fixture(scope="module")
def tk():
    """The Triton kernels, interpreted (conftest sets TRITON_INTERPRET=1 without a GPU)."""
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
    return importlib.import_module("loco_megatron.loco.triton_kernels")


# Every option with fp32; the 16-bit casts with the plain widths and the 2-bit default (the
# interpreter is slow, and the cast does not depend on the option).
TRITON_CASES = [(c, torch.float32) for c in OPTIONS] + [(c, d) for c in ("8bit", "4bit", "2bit-default")
                                                         for d in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("case,dtype", TRITON_CASES, ids=[f"{c}-{str(d)[6:]}" for c, d in TRITON_CASES])
def test_triton_apply_is_the_reference(tk, case, dtype):
    """Guards against the Triton apply (interpreted) differing from the reference by one bit,
    in the cases of :func:`test_cpu_apply_is_the_reference` (every width and 2-bit option,
    fp32/bf16/fp16, partial blocks, chunk boundaries, unmoved, partly moved and
    non-finite rows, -0.0 parameters, each row the own shard, aliased or not), and
    against its encode (the compress kernel without error feedback) giving other codes
    or scales than the torch encode (stochastic rounding keyed alike)."""
    bits, opts = OPTIONS[case]
    agreed, new, recv = _gather(bits, opts, dtype)
    layout = DeltaLayout(S * W, W, bits, BLOCK, kernels="triton", options=opts, chunk=CHUNK, stream=3)
    rows = torch.stack([encode_delta(new[j], agreed[j], layout, key=layout.noise_key(j, 1)) for j in range(W)])
    assert torch.equal(rows, recv), case
    for rank in (0, 3):
        aliased = rank == 0
        ref = _apply("torch", bits, opts, agreed, new, recv, rank, aliased)
        _assert_same(ref, _apply("triton", bits, opts, agreed, new, recv, rank, aliased), (case, rank))


def test_triton_apply_zero_scale_blocks_and_negative_zero(tk):
    """Guards against the Triton kernel's zero-scale shortcut (codes not loaded, nothing
    stored) changing a result: +0.0 scale turns a -0.0 into +0.0 as the reference does,
    -0.0 keeps it, a block without -0.0 stays as it was."""
    layout = DeltaLayout(3 * 256, 1, 4, 256, kernels="triton", options=O())
    src = torch.tensor([-0.0, 0.0, 1.5, -2.0] * 192)
    src[512:] = 1.0
    codes = torch.full((layout.code_bytes,), 0x88, dtype=torch.uint8)
    got = src.clone()
    tk.param_apply(codes, torch.tensor([0.0, -0.0, 0.0]), layout, got, got)
    want = torch.cat([src[:256] + torch.zeros(256), src[256:512] + torch.full((256,), -0.0), src[512:]])
    assert torch.equal(_bits(got), _bits(want))


_TRAIN = TINY + ["--train-iters", "4", "--lr-decay-iters", "4", "--param-gather-bits", "4"]


@pytest.mark.parametrize("extra", [["--loco-bits", "4"], ["--loco-bits", "4", "--bf16"]], ids=["fp32", "bf16"])
def test_training_on_the_fused_apply_matches_torch(cache_dir, tmp_path, extra, cpu_kernels_built):
    """Guards against a wiring bug between the fused C++ apply and the gather (the own
    shard's spare and model copy, the other shards in place, the metric norms): 2-rank
    training with --param-gather-bits 4 on --loco-kernels cpu gives exactly the torch
    path's losses and parameter error metric, for fp32 (main weights aliased) and bf16
    (separate fp32 main weights), and the start-up line names the fused kernels."""
    args = _TRAIN + extra
    _, ref = torchrun(2, args + ["--loco-kernels", "torch"], cache_dir, tmp_path, name="torch")
    proc, fused = torchrun(2, args + ["--loco-kernels", "cpu"], cache_dir, tmp_path, name="cpu")
    assert "kernels: grads cpu, params cpu (4-bit symmetric/absmax/none/nearest)" in proc.stdout
    assert train_losses(ref) == train_losses(fused) and sorted(train_losses(ref)) == [1, 2, 3, 4]
    err = [[m["loco/param_rel_error"] for m in run if "loco/param_rel_error" in m] for run in (ref, fused)]
    assert len(err[0]) == len(err[1]) > 0
    assert err[1] == pytest.approx(err[0], rel=1e-4)


def test_training_on_the_triton_apply_matches_torch(cache_dir, tmp_path, monkeypatch):
    """Guards against a wiring bug between the Triton parameter gather (encode and apply,
    interpreted) and megatron's buckets: 2-rank training with only the parameters
    compressed (--loco-bits 0 --param-gather-bits 4) on --loco-kernels triton gives
    exactly the torch path's losses, and the start-up line says params triton."""
    args = TINY + ["--train-iters", "3", "--lr-decay-iters", "3", "--param-gather-bits", "4"]
    _, ref = torchrun(2, args + ["--loco-kernels", "torch"], cache_dir, tmp_path, name="torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    proc, fused = torchrun(2, args + ["--loco-kernels", "triton"], cache_dir, tmp_path, name="triton")
    assert "params triton (4-bit symmetric/absmax/none/nearest)" in proc.stdout
    assert train_losses(ref) == train_losses(fused) and sorted(train_losses(ref)) == [1, 2, 3]
