"""Weight-difference parameter all-gather: the pure maths in one process, the collective
on 3 real gloo ranks against plain torch collectives."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from loco_helpers import decode_rows, finish_shard
from loco_megatron.loco.param_delta import DECODE_CHUNK, AgreedShard, DeltaLayout, add_delta, encode_delta
from loco_megatron.loco.param_gather import ParamGatherWork, compressed_param_all_gather
from loco_megatron.metrics.comm import WallClock
from loco_megatron.loco.quantize import QuantOptions, dequantize_blockwise, quantize_blockwise
from conftest import free_port

TWO_BIT = QuantOptions("uniform", "mse", "hadamard", "nearest", seed=5)  # the 2-bit defaults

WORLD, SHARD = 3, 700  # shards not a multiple of the block: padding is exercised


def _new(step: int, j: int, agreed: torch.Tensor, nan_at: tuple) -> torch.Tensor:
    """Rank j's updated shard at ``step`` (every rank can compute every rank's)."""
    g = torch.Generator().manual_seed(1000 * step + j)
    out = agreed + 1e-2 * torch.randn(agreed.shape, generator=g)
    if (step, j) == nan_at:
        out[5] = float("nan")
    return out


def test_roundtrip_is_the_blockwise_quantiser_of_the_difference():
    """Guards against a wire format that does not decode to LoCo's quantiser of d = new -
    agreed (scales at the wrong offset, padding applied to the wrong side)."""
    layout = DeltaLayout(WORLD * SHARD, WORLD, 4, 256)
    agreed, new = torch.randn(SHARD), torch.randn(SHARD)
    rows = torch.stack([encode_delta(new, agreed, layout)] * WORLD)
    assert rows.shape[1] == layout.row_bytes == 3 * 256 // 2 + 3 * 4
    deltas, finite = decode_rows(rows, layout)
    codes, scales = quantize_blockwise(new - agreed, 4, 256)
    assert torch.equal(deltas[1], dequantize_blockwise(codes, scales, 4, 256, SHARD)) and finite.all()
    # Error is one rounding of the difference: at most half a step of each block's scale.
    assert ((add_delta(agreed, deltas[0]) - new).abs().max() <= scales.max() * 0.5 + 1e-6)


def test_aliased_shard_swaps_main_in_for_the_step_and_back_on_skip():
    """Guards against the optimizer stepping the agreed weights instead of the exact fp32
    main weights (fp32 models, where main params are the model buffer), and against a
    skipped step leaving main weights where the model expects agreed ones."""
    own = torch.tensor([1.0, 2.0])
    s = AgreedShard(own, main_aliased=True)
    s.spare.copy_(torch.tensor([1.5, 2.5]))  # exact main differs from agreed
    s.begin_step()
    assert own.tolist() == [1.5, 2.5] and s.agreed().tolist() == [1.0, 2.0]
    s.cancel_step()
    assert own.tolist() == [1.0, 2.0] and s.spare.tolist() == [1.5, 2.5] and not s.pending
    s.begin_step()
    own += 1  # the optimizer step
    finish_shard(s, torch.tensor([2.4, 3.4]))
    assert own.tolist() == pytest.approx([2.4, 3.4]) and s.spare.tolist() == [2.5, 3.5]
    restored = AgreedShard(own.clone(), main_aliased=True)
    restored.load_state_dict(s.state_dict())
    assert torch.equal(restored.spare, s.spare)



def _options(bits: int) -> QuantOptions:
    return TWO_BIT if bits == 2 else QuantOptions()


def _worker(rank, port, bits, aliased, nan_at, queue, collected):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        layout = DeltaLayout(WORLD * SHARD, WORLD, bits, 256, options=_options(bits))
        buffer = torch.randn(WORLD * SHARD, generator=torch.Generator().manual_seed(7))  # same on all ranks
        rows = buffer.view(WORLD, SHARD)
        shard = AgreedShard(rows[rank], main_aliased=aliased)
        expected = rows.clone()  # agreed params, computed from every rank's update locally
        results = []
        for step in range(3):
            shard.begin_step()
            rows[rank].copy_(_new(step, rank, shard.agreed(), nan_at))  # the "optimizer step"
            news = [_new(step, j, expected[j], nan_at) for j in range(WORLD)]
            work, nbytes = compressed_param_all_gather(buffer, shard, layout, None, async_op=True)
            work.wait()
            for j in range(WORLD):
                d = news[j] - expected[j]
                if torch.isfinite(d).all():
                    codes, scales = quantize_blockwise(d, bits, 256, _options(bits))
                    expected[j] = expected[j] + dequantize_blockwise(codes, scales, bits, 256, SHARD, _options(bits))
            everyone = [torch.empty_like(buffer) for _ in range(WORLD)]
            dist.all_gather(everyone, buffer.clone())  # plain torch collective
            results.append((buffer.clone(), expected.reshape(-1).clone(), everyone, work.stats.clone(),
                            shard.spare.clone(), news[rank], nbytes))
        queue.put((rank, results))
        collected.wait(timeout=120)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bits,aliased,nan_at", [(4, True, (1, 1)), (8, False, (-1, -1)), (2, False, (2, 0))],
                         ids=["4bit-aliased-nan", "8bit", "2bit-options-nan"])
def test_gather_gives_identical_agreed_params_on_every_rank(bits, aliased, nan_at):
    """Guards against ranks drifting apart (the owner applying its exact update instead of
    the quantised one), against quantisation error accumulating across steps (d not taken
    against the agreed params), and against a NaN update reaching the agreed params. At
    2 bits with the rotation: a decode that does not unrotate (deltas in the Hadamard
    domain) misses the reference and the error bound."""
    ctx = mp.get_context("spawn")
    queue, collected = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, bits, aliased, nan_at, queue, collected))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        out = dict(queue.get(timeout=240) for _ in range(WORLD))
    finally:
        collected.set()
        for p in procs:
            p.join(timeout=60)
    layout = DeltaLayout(WORLD * SHARD, WORLD, bits, 256, options=_options(bits))
    assert layout.row_bytes == 3 * 256 * bits // 8 + 3 * 4  # codes + one fp32 scale per block
    for rank, results in out.items():
        for step, (buf, expected, everyone, stats, spare, new_own, nbytes) in enumerate(results):
            assert torch.equal(buf, expected), (rank, step)
            assert all(torch.equal(e, buf) for e in everyone), (rank, step)
            assert torch.isfinite(buf).all()
            assert nbytes == layout.gathered_bytes
            assert stats[2].item() == (1 if step == nan_at[0] else 0)
            if aliased:  # the exact update is kept for the optimizer
                torch.testing.assert_close(spare, new_own, rtol=0, atol=0, equal_nan=True)
            else:
                assert torch.equal(spare, buf.view(WORLD, SHARD)[rank])
            if (step, rank) != nan_at:  # bounded: one rounding of one step's difference
                rel = stats[0].sqrt() / stats[1].sqrt()
                assert 0 < rel < (0.001 if bits == 8 else 0.01), (rank, step, rel)


def test_withheld_non_finite_update_fails_loudly():
    """Guards against a non-finite update being withheld silently (training would go on
    with main weights that can never be gathered again)."""
    from loco_megatron.loco.hooks.param_sync import NonFiniteParamUpdate, ParamGatherHook

    ParamGatherHook.check_finite(0.0, 7)
    with pytest.raises(NonFiniteParamUpdate, match="--param-gather-bits: .*iteration 7"):
        ParamGatherHook.check_finite(2.0, 7)


_KERNEL_CASES = [(8, QuantOptions()), (4, QuantOptions()), (2, TWO_BIT),
                 (2, QuantOptions("uniform", "mse", "hadamard", "stochastic", seed=5)),
                 (2, QuantOptions("symmetric", "absmax", "none", "stochastic", seed=5))]


def test_cpu_kernels_encode_and_decode_bit_identical(cpu_kernels_built):
    """Guards against the fused C++ path of the parameter all-gather (used on CPU) differing
    from the reference by a single bit: ranks mixing the two, or a resume switching
    between them, would break the agreed-parameter invariant. Covers a ragged last block,
    8, 4 and 2 bits (the 2-bit options, stochastic rounding keyed alike on both paths),
    and a non-finite shard (its delta must be exactly zero)."""
    for bits, opts in _KERNEL_CASES:
        ref = DeltaLayout(3 * 1001, 3, bits, 256, options=opts, stream=9)
        fast = DeltaLayout(3 * 1001, 3, bits, 256, kernels="cpu", options=opts, stream=9)
        g = torch.Generator().manual_seed(bits)
        new, agreed = torch.randn(1001, generator=g), torch.randn(1001, generator=g)
        key = ref.noise_key(1, 4)
        stochastic = opts.rounding == "stochastic"
        assert (key != 0) == stochastic and (key != ref.noise_key(1, 5)) == stochastic
        row_ref, row_fast = encode_delta(new, agreed, ref, key=key), encode_delta(new, agreed, fast, key=key)
        assert torch.equal(row_ref, row_fast), (bits, opts)
        if stochastic:  # the key is used: another gather rounds otherwise
            assert not torch.equal(row_ref, encode_delta(new, agreed, ref, key=ref.noise_key(1, 5)))
        bad = encode_delta(torch.full((1001,), float("nan")), agreed, ref)
        rows = torch.stack([row_ref, bad, row_ref * 0 + row_ref])
        (d_ref, f_ref), (d_fast, f_fast) = decode_rows(rows, ref), decode_rows(rows, fast)
        assert torch.equal(d_ref, d_fast) and torch.equal(f_ref, f_fast)
        assert f_ref.tolist() == [True, False, True] and (d_fast[1] == 0).all()
        # The decode is in the parameter domain (unrotated): close to d at every width
        # (stochastic rounding at 2 bits trades variance for no bias: only bounded).
        rel = ((d_ref[0] - (new - agreed)).norm() / (new - agreed).norm()).item()
        assert rel < (1.5 if stochastic else {8: 0.01, 4: 0.15, 2: 0.6}[bits]), (bits, opts, rel)



class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor storage an op creates (views and in-place results of an
    input share its storage and are not counted)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _largest_temporary(shard: int, kernels: str) -> int:
    """Largest allocation of one 2-rank gather's encode and decode (``shard`` elements per
    rank, bf16), after checking the decoded values against the whole-bucket reference."""
    layout = DeltaLayout(2 * shard, 2, 4, 256, kernels=kernels)
    g = torch.Generator().manual_seed(shard)
    buffer = torch.randn(2 * shard, generator=g).to(torch.bfloat16)
    mine = AgreedShard(buffer[:shard], main_aliased=False)
    buffer[:shard] += (0.01 * torch.randn(shard, generator=g)).to(torch.bfloat16)  # the "optimizer step"
    other = buffer[shard:] + (0.01 * torch.randn(shard, generator=g)).to(torch.bfloat16)
    send = torch.empty(layout.row_bytes, dtype=torch.uint8)  # the wire row itself is not a temporary
    with _LargestAllocation() as mode:
        encode_delta(buffer[:shard], mine.agreed(), layout, out=send)
    recv = torch.cat([send, encode_delta(other, buffer[shard:], layout)])
    deltas, _ = decode_rows(recv.view(2, -1), layout)
    expected = torch.cat([add_delta(mine.agreed(), deltas[0]), add_delta(buffer[shard:], deltas[1])])
    work = ParamGatherWork(None, send, recv, layout, buffer, mine, 0, WallClock(), (0.0, 0.0))
    with mode:
        work.wait()
    assert torch.equal(buffer, expected) and torch.equal(mine.spare, expected[:shard])
    return mode.largest


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_gather_temporaries_do_not_grow_with_the_bucket(kernels):
    """Guards against the unchunked decode of issue 21 (6-11 bytes per parameter of
    transient memory: fp32 deltas of the whole [W, S] bucket, int8 unpack temporaries and
    float64 statistics; 340 MiB for a 32M-element bucket): the largest temporary of an
    encode plus decode is the same for a 4x larger bucket, and within one chunk's float64
    term (8 bytes per element of DECODE_CHUNK)."""
    small, big = _largest_temporary(1 << 19, kernels), _largest_temporary(1 << 21, kernels)
    assert small == big <= 8 * DECODE_CHUNK, (small, big)


def test_fp32_exchange_swaps_without_a_whole_shard_temporary():
    """Guards against the aliased (fp32) begin_step/cancel_step swapping the agreed and the
    exact main shard through a whole-shard clone (S elements more at every step, a whole
    pipeline stage's shard with one bucket): the swap is exact both ways and its largest
    temporary is one chunk, whatever the shard."""
    shard = 2 * DECODE_CHUNK + 77  # ragged last chunk
    g = torch.Generator().manual_seed(3)
    own = torch.randn(shard, generator=g)
    mine = AgreedShard(own, main_aliased=True)
    mine.spare.add_(1.0)  # the exact main shard differs from the agreed one
    agreed, main = own.clone(), mine.spare.clone()
    with _LargestAllocation() as mode:
        mine.begin_step()
    assert torch.equal(own, main) and torch.equal(mine.agreed(), agreed)
    with mode:
        mine.cancel_step()
    assert torch.equal(own, agreed) and torch.equal(mine.spare, main)
    assert 0 < mode.largest <= 4 * DECODE_CHUNK, mode.largest


@pytest.mark.parametrize("kernels,bits", [("torch", 4), ("cpu", 4), ("torch", 2), ("cpu", 2)])
def test_chunking_changes_no_bit(kernels, bits):
    """Guards against the chunked encode/decode (issue 21's bounded transient memory)
    differing from a one-pass one: codes, scales and deltas are per block, so slicing the
    shard into chunks of one block or of many gives the same row and the same deltas
    (a ragged last block and a non-finite row included; at 2 bits the Hadamard rotation,
    whose blocks must not straddle chunks)."""
    g = torch.Generator().manual_seed(3)
    new, agreed = torch.randn(3000, generator=g), torch.randn(3000, generator=g)
    opts = _options(bits)
    one = DeltaLayout(2 * 3000, 2, bits, 256, kernels=kernels, chunk=1 << 20, options=opts)
    many = DeltaLayout(2 * 3000, 2, bits, 256, kernels=kernels, chunk=256, options=opts)
    assert one.chunk_blocks >= one.blocks and many.chunk_blocks == 1
    row = encode_delta(new, agreed, one)
    assert torch.equal(row, encode_delta(new, agreed, many))
    rows = torch.stack([row, encode_delta(torch.full((3000,), float("inf")), agreed, one)])
    (d1, f1), (d2, f2) = decode_rows(rows, one), decode_rows(rows, many)
    assert torch.equal(d1, d2) and f1.tolist() == f2.tolist() == [True, False] and (d1[1] == 0).all()
