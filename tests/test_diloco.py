"""DiLoCo in real training on gloo ranks: the replicas, the outer step's effect on the
parameters, the collectives' order, the start-up checks (checkpoints: test_diloco_checkpoint.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import (REPO, TINY, finished_run, recorded_collectives, run_launch, torchrun, torchrun_runs,
                      train_losses)
from loco_megatron.config import Config, ConfigError, DiLoCoConfig
from loco_megatron.diloco.layout import check_replicas


def _checks(stdout: str, kind: str) -> dict[tuple[int, int], list[bool]]:
    """{(rank, iteration): [identical, ...]} of the tests/diloco_check.py lines of ``kind``."""
    out: dict = {}
    for rank, it, same in re.findall(rf"^{kind} rank=(\d+) iter=(\d+)(?: key=\S+)? identical=(\w+)$", stdout, re.M):
        out.setdefault((int(rank), int(it)), []).append(same == "True")
    return out


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_one_replica_with_lr_one_tracks_plain_training(optimizer, cache_dir, tmp_path):
    """Guards against an outer step that changes what it should leave alone: one replica
    with outer lr 1 and momentum 0 sets the parameters to ``agreed - (agreed - local)``,
    which is ``local`` up to one fp32 rounding of the subtraction (exact where the two
    are within a factor of two, Sterbenz), so the run must track plain training: the
    losses agree to 1e-5 relative over 6 steps with an outer step every 2 (the bound the
    test uses: a few fp32 roundings' worth of drift in the parameters, far below the
    1e-2 a wrong sign, a doubled update or a stale parameter copy produces). Catches, too,
    the gradient scaling applied for replicas when there is only one. With --optimizer muon
    (MuLoCo) the shards are the layer-wise optimizer's whole parameters, each rank's own:
    an outer update of a parameter the rank does not own, or one not copied to the model
    or not gathered to the replica's other rank, breaks the tracking too."""
    # (both runs at one --lr and scale: the defaults inside DiLoCo are not plain training's)
    args = TINY + ["--train-iters", "6", "--optimizer", optimizer, "--lr", "1e-3", "--muon-extra-scale-factor", "0.5"]
    one = ["--diloco-replicas", "1", "--diloco-inner-steps", "2", "--diloco-outer-lr", "1",
           "--diloco-outer-momentum", "0", "--diloco-outer-bits", "0"]
    runs = [("plain", []), ("one", one)]
    launch = torchrun_runs(2, args, cache_dir, tmp_path, runs)
    plain = train_losses(finished_run(launch, runs, "plain")[1])
    stdout, metrics = finished_run(launch, runs, "one")
    diloco = train_losses(metrics)
    assert sorted(plain) == sorted(diloco) == list(range(1, 7))
    for it in plain:
        assert diloco[it] == pytest.approx(plain[it], rel=1e-5, abs=0), (it, plain, diloco)
    assert "DiLoCo: 1 replicas of 2 ranks" in stdout


@pytest.mark.parametrize("optimizer,outer_bits", [("adam", "4"), ("muon", "2")])
def test_replicas_train_apart_and_agree_after_each_outer_step(optimizer, outer_bits, cache_dir, tmp_path):
    """Guards against replicas that are not independent between outer steps (gradients
    still reduced across replicas, or data shared) and against an outer step that leaves
    them apart (a rank keeping its own mean, a missed copy to the model's weights or its
    bf16 copy, a parameter gather that serves stale shards): 2 replicas of 2 ranks (inner
    DP 2, inner LoCo 4-bit, outer LoCo 4-bit; MuLoCo: Muon sharded layer-wise over the
    replica's 2 ranks, 2-bit outer gradients), bf16, an outer step every 2 steps: after
    steps 2, 4, 6 every parameter is bit-identical across the replicas (the fp32 main
    shards and the bf16 weights; MuLoCo: Muon's and AdamW's); after 3 and 5 the replicas
    differ; inside a replica the weights are always identical."""
    args = TINY + ["--train-iters", "6", "--loco-bits", "4", "--bf16", "--diloco-replicas", "2",
                   "--diloco-inner-steps", "2", "--diloco-outer-bits", outer_bits, "--optimizer", optimizer]
    proc, metrics = torchrun(4, args, cache_dir, tmp_path, script="tests/diloco_check.py")
    outer, model, inner = (_checks(proc.stdout, k) for k in ("OUTER", "MODEL", "INNER"))
    for rank in range(4):
        for it in range(1, 7):
            assert inner[(rank, it)] == [True], (rank, it)
            if it > 1:  # (step 1 runs at lr 0: the warmup's first step changes nothing)
                assert model[(rank, it)] == [it % 2 == 0], (rank, it)
            if it % 2 == 0:
                assert outer[(rank, it)] and all(outer[(rank, it)]), (rank, it)
    if optimizer == "muon":  # (sub-optimizer 0 is Muon, 1 megatron's AdamW)
        assert {"opt0", "opt1"} <= set(re.findall(r"key=(opt\d)", proc.stdout))
    steps = [m for m in metrics if "comm/outer_bytes_sent" in m]
    assert steps and all(m["comm/outer_bytes_sent"] > 0 for m in steps if m["iteration"] % 2 == 0)
    assert all(m["comm/outer_bytes_sent"] == 0 for m in steps if m["iteration"] % 2 == 1)
    assert "between replicas (DiLoCo outer exchanges)" in proc.stdout


def test_tied_embedding_copies_stay_equal_across_pipeline_stages(cache_dir, tmp_path):
    """Guards against the two copies of a tied embedding (the first stage's word embedding,
    the last stage's output layer) drifting apart under the outer step: they sit at
    different places of their stages' shards, so a compressed exchange (blocks, error
    buffers) or a ring all-reduce would give them different updates; megatron keeps them
    equal only through the inner steps' gradients. PP 2 x 2 replicas, outer 4-bit, outer
    steps at 2 and 4: equal after every step, and the replicas agree after outer steps."""
    args = TINY + ["--train-iters", "4", "--pipeline-model-parallel-size", "2", "--diloco-replicas", "2",
                   "--no-untie-embeddings-and-output-weights",  # (untied is the default)
                   "--diloco-inner-steps", "2", "--diloco-outer-bits", "4"]
    proc, _ = torchrun(4, args, cache_dir, tmp_path, script="tests/diloco_check.py")
    tied, model = _checks(proc.stdout, "TIED"), _checks(proc.stdout, "MODEL")
    assert set(tied) == {(r, t) for r in range(4) for t in range(1, 5)}
    assert all(v == [True] for v in tied.values()), tied
    assert all(model[(r, t)] == [True] for r in range(4) for t in (2, 4)), model


def test_streaming_collectives_in_the_same_order_on_every_rank(cache_dir, tmp_path, monkeypatch):
    """Guards against outer exchanges whose phases are issued by polling or timing
    (NCCL deadlocks where gloo forgives): under random delays and random is_completed()
    answers, with 2 fragments, a delay of 2 steps (phase 2 one step after the start, the
    apply one step later) and compressed outer gradients, every rank issues each
    communicator's operations in the same order, and the outer groups do carry traffic."""
    monkeypatch.setenv("LOCO_TEST_RECORD_DIR", str(tmp_path))
    args = TINY + ["--train-iters", "9", "--loco-bits", "4", "--diloco-replicas", "2", "--diloco-inner-steps", "4",
                   "--diloco-fragments", "2", "--diloco-sync-delay", "2", "--diloco-outer-bits", "2"]
    torchrun(4, args, cache_dir, tmp_path, script="tests/record_collectives.py")
    logs = recorded_collectives(tmp_path, 4)  # (each communicator in one order on all its ranks)
    outer_groups = {(0, 2), (1, 3)}
    seen = {tuple(g) for log in logs.values() for g, _, _ in log}
    assert outer_groups <= seen
    # 2 fragments synced at 2, 4, 6, 8, and the final outer step at 9 over both: 6
    # exchanges, two phases (all-to-all, all-gather) each.
    ops = [op for g, op, n in logs[0] if tuple(g) == (0, 2)]
    assert ops == ["all_to_all", "all_gather"] * 6, ops


@pytest.mark.parametrize("extra, syncs", [
    ([], {4, 8}),
    # fragments start at 4 and 8, their second phase (the all-gather) one step later
    (["--diloco-inner-steps", "8", "--diloco-fragments", "2", "--diloco-sync-delay", "1"], {4, 5, 8, 9}),
    (["--diloco-inner-steps", "100"], set()),
], ids=["h4", "streaming", "no-outer-step"])
def test_no_collective_crosses_replicas_between_outer_steps(extra, syncs, cache_dir, tmp_path, monkeypatch):
    """Guards against a step that waits on the link between sites: with 2 replicas of one
    rank, every torch.distributed collective any code issues (megatron-core's, the
    checkpointer's, ours) is recorded with the step that issued it; a collective that spans
    both replicas may come only from a step where an outer exchange starts (which carries
    the stop flags too) or runs its second phase, before the first step or at the end of
    the run, never from the
    others, with a log line and an evaluation every step or two (each of which used to
    reduce over the whole world), and none at all in a run without an outer step
    (the stop/health all-reduce used to cross at every step)."""
    monkeypatch.setenv("LOCO_COLLECTIVE_LOG_DIR", str(tmp_path))
    args = TINY + ["--train-iters", "9", "--diloco-replicas", "2", "--diloco-inner-steps", "4",
                   "--diloco-outer-bits", "4", "--eval-interval", "2", "--eval-iters", "1", *extra]
    torchrun(2, args, cache_dir, tmp_path, script="benchmarks/collective_log.py")
    for rank in (0, 1):
        log = json.loads((tmp_path / f"all_rank{rank}.json").read_text())
        crossing = {phase for phase, ranks, _, _ in log if 0 in ranks and 1 in ranks}
        steps = {p for p in crossing if p not in (0, "end")}
        assert steps == syncs, (rank, sorted(steps), sorted({p for p, *_ in log if p not in (0, "end")}))
        assert "end" in crossing and any(p not in (0, "end") for p, ranks, *_ in log if len(ranks) == 1), rank


@pytest.mark.parametrize("argv, line", [
    (["--diloco-replicas", "3"], "--diloco-replicas: 3 does not divide the world size 4"),
    (["--diloco-replicas", "4", "--tensor-model-parallel-size", "2"],
     "--diloco-replicas: 4 does not divide the data-parallel size 2"),
    (["--diloco-replicas", "2", "--num-experts", "4", "--expert-model-parallel-size", "4"],
     "--diloco-replicas: 2 does not divide the expert data-parallel size 1"),
    (["--diloco-replicas", "2", "--no-use-distributed-optimizer"],
     "--diloco-replicas: needs --use-distributed-optimizer"),
])
def test_bad_replica_layouts_are_one_line(argv, line):
    """Guards against a replica count the world cannot hold starting anyway (megatron-core
    asserts deep inside its parallel state) or ending in a traceback: the dry run, which
    makes a real start's checks, prints one line naming the flag and exits 2."""
    proc = run_launch([sys.executable, "pretrain_gpt.py", *argv, "--dry-run", "--world-size", "4"], None, 300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and line in lines[0], proc.stderr


def test_replicas_must_be_whole_nodes():
    """Guards against replicas that split a node (half of its ranks in one replica, half
    in another, so intra-replica traffic crosses the slow link): refused in one line; a
    replica of whole nodes, or several replicas inside one node, are fine."""
    from loco_megatron.config import DataConfig

    config = Config(data=DataConfig(micro_batch_size=1, global_batch_size=96), diloco=DiLoCoConfig(diloco_replicas=2))
    with pytest.raises(ConfigError, match="replicas of 12 ranks would split nodes of 8 ranks"):
        check_replicas(config, 24, 8)
    check_replicas(config, 32, 8)  # 2 replicas of 2 nodes
    check_replicas(config, 8, 8)  # 2 replicas in one node
    check_replicas(config, 6, None)  # no node size known (dry run)


def test_dry_run_prints_replicas_and_outer_memory():
    """Guards against a dry run that hides DiLoCo: the replica layout line and the outer
    state in the memory estimate (the optimizer sharded over the replica's ranks only)."""
    base = [sys.executable, "pretrain_gpt.py", "--dry-run", "--world-size", "4"]
    plain = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=300)
    proc = subprocess.run(base + ["--diloco-replicas", "2", "--diloco-fragments", "4"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert ("DiLoCo: 2 replicas of 2 ranks (TP 1 x PP 1 x DP 2; replica 0 = ranks 0-1); outer step every 32 steps, "
            "4 fragments") in proc.stdout
    assert "DiLoCo outer state" in proc.stdout and "DiLoCo" not in plain.stdout

    def optimizer(out: str) -> float:
        return float(re.search(r"optimizer ([\d.]+)", out).group(1))

    assert optimizer(proc.stdout) == pytest.approx(2 * optimizer(plain.stdout), rel=0.1)


@pytest.mark.parametrize("outer", [["--diloco-outer-bits", "4"], ["--diloco-outer-topk", "64"]], ids=["4bit", "sparse"])
def test_tp_replicated_parameters_stay_equal_under_the_outer_step(outer, cache_dir, tmp_path):
    """Guards against the outer step pulling the TP copies of a replicated parameter (norm
    weights, row-parallel biases) apart: in a channel shared with TP-split parameters a
    compressed exchange quantised them in blocks whose other values differ between the TP
    ranks, so the two copies took different outer updates (the matrix never saw it: its only
    TP x DiLoCo cell ran --param-gather-bits, which skips the TP check). 2 replicas of TP 2,
    outer steps at 3 and 6: every parameter equal across the TP ranks after every step (and
    across the replicas after each outer step), the 4-bit and the sparse outer exchange."""
    args = TINY + ["--train-iters", "6", "--tensor-model-parallel-size", "2", "--diloco-replicas", "2",
                   "--diloco-inner-steps", "3", *outer]
    runs = [("run", [])]
    out, _ = finished_run(torchrun_runs(4, args, cache_dir, tmp_path, runs), runs, "run")
    checks = re.findall(r"IDENTICAL rank=(\d+) iter=(\d+) dense=(\w+) expert=(\w+) tp=(\w+) outer=(\S+)", out)
    assert len(checks) == 4 * 6, checks
    assert all(tp == "True" for *_, tp, _ in checks), [c for c in checks if c[4] != "True"]
    assert sorted({int(it) for _, it, *_, o in checks if o == "True"}) == [3, 6], checks
