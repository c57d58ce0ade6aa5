"""LoCo under Megatron-FSDP (--use-megatron-fsdp): HSDP over 2 "nodes" x 2 ranks of real
gloo processes, the intra-node reduce-scatter megatron's own, the cross-node replica
reduction compressed."""

import functools
import re
import shutil

import pytest

import conftest
from conftest import TINY, recorded_collectives, train_losses
from loco_megatron.cli import parse_config
from loco_megatron.config import ConfigError

# Megatron-FSDP's runs start as plain torchruns (fresh interpreters), not on the suite's fork
# server: a rank of a 4-rank FSDP run forked by the server's agent (after its store threads
# started) can die of a memory fault or an abort, for a reason not known; a plain run does not.
torchrun = functools.partial(conftest.torchrun, plain=True)

HSDP = TINY + ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2", "--loco-ranks-per-node", "2",
               "--micro-batch-size", "1", "--train-iters", "4"]


def _grad_norms(metrics):
    return {m["iteration"]: m["train/grad_norm"] for m in metrics if "train/grad_norm" in m}


def _shards(stdout: str, rank: int = 0) -> tuple[list[int], list[int]]:
    """(shard sizes, bucket sizes) of the compressed buckets that tests/fsdp_check.py printed."""
    numel, buckets = re.search(rf"SHARDS rank={rank} numel=([\d,]+) buckets=([\d,]+)", stdout).groups()
    return [int(n) for n in numel.split(",")], [int(n) for n in buckets.split(",")]


def _packed_rows(shards: list[int]) -> list[int]:
    """Bytes of each shard's 4-bit codes + one fp32 scale per 256-block."""
    return [-(-n // 256) * (256 // 2 + 4) for n in shards]


@pytest.fixture(scope="module")
def uncompressed(cache_dir, tmp_path_factory):
    """The HSDP run with --loco-bits 0 (the FSDP hook installed, timing only)."""
    return torchrun(4, HSDP + ["--loco-bits", "0"], cache_dir, tmp_path_factory.mktemp("off"))[1]


def test_loco_off_is_plain_megatron_fsdp(cache_dir, tmp_path, uncompressed):
    """Guards against the FSDP hook changing megatron's gradient reduction when LoCo is off
    (wrong arguments passed through, the outer reduction dropped or done twice): losses and
    gradient norms equal megatron-core's Megatron-FSDP with no hook, bit for bit, and the
    bytes counted are megatron's uncompressed reduce-scatter and all-reduce."""
    _, plain = torchrun(4, HSDP, cache_dir, tmp_path, script="tests/plain_megatron.py", name="plain")
    assert train_losses(uncompressed) == train_losses(plain) and len(train_losses(plain)) == 4
    assert _grad_norms(uncompressed) == _grad_norms(plain)
    last = [m for m in uncompressed if "comm/grad_bytes_sent" in m][-1]
    assert last["comm/compression_ratio"] == 1.0 and last["comm/grad_bytes_sent_inter"] > 0


@pytest.fixture(scope="module")
def compressed(cache_dir, tmp_path_factory):
    """The HSDP run with --loco-bits 4, its collectives recorded under random delays, the
    replicas compared before every step, a checkpoint every 2 steps: (process, metrics, dir)."""
    out = tmp_path_factory.mktemp("loco")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCO_TEST_RECORD_DIR", str(out))
    try:
        proc, metrics = torchrun(4, HSDP + ["--loco-bits", "4", "--save", str(out / "ck"), "--save-interval", "2",
                                            "--ckpt-format", "torch"], cache_dir, out, script="tests/fsdp_check.py")
    finally:
        mp.undo()
    return proc, metrics, out


def test_hsdp_loco_trains_keeps_replicas_identical_in_order(compressed, uncompressed):
    """Guards against a LoCo replica reduction that leaves the HSDP replicas apart (each
    must end the step with the same shard: every replica sums the same gathered codes in
    the same order), loses
    error feedback (loss drifts from the uncompressed run), issues its collectives in a
    timing-dependent order (random delays and is_completed() answers here), or sends or
    counts bytes that are not the packed shard: one all-gather per bucket per step of 4-bit
    codes + one fp32 scale per 256-block of this rank's whole shard, nothing at fp32."""
    proc, metrics, tmp_path = compressed
    checks = re.findall(r"REPLICAS rank=(\d) iter=(\d+) identical=(\w+)", proc.stdout)
    assert len(checks) == 4 * 3 and all(same == "True" for _, _, same in checks), checks
    on, off = train_losses(metrics), train_losses(uncompressed)
    assert on[1] == off[1]  # the first loss is computed before any update
    assert all(abs(on[i] - off[i]) < 0.02 for i in off), (on, off)
    assert on != off  # the compressed reduction did change the gradients

    logs = recorded_collectives(tmp_path, 4)  # (each communicator in one order on all its ranks)
    assert {tuple(g) for g, _, _ in logs[0]} == {(0, 2)}  # only the cross-node group, rank 0's

    per_step = len(logs[0]) // 4
    step = logs[0][:per_step]
    assert [op for _, op, _ in step] == ["all_gather"] * per_step  # one gather of codes per bucket
    rows = _packed_rows(_shards(proc.stdout)[0])
    assert sorted(n for _, _, n in step) == sorted(rows) and len(rows) == per_step
    inter = sum(rows)                             # each row goes to the (one) replica on the other node
    for m in (m for m in metrics if "comm/grad_bytes_sent_inter" in m):
        assert m["comm/grad_bytes_sent_inter"] == inter
        assert 0 < m["comm/compressed_fraction"] < 1  # the intra-node reduce-scatter is not compressed
    assert "LoCo memory on rank 0: error buffers" in proc.stdout


STRATEGIES = {  # name: (ranks, sharding group size, args): HSDP over 2 "nodes", step 1 uncompressed
    "optim": (4, 2, ["--data-parallel-sharding-strategy", "optim"]),
    "optim_grads": (4, 2, ["--data-parallel-sharding-strategy", "optim_grads"]),
    "group_of_one": (2, 1, ["--loco-ranks-per-node", "1"]),  # HSDP 2 x 1, optim_grads_params
}


@pytest.fixture(scope="module", params=list(STRATEGIES))
def strategy_run(request, cache_dir, tmp_path_factory):
    """HSDP with LoCo 4-bit under each other sharding layout (tests/fsdp_check.py), step 1
    in warm-up (megatron's reduction, uncompressed): (name, sharding group size, process, metrics)."""
    nproc, group, extra = STRATEGIES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCO_TEST_RECORD_DIR", str(out))
    try:
        args = [*HSDP[:-1], "3", "--loco-bits", "4", "--loco-warmup-iters", "1", *extra]
        proc, metrics = torchrun(nproc, args, cache_dir, out, script="tests/fsdp_check.py")
    finally:
        mp.undo()
    return request.param, group, proc, metrics


def test_every_sharding_strategy_compresses_the_rank_shard(strategy_run, uncompressed):
    """Guards against LoCo under a Megatron-FSDP layout whose gradient buffer holds the whole
    bucket (``optim``; any strategy over a sharding group of one rank) compressing, and
    keeping error buffers of, the whole bucket instead of this rank's shard (half of it
    zeroed as "padding"), and against megatron-core 0.16.1's reduction of such buffers, which
    adds the reduced shard onto the unreduced one it aliases (and, reducing every
    micro-batch, rescales the accumulating bucket): without the hook's fix step 1's gradient
    norm was 1.322 (optim, 2 x 2) and 1.619 (2 x 1) against 0.809. Every compressed shard is
    its bucket / the sharding group, one all-gather per bucket sends exactly the packed
    shards, the replicas stay bit-identical, the uncompressed step 1 matches the ZeRO-3
    reference run and the compressed steps follow it."""
    name, group, proc, metrics = strategy_run
    shards, buckets = _shards(proc.stdout)
    assert [n * group for n in shards] == buckets, (name, shards, buckets)
    checks = re.findall(r"REPLICAS rank=(\d) iter=(\d+) identical=(\w+)", proc.stdout)
    ranks = 4 if group == 2 else 2
    assert len(checks) == ranks * 2 and all(same == "True" for _, _, same in checks), checks
    on, off = train_losses(metrics), train_losses(uncompressed)
    assert on[1] == pytest.approx(off[1], rel=1e-6) and on[2] == pytest.approx(off[2], rel=1e-5), (on, off)
    assert _grad_norms(metrics)[1] == pytest.approx(_grad_norms(uncompressed)[1], rel=1e-5)
    assert abs(on[3] - off[3]) < 0.02
    inter = [m["comm/grad_bytes_sent_inter"] for m in metrics if "comm/grad_bytes_sent_inter" in m]
    assert inter[0] == sum(4 * n for n in shards) // 2  # step 1: the shard's fp32 all-reduce, half to the other node
    assert inter[1:] == [sum(_packed_rows(shards))] * 2


def test_one_rank_fsdp_gradient_is_the_batch_mean(cache_dir, tmp_path, uncompressed):
    """Guards against megatron-core 0.16.1's Megatron-FSDP on one data-parallel rank (its
    gradient buffer then holds the whole bucket) adding the reduced bucket onto itself and
    rescaling the accumulating bucket on every micro-batch: with no hook step 1's gradient
    norm was 72.385 over 8 micro-batches against 0.809. With the hook, one rank's losses
    and gradient norms are those of the 4-rank run of the same global batch."""
    args = [*TINY, "--use-megatron-fsdp", "--micro-batch-size", "1", "--train-iters", "3", "--loco-bits", "0"]
    _, metrics = torchrun(1, args, cache_dir, tmp_path, name="one")
    on, off = train_losses(metrics), train_losses(uncompressed)
    assert len(on) == 3 and all(on[i] == pytest.approx(off[i], rel=1e-5) for i in on), (on, off)
    assert all(_grad_norms(metrics)[i] == pytest.approx(_grad_norms(uncompressed)[i], rel=1e-4) for i in (1, 2))


def test_parameter_gathers_overlap_on_cpu_and_deliver_the_gathered_weights(compressed):
    """Guards against the CPU run not exercising the path a GPU runs - Megatron-FSDP's
    overlapped parameter all-gathers (issued at the end of ``optimizer.step()`` for the next
    forward and prefetched, waited for in its pre-hooks), which were made synchronous on CPU
    before - and against the staging that keeps them off megatron's memory
    (``platform.megatron_fsdp_staged_param_gather``) losing or misplacing a gather: after
    every optimizer step every rank holds asynchronous gathers in flight, and once
    megatron's own wait has finished them each bucket equals a synchronous all-gather of
    the shards."""
    proc, _, _ = compressed
    gathers = re.findall(r"GATHERS rank=(\d) iter=(\d+) in_flight=(\d+)", proc.stdout)
    assert len(gathers) == 4 * 3 and all(int(n) > 0 for _, _, n in gathers), gathers
    checked = re.findall(r"GATHERED rank=(\d) iter=(\d+) buckets=(\d+) equal=(\w+)", proc.stdout)
    assert len(checked) == 4 * 3 and all(int(n) > 0 and same == "True" for _, _, n, same in checked), checked


def test_resume_is_bit_exact(cache_dir, tmp_path, compressed):
    """Guards against a Megatron-FSDP checkpoint that loses the error buffers, the Adam
    state or the main weights (or leaves the model's gathered weights stale): resumed from
    step 2, steps 3-4 repeat the uninterrupted run's losses and gradient norms bit for bit."""
    _, full, out = compressed
    ck = tmp_path / "ck"
    shutil.copytree(out / "ck", ck)
    shutil.rmtree(ck / "iter_0000004")
    (ck / "latest_checkpointed_iteration.txt").write_text("2")
    args = HSDP + ["--loco-bits", "4", "--load", str(ck), "--ckpt-format", "torch"]
    _, resumed = torchrun(4, args, cache_dir, tmp_path, name="resumed")
    want = {i: v for i, v in train_losses(full).items() if i > 2}
    assert train_losses(resumed) == want and len(want) == 2
    assert _grad_norms(resumed) == {i: v for i, v in _grad_norms(full).items() if i > 2}


@pytest.mark.parametrize("args,needle", [
    (["--loco-bits", "4"], "--num-distributed-optimizer-instances = number of nodes"),
    (["--pipeline-model-parallel-size", "2"], "pipeline parallelism"),
    (["--param-gather-bits", "8"], "--param-gather-bits"),
    (["--loco-hierarchical"], "--loco-hierarchical"),
    (["--loco-intra-node-bits", "16"], "--loco-intra-node-bits"),
    (["--num-experts", "4"], "MoE"),
    (["--no-use-distributed-optimizer"], "--use-distributed-optimizer"),
    (["--save", "/nonexistent/ck"], "--ckpt-format fsdp_dtensor"),
    (["--data-parallel-sharding-strategy", "no_shard"], "no_shard does not train"),
    (["--no-overlap-grad-reduce"], "backward hooks"),
])
def test_unsupported_fsdp_combinations_are_one_line(args, needle):
    """Guards against silently running a combination the FSDP path does not implement
    (flat FSDP with LoCo, PP, the DDP path's param-gather or two-hop flags, MoE) or that
    megatron-core 0.16.1's Megatron-FSDP gets wrong (no_shard fails at its first optimizer
    step; --no-overlap-grad-reduce reduces optim's gradients twice): each is refused with
    one message naming the flag."""
    with pytest.raises(ConfigError) as e:
        parse_config(["--use-megatron-fsdp", *args])
    assert needle in str(e.value) and "\n" not in str(e.value)
