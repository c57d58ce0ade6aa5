"""SparseLoCo's outer exchange (--diloco-outer-topk) in real one-job DiLoCo runs on gloo ranks:
training, bytes, save and resume at the same and another layout, Streaming DiLoCo's
fragments, the collectives' order (elastic replicas: tests/test_elastic_sparse.py)."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import (REPO, TINY, finished_run, recorded_collectives, run_launch, torchrun, torchrun_runs,
                      train_losses)

SPARSE = ["--diloco-replicas", "2", "--diloco-inner-steps", "32", "--diloco-outer-topk", "64",
          "--diloco-outer-bits", "2"]
ITERS = 64
ARGS = TINY + ["--train-iters", str(ITERS), *SPARSE]
RESUME_AT = 48
"""Mid-interval, after the outer step at 32 left the error buffers full: the outer step at
64 reads them."""


@pytest.fixture(scope="module")
def one_job(cache_dir, tmp_path_factory) -> dict:
    """{run: (stdout, metrics)}: 2 replicas of one rank saving at 48 (``ref``), the same
    layout resumed from it in the same processes (``same``), and 2 replicas of 2 ranks
    (inner DP 2) resumed from it (``other``)."""
    tmp = tmp_path_factory.mktemp("sparse")
    ck = str(tmp / "ck")
    runs = [("ref", ["--save", ck, "--save-interval", str(RESUME_AT)]), ("same", ["--load", ck])]
    launch = torchrun_runs(2, ARGS, cache_dir, tmp, runs, resume_at=RESUME_AT)
    out = {name: finished_run(launch, runs, name) for name, _ in runs}
    other = [("other", ["--load", ck])]
    out["other"] = finished_run(torchrun_runs(4, ARGS, cache_dir, tmp, other, resume_at=RESUME_AT), other, "other")
    return out


def _outer_checks(out: str) -> dict[int, bool]:
    """iteration -> whether every rank found the replicas bit-identical (matrix_run.py's
    IDENTICAL lines with an outer verdict: after an outer step)."""
    found: dict[int, bool] = {}
    for _, it, *_, outer in re.findall(r"IDENTICAL rank=(\d+) iter=(\d+) dense=(\w+) expert=(\w+) tp=(\w+) "
                                       r"outer=(\S+)", out):
        if outer != "-":
            found[int(it)] = found.get(int(it), True) and outer == "True"
    return found


def test_sparse_outer_trains_agrees_and_sends_under_a_thousandth(one_job):
    """Guards against a sparse outer step that does not train (the loss must fall over 64
    steps with outer steps at 32 and 64), replicas that do not hold the same parameters bit
    for bit after it, and bytes between the replicas that are not SparseLoCo's: per step at
    most 0.001x of what plain data parallelism's fp32 gradient all-reduce sends (the issue's
    bar; the dense 4-bit outer is about 0.004x), counted from the comm/outer_* metrics that
    hold every index, value and bin table sent."""
    out, metrics = one_job["ref"]
    assert "exchange SparseLoCo top 64 of 4096 (64x64 tiles of 2-D weights, flat elsewhere), 2-bit values" in out
    assert "SGD lr 1.0" in out
    losses = train_losses(metrics)
    assert sorted(losses) == list(range(1, ITERS + 1))
    first, last = sum(losses[i] for i in range(1, 9)) / 8, sum(losses[i] for i in range(ITERS - 7, ITERS + 1)) / 8
    assert last < first - 0.3, (first, last)
    assert _outer_checks(out) == {32: True, 64: True}, _outer_checks(out)
    sent = sum(m.get("comm/outer_bytes_sent", 0) for m in metrics)
    bf16_every_step = sum(m.get("comm/outer_bytes_bf16_every_step", 0) for m in metrics)
    assert sent > 0 and bf16_every_step > 0
    assert sent / (2 * bf16_every_step) <= 0.001, sent / (2 * bf16_every_step)


def test_sparse_resume_same_layout_bit_exact_other_layout_one_line(one_job):
    """Guards against SparseLoCo's error buffers missing from a checkpoint or restored wrong
    (the resumed run's outer step at 64 would send other entries: its losses differ from the
    uninterrupted run's), a same-layout resume that announces a reset, and a resume at
    another layout (2 replicas of 2 ranks: other shards) that crashes, loads the buffers into
    the wrong elements silently, or says what starts afresh in more than one line."""
    a = train_losses(one_job["ref"][1])
    out, metrics = one_job["same"]
    b = train_losses(metrics)
    assert sorted(b) == list(range(RESUME_AT + 1, ITERS + 1)) and all(a[i] == b[i] for i in b), (a, b)
    assert not [ln for ln in out.splitlines() if "re-seeded" in ln or "start at zero" in ln]
    out, metrics = one_job["other"]
    c = train_losses(metrics)
    assert sorted(c) == list(range(RESUME_AT + 1, ITERS + 1))
    assert c[RESUME_AT + 1] == pytest.approx(a[RESUME_AT + 1], rel=1e-4), (a, c)
    lines = [ln for ln in out.splitlines() if "re-seeded" in ln or "start at zero" in ln]
    assert len(lines) == 1 and "outer error buffers start at zero" in lines[0], lines
    assert _outer_checks(out) == {64: True}, _outer_checks(out)


def _checks(stdout: str, kind: str) -> dict:
    out: dict = {}
    for rank, it, key, same in re.findall(rf"^{kind} rank=(\d+) iter=(\d+)(?: key=(\S+))? identical=(\w+)$",
                                          stdout, re.M):
        out.setdefault((int(rank), int(it)), []).append((key, same == "True"))
    return out


def test_streaming_fragments_each_agree_after_their_sparse_outer_step(cache_dir, tmp_path):
    """Guards against Streaming DiLoCo's fragments sharing one error buffer or one chunk plan
    (a fragment's exchange would send another fragment's entries) and against a delayed
    sparse exchange applied apart: 2 fragments, H 4, tau 1 (alpha 0), top 8 of chunks of 64
    (8 x 8 tiles of the 64-wide weights), 4-bit values, with Muon inside: after each
    fragment's apply step its channels are bit-identical across the replicas, while the
    whole model is not (the other fragment trains apart)."""
    args = TINY + ["--train-iters", "9", "--diloco-replicas", "2", "--diloco-inner-steps", "4",
                   "--diloco-fragments", "2", "--diloco-sync-delay", "1", "--diloco-mixing-factor", "0",
                   "--diloco-outer-topk", "8", "--diloco-outer-chunk", "64", "--diloco-outer-bits", "4",
                   "--optimizer", "muon"]
    proc, _ = torchrun(2, args, cache_dir, tmp_path, script="tests/diloco_check.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SparseLoCo top 8 of 64 (8x8 tiles" in proc.stdout
    outer, model = _checks(proc.stdout, "OUTER"), _checks(proc.stdout, "MODEL")
    keys = {key for checks in outer.values() for key, _ in checks}
    assert {k.split(".")[1] for k in keys} == {"fragment0", "fragment1"}, keys
    assert sorted({it for _, it in outer}) == [3, 5, 7, 9], sorted(outer)
    assert all(same for checks in outer.values() for _, same in checks), outer
    assert any(not same for checks in model.values() for _, same in checks)


def test_sparse_collectives_in_the_same_order_on_every_rank(cache_dir, tmp_path, monkeypatch):
    """Guards against a sparse exchange issued by polling or timing, or in two collectives
    where one fixed-size all-gather carries it (NCCL deadlocks where gloo forgives): under
    random delays and is_completed() answers, 2 fragments, a delay of 2 steps, inner DP 2
    (LoCo 4-bit inside), every rank issues each communicator's operations in the same order,
    and the outer groups carry one all-gather per exchange."""
    monkeypatch.setenv("LOCO_TEST_RECORD_DIR", str(tmp_path))
    args = TINY + ["--train-iters", "9", "--loco-bits", "4", "--diloco-replicas", "2", "--diloco-inner-steps", "4",
                   "--diloco-fragments", "2", "--diloco-sync-delay", "2", "--diloco-outer-topk", "16"]
    torchrun(4, args, cache_dir, tmp_path, script="tests/record_collectives.py")
    logs = recorded_collectives(tmp_path, 4)  # (each communicator in one order on all its ranks)
    seen = {tuple(g) for log in logs.values() for g, _, _ in log}
    assert {(0, 2), (1, 3)} <= seen
    # fragments synced at 2, 4, 6, 8 and the final outer step at 9 over both: 6 exchanges
    assert [op for g, op, n in logs[0] if tuple(g) == (0, 2)] == ["all_gather"] * 6


def test_dry_run_prints_the_sparse_payload():
    """Guards against --dry-run hiding what a sparse outer exchange sends (or printing the
    dense form's figures for it): the outer payload per exchange, its bin tables named, and
    the ratio per step against data parallel's fp32 all-reduce."""
    proc = run_launch([sys.executable, str(REPO / "pretrain_gpt.py"), "--dry-run", "--world-size", "2", *SPARSE],
                      None, 300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("DiLoCo outer payload per exchange"))
    assert "plus a 16-byte bin table per tensor" in line, line
    per_step = float(re.search(r"shard, ([0-9.e-]+)x of data parallel", line).group(1))
    assert 0 < per_step <= 0.001, line
    dense = run_launch([sys.executable, str(REPO / "pretrain_gpt.py"), "--dry-run", "--world-size", "2",
                        "--diloco-replicas", "2"], None, 300)
    line = next(ln for ln in dense.stdout.splitlines() if ln.startswith("DiLoCo outer payload per exchange"))
    assert "bin table" not in line and float(re.search(r"shard, ([0-9.e-]+)x of", line).group(1)) > 0.001, line

