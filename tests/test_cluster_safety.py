"""What NCCL and real clusters demand of the LoCo gradient path (gloo forgives it):
collective order fixed by program order, degenerate layouts, exact byte accounting,
bounded transient memory, and resumes across a change of LoCo settings."""

import pytest
import torch

from conftest import TINY, recorded_collectives, torchrun, train_losses
from loco_megatron.loco import LoCoCompressor, quantize_blockwise
from loco_megatron.loco.collectives import ShardLayout
from loco_megatron.loco.workspace import Workspace


def test_collective_order_is_identical_on_every_rank(cache_dir, tmp_path, monkeypatch):
    """Guards against launching two-hop's hop 2 when a poll of hop 1's is_completed()
    happens to say True: under random delays and random is_completed() answers, every
    rank of a 2x2 two-hop run must issue each communicator's operations in the same
    order, and interleave intra- and inter-node operations identically (else NCCL
    deadlocks)."""
    monkeypatch.setenv("LOCO_TEST_RECORD_DIR", str(tmp_path))
    args = TINY + ["--train-iters", "3", "--loco-bits", "4", "--loco-hierarchical", "--loco-ranks-per-node", "2",
                   "--ddp-bucket-size", "20000"]
    torchrun(4, args, cache_dir, tmp_path, script="tests/record_collectives.py")
    logs = recorded_collectives(tmp_path, 4)  # (each communicator in one order on all its ranks)

    def kind(ranks):
        nodes = {r // 2 for r in ranks}
        return "intra" if len(nodes) == 1 and len(ranks) > 1 else "inter" if len(ranks) == 2 else "dp"

    per_rank = {r: [(kind(g), op, n) for g, op, n in log] for r, log in logs.items()}
    assert len(per_rank[0]) > 20 and {k for k, _, _ in per_rank[0]} == {"intra", "inter"}
    assert all(seq == per_rank[0] for seq in per_rank.values())  # same interleaving on every rank


def test_data_parallel_size_one_is_exact_and_sends_nothing(cache_dir, tmp_path):
    """Guards against quantising gradients that never leave the rank (DP=1): 4-bit LoCo
    must give megatron's losses bit for bit and report 0 bytes sent; and against start-up
    lines that contradict each other (one said nothing is compressed, the next that rank 0
    hands x0.129 of the bytes to its collectives): one LoCo line, saying nothing is; and
    megatron's CUDA_DEVICE_MAX_CONNECTIONS advice (once per rank) on a CPU run. TP 2 on 2
    ranks, the layout those were seen with."""
    args = TINY + ["--train-iters", "4", "--global-batch-size", "4", "--tensor-model-parallel-size", "2"]
    _, off = torchrun(2, args + ["--loco-bits", "0"], cache_dir, tmp_path, name="off")
    proc, on = torchrun(2, args + ["--loco-bits", "4"], cache_dir, tmp_path, name="on")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in proc.stdout + proc.stderr
    assert train_losses(on) == train_losses(off)
    last = [m for m in on if "comm/grad_bytes_sent" in m][-1]
    assert last["comm/grad_bytes_sent"] == 0 and last["comm/grad_bytes_uncompressed"] == 0
    loco = [line for line in proc.stdout.splitlines() if line.startswith("LoCo") and "C++" not in line]
    assert len(loco) == 1 and "no data-parallel group of more than one rank here, so nothing is compressed" in loco[0]
    assert "hands" not in proc.stdout and "LoCo memory" not in proc.stdout, loco


def test_moe_with_ep_equal_dp_compresses_only_dense_buckets(cache_dir, tmp_path):
    """Guards against compressing expert gradients whose expert-data-parallel group is one
    rank (EP = DP): no LoCo state for expert buckets, and every byte that is sent is
    compressed dense-bucket payload."""
    ck = tmp_path / "ck"
    args = TINY + ["--train-iters", "3", "--loco-bits", "4", "--num-experts", "4",
                   "--expert-model-parallel-size", "2", "--save", str(ck), "--ckpt-format", "torch"]
    _, metrics = torchrun(2, args, cache_dir, tmp_path)
    keys = list(torch.load(ck / "iter_0000003" / "rank_00000.pt", weights_only=False)["loco"])
    assert keys and all(k.startswith("dense.") for k in keys), keys
    last = [m for m in metrics if "comm/compressed_fraction" in m][-1]
    assert last["comm/compressed_fraction"] == 1.0
    assert 4.125 / 32 <= last["comm/compression_ratio"] <= 4.125 / 32 * 1.05


def test_indivisible_bucket_without_distributed_optimizer(cache_dir, tmp_path):
    """Guards against 'buffer does not split over 2 ranks' (megatron pads buckets only for
    the distributed optimizer) and against byte metrics that leave out the all-gather of
    the reduced shards: the odd-sized model trains, and the bytes sent equal the payload
    formula: W rows of codes + scales, plus this rank's shard at fp32 for the all-gather.
    Losses follow the exact (uncompressed) twin within 4-bit quantisation noise."""
    args = ["--num-layers", "1", "--hidden-size", "33", "--num-attention-heads", "3", "--seq-length", "64",
            "--position-embedding-type", "learned_absolute", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--lr-warmup-iters", "1", "--eval-interval", "0", "--log-interval", "1", "--train-iters", "6",
            "--lr", "0.01", "--no-use-distributed-optimizer", "--ddp-bucket-size", "100000000"]
    _, metrics = torchrun(2, args + ["--loco-bits", "4"], cache_dir, tmp_path, name="loco")
    _, exact = torchrun(2, args + ["--loco-bits", "0"], cache_dir, tmp_path, name="exact")
    losses, want = train_losses(metrics), train_losses(exact)
    assert losses[6] < losses[1] - 0.05
    assert all(abs(losses[i] - want[i]) < 0.02 for i in want), (losses, want)
    last = [m for m in metrics if "comm/grad_bytes_sent" in m][-1]
    n = int(last["comm/grad_bytes_uncompressed"]) // 4  # one fp32 bucket
    assert n % 2 == 1  # the case under test: the bucket does not divide by DP
    layout = ShardLayout(n, 2, 4, 256)
    assert last["comm/grad_bytes_sent"] == 2 * layout.row_bytes + layout.piece * 4
    assert last["comm/compression_ratio"] == pytest.approx((2 * layout.row_bytes + layout.piece * 4) / (4 * n))


def test_resume_across_a_change_of_loco_settings(cache_dir, tmp_path):
    """Guards against a bare KeyError('error') when error feedback is switched off on
    resume, and a crash when the LoCo state no longer fits (here: 4 -> 2 bits): the run
    resumes, says in one line that the error starts at zero, and trains on."""
    ck = str(tmp_path / "ck")
    args = TINY + ["--train-iters", "4", "--lr-decay-iters", "4", "--loco-bits", "4"]
    torchrun(2, args + ["--train-iters", "2", "--save", ck], cache_dir, tmp_path, name="first")
    for name, extra in {"noef": ["--no-loco-error-feedback"], "bits2": ["--loco-bits", "2"]}.items():
        proc, metrics = torchrun(2, args + ["--load", ck, *extra], cache_dir, tmp_path, name=name)
        assert proc.stdout.count("starting the error buffers at zero") == 1, proc.stdout
        assert sorted(train_losses(metrics)) == [3, 4]


# -- in one process ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_compression_is_identical_and_bounded(dtype):
    """Guards against a workspace that grows with the bucket (two fp32 copies of a whole
    stage with --no-overlap-grad-reduce) and against chunking changing any result:
    compressing in 4096-element chunks gives the same codes, scales and error as one
    chunk, and the workspace never holds more than two fp32 chunks."""
    torch.manual_seed(0)
    n, rows = 300_001, 3  # rows of 100,001 elements: a partial last block in every row
    grads = [(torch.randn(n) * (1 + i)).to(dtype) for i in range(3)]
    one = LoCoCompressor(n, bits=4, rows=rows, chunk_elements=1 << 22)
    small = LoCoCompressor(n, bits=4, rows=rows, chunk_elements=4096)
    ws_one, ws_small = Workspace(), Workspace()
    for g in grads:
        a, b = one.compress(g, ws_one), small.compress(g, ws_small)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(one.error(), small.error())
    assert ws_small.nbytes <= 2 * 4 * 4096 < ws_one.nbytes
    assert small.workspace_nbytes() == 2 * 4 * 4096
    # Rows are zero-padded to whole blocks in place of a padded copy of the buffer.
    h = grads[-1].float()
    fresh = LoCoCompressor(n, bits=4, rows=rows, error_feedback=False, chunk_elements=4096)
    codes, scales = fresh.compress(grads[-1], Workspace())
    ref_codes, ref_scales = quantize_blockwise(ShardLayout(n, rows, 4, 256).padded(h).reshape(-1), 4, 256)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)


def test_nan_in_a_late_chunk_leaves_the_whole_error_untouched():
    """Guards against chunked compression updating early chunks' error before it knows
    that a later chunk is non-finite."""
    torch.manual_seed(1)
    c = LoCoCompressor(50_000, bits=4, chunk_elements=2048)
    c.compress(torch.randn(50_000), Workspace())
    before = c.state_dict()
    bad = torch.randn(50_000)
    bad[-3] = float("inf")
    c.compress(bad, Workspace())
    after = c.state_dict()
    assert torch.equal(before["error"], after["error"]) and torch.equal(before["error_scales"], after["error_scales"])
    assert torch.equal(c.last_stats, torch.zeros(4))


def test_ragged_layout_rows_and_packing():
    """Guards against an indivisible buffer losing or duplicating elements: rows cover the
    buffer exactly once, the last (possibly empty) rows are shorter, and the send
    buffer holds every row's codes and scales for its destination."""
    lay = ShardLayout(5, 4, 4, 8)
    assert [lay.row_range(i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert not lay.divides and lay.compressed_numel == 4 * 8
    c = LoCoCompressor(**lay.compressor_shape(), bits=4, block_size=8, error_feedback=False)
    x = torch.arange(1.0, 6.0)
    codes, scales = c.compress(x)
    send = lay.pack(codes, scales)
    assert send.shape == (4, lay.row_bytes)
    got = [lay.unpack_row(send[j])[1] for j in range(4)]
    want = torch.tensor([2.0, 4.0, 5.0, 0.0]) / 7  # fp32 max|row| / qmax, per destination
    assert torch.equal(torch.stack([s[0] for s in got]), want)


def test_hooks_refuse_megatron_core_outside_the_supported_range():
    """Guards against silently patching the private internals of a megatron-core release the
    hooks were not written for (both hooks run this check before touching anything)."""
    from loco_megatron.loco.hooks import UnsupportedMegatronCore, check_megatron_core_version

    check_megatron_core_version("0.16.1")
    for version in ("0.15.3", "0.17.0", "1.0.0rc1"):
        with pytest.raises(UnsupportedMegatronCore, match=version):
            check_megatron_core_version(version)
