"""Elastic DiLoCo on torchft: replicas as jobs of their own (each a real torchrun, gloo) and a
torchft Lighthouse, all separate processes; replicas killed, restarted, killed inside an
exchange, and refused."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import time

import pytest

from conftest import TINY, free_port, program, read_metrics, run_launch, start_launch, torchrun_command, train_losses

H = 4
TIMEOUTS = ["--diloco-quorum-timeout-s", "120", "--diloco-exchange-timeout-s", "20"]



class Run:
    """A lighthouse and the replica jobs of one elastic run, cleaned up at the end."""

    def __init__(self, tmp: pathlib.Path, cache: str, replicas: int, iters: int, extra: list[str] = ()):
        self.tmp, self.cache, self.replicas, self.iters, self.extra = tmp, cache, replicas, iters, list(extra)
        port = free_port()
        self.address = f"http://localhost:{port}"
        self.port = port
        self.jobs: dict[str, subprocess.Popen] = {}
        (tmp / "dump").mkdir(exist_ok=True)
        self._start_lighthouse()

    def _start_lighthouse(self) -> None:
        env = dict(os.environ, RUST_LOG="info")
        # join timeout: longer than the replicas' skew at a sync point; heartbeat: how soon a
        # dead replica is dropped from the next quorum, long enough that a live one starved of
        # CPU on a loaded machine is not taken for dead (its peers would form a quorum without it).
        self.lighthouse = subprocess.Popen(
            [program("torchft_lighthouse"), "--min_replicas", "1", "--bind", f"[::]:{self.port}", "--join_timeout_ms",
             "20000", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "10000"],
            env=env, stdout=open(self.tmp / "lighthouse.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:  # the lighthouse's port accepts
            try:
                socket.create_connection(("localhost", self.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and self.lighthouse.poll() is None, "the lighthouse did not start"
                time.sleep(0.2)

    def restart_lighthouse(self, down_s: float) -> None:
        """SIGKILL the lighthouse, and start a new one on its port ``down_s`` seconds later."""
        os.killpg(self.lighthouse.pid, signal.SIGKILL)
        self.lighthouse.wait(timeout=60)
        time.sleep(down_s)
        self._start_lighthouse()

    def args(self, replica: int, *more: str) -> list[str]:
        return [*TINY, "--train-iters", str(self.iters), "--lr-decay-iters", str(self.iters),
                "--diloco-replicas", str(self.replicas), "--diloco-inner-steps", str(H), "--diloco-outer-bits", "4",
                "--diloco-lighthouse", self.address, "--diloco-replica-id", str(replica), *TIMEOUTS, *self.extra,
                *more]

    def start(self, name: str, replica: int, *more: str, nproc: int = 1, env: dict = None) -> subprocess.Popen:
        cmd, base = torchrun_command(nproc, self.args(replica, *more), self.cache, self.tmp / f"{name}.jsonl",
                                     script="tests/elastic_check.py")
        # (RUST_LOG as a user has it: unset, unless the test's own environment sets it)
        base.update(LOCO_TEST_DUMP_DIR=str(self.tmp / "dump"), **(env or {}))
        # On the suite's fork server (conftest.start_launch): a replica starts without
        # importing torch and megatron-core again, and runs side by side with the others.
        self.jobs[name] = start_launch(cmd, base, str(self.tmp / f"{name}.log"))
        return self.jobs[name]

    def hold(self, *iterations: int) -> dict:
        """The environment that holds a job after each of ``iterations`` until
        :meth:`start_then_release` lets it go on (tests/elastic_check.py)."""
        return {"LOCO_TEST_HOLD_AT": ",".join(map(str, iterations)), "LOCO_TEST_RELEASE": str(self.tmp / "release")}

    def start_then_release(self, name: str, replica: int, held_at: int, *more: str, nproc: int = 1) -> None:
        """Start a job, wait until it is about to ask for its first quorum, then release the
        jobs held after ``held_at``: the live replicas meet it at their next sync point,
        however long its start-up takes on a loaded machine."""
        pattern = f"replica{replica}_rank0.asking.*"
        asked = set((self.tmp / "dump").glob(pattern))
        self.start(name, replica, *more, nproc=nproc)
        deadline = time.monotonic() + 600
        while not set((self.tmp / "dump").glob(pattern)) - asked:
            assert self.jobs[name].poll() is None, self.log(name)[-3000:]
            assert time.monotonic() < deadline, f"{name} did not start"
            time.sleep(0.2)
        (self.tmp / f"release.{held_at}").touch()

    def metrics(self, name: str) -> list[dict]:
        return read_metrics(self.tmp / f"{name}.jsonl")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def wait_iteration(self, name: str, iteration: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not any(m.get("iteration", 0) >= iteration for m in self.metrics(name)):
            assert self.jobs[name].poll() is None, self.log(name)[-3000:]
            assert time.monotonic() < deadline, f"{name} did not reach iteration {iteration}"
            time.sleep(0.2)

    def wait_held(self, name: str, replica: int, iteration: int, timeout: float = 600) -> None:
        """Wait until job ``name`` (replica ``replica``) is held after ``iteration`` (:meth:`hold`)."""
        deadline = time.monotonic() + timeout
        while not (self.tmp / "dump" / f"replica{replica}_rank0.held.{iteration}").exists():
            assert self.jobs[name].poll() is None, self.log(name)[-3000:]
            assert time.monotonic() < deadline, f"{name} was not held after iteration {iteration}"
            time.sleep(0.2)

    def wait_log(self, name: str, text: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            assert self.jobs[name].poll() is None, self.log(name)[-3000:]
            assert time.monotonic() < deadline, f"{name} did not print {text!r}"
            time.sleep(0.2)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to a replica job: its agent and its workers (each in a session of its own)."""
        proc = self.jobs[name]
        workers = [int(p) for p in pathlib.Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        for pid in [proc.pid, *workers]:
            try:
                os.killpg(os.getpgid(pid), sig)
            except ProcessLookupError:
                pass

    def kill(self, name: str) -> None:
        """SIGKILL a replica job (:meth:`signal`) and reap it."""
        self.signal(name, signal.SIGKILL)
        self.jobs[name].wait(timeout=60)

    def finish(self, name: str, timeout: float = 900) -> int:
        return self.jobs[name].wait(timeout=timeout)

    def dumps(self, replica: int, rank: int = 0) -> list[dict]:
        path = self.tmp / "dump" / f"replica{replica}_rank{rank}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def close(self) -> None:
        for proc in [*self.jobs.values(), self.lighthouse]:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in [*self.jobs.values(), self.lighthouse]:
            proc.wait(timeout=60)


def _committed(dumps: list[dict]) -> dict[int, dict]:
    """iteration -> the last record of a cycle at that iteration (after its commit)."""
    return {d["iteration"]: d for d in dumps if d["at"] in ("cycle", "join")}


@pytest.fixture(scope="module")
def kill_and_rejoin(cache_dir, tmp_path_factory) -> dict:
    """3 replica jobs of one rank: replica 2 is SIGKILLed mid-interval after iteration 6
    and restarted from its own checkpoint of iteration 4 once the others are past 14. The
    others wait after step 15 until the restarted job is about to ask for a quorum (its
    start-up on a loaded machine can take longer than their remaining steps)."""
    tmp = tmp_path_factory.mktemp("elastic")
    run = Run(tmp, cache_dir, replicas=3, iters=28, extra=["--global-batch-size", "12"])  # a share for each of 3
    hold = run.hold(15)
    try:
        for r in range(3):
            run.start(f"r{r}", r, "--save", str(tmp / f"ck{r}"), "--save-interval", "4", env=hold)
        for r in range(3):
            run.wait_iteration(f"r{r}", 1)
        run.wait_iteration("r2", 6)
        killed_at = max(m["iteration"] for m in run.metrics("r2") if "iteration" in m)
        run.kill("r2")
        run.wait_iteration("r0", 14)
        run.start_then_release("r2b", 2, 15, "--load", str(tmp / "ck2"), "--save", str(tmp / "ck2"),
                               "--save-interval", "4")
        codes = {name: run.finish(name) for name in ("r0", "r1", "r2b")}
        return {"run": run, "codes": codes, "killed_at": killed_at}
    finally:
        run.close()


def test_survivors_train_on_and_agree_when_a_replica_dies(kill_and_rejoin):
    """Guards against one replica's death stopping or stalling the others (one failure
    domain), against survivors whose agreed parameters drift apart once the quorum shrinks,
    and against a dead replica never being dropped: replicas 0 and 1 train to the end
    (every iteration logged, loss falling), no step of theirs waits longer than the quorum
    timeout plus one exchange's, each says replica 2 left, and after every outer step they
    hold bit-identical agreed parameters and outer momentum. Also against torchft's Rust
    INFO lines (several per quorum, on every rank) flooding a replica's console when the
    user has no RUST_LOG: none reaches any replica's log. And against the 4-bit outer
    exchange's error buffers reset without a line when it is re-laid for fewer replicas."""
    run, codes = kill_and_rejoin["run"], kill_and_rejoin["codes"]
    assert codes["r0"] == 0 and codes["r1"] == 0, (run.log("r0")[-2000:], run.log("r1")[-2000:])
    for name in ("r0", "r1"):
        losses = train_losses(run.metrics(name))
        assert sorted(losses) == list(range(1, run.iters + 1)), name
        assert losses[run.iters] < losses[kill_and_rejoin["killed_at"]] - 0.05, losses
        steps = [m["train/step_s"] for m in run.metrics(name) if "train/step_s" in m and m["iteration"] != 15]
        assert max(steps) < 120 + 20, max(steps)  # --diloco-quorum-timeout-s + --diloco-exchange-timeout-s
        assert "replica 2 left" in run.log(name), run.log(name)[-3000:]
        assert ("DiLoCo: 2 replica(s) take part (were 3): the outer exchange is re-laid for them, its error "
                "buffers start at zero") in run.log(name), run.log(name)[-3000:]
    for name in ("r0", "r1", "r2b"):  # torchft's own log lines stay off without RUST_LOG
        assert "torchft::" not in run.log(name), [ln for ln in run.log(name).splitlines() if "torchft::" in ln][:3]
    a, b = _committed(run.dumps(0)), _committed(run.dumps(1))
    common = sorted(set(a) & set(b))
    assert len(common) >= run.iters // H - 1, common
    for it in common:
        assert (a[it]["agreed"], a[it]["momentum"]) == (b[it]["agreed"], b[it]["momentum"]), it
    assert a[run.iters]["outer_steps"] >= run.iters // H - 1


def test_a_restarted_replica_heals_and_then_agrees_bit_for_bit(kill_and_rejoin):
    """Guards against a restarted replica that resumes its own stale state (its checkpoint
    of iteration 4 while the others are past 14), re-trains or skips its samples, or ends
    up with agreed parameters or momentum of its own: it heals from a live replica at the
    next outer step (the agreed parameters, momentum, iteration and LR schedule over
    torchft's transport; its inner optimizer from its own checkpoint; one line each), the
    others see it join, from then on its agreed parameters and momentum equal theirs bit
    for bit after every outer step, and every step it trains reads replica 2's own samples
    of that iteration (samples 8 ... 11 of the global batch of 12, position iteration x
    global batch)."""
    run = kill_and_rejoin["run"]
    log = run.log("r2b")
    assert kill_and_rejoin["codes"]["r2b"] == 0, log[-3000:]
    assert "DiLoCo: healed from replica" in log and "the inner optimizer state is this replica's own" in log, log
    assert "replica 2 joined" in run.log("r0")
    dumps = run.dumps(2)
    rejoin = [d for d in dumps if d["at"] == "join"][-1]  # (the first join is the killed run's)
    assert rejoin["iteration"] > 14, rejoin
    mine, theirs = _committed(dumps), _committed(run.dumps(0))
    after = sorted(it for it in set(mine) & set(theirs) if it >= rejoin["iteration"])
    assert after and after[-1] >= run.iters - H, after
    for it in after:
        assert (mine[it]["agreed"], mine[it]["momentum"]) == (theirs[it]["agreed"], theirs[it]["momentum"]), it
    restarted = [d for d in dumps if dumps.index(d) >= dumps.index(rejoin)]
    steps = [s for d in restarted for s in d["steps"]]
    gbs = 12
    assert steps and steps[0][0] == rejoin["iteration"] * gbs, steps[:2]
    assert all(s[1:] == [8, 4, 0, 1] for s in steps) and all(b[0] - a[0] == gbs for a, b in zip(steps, steps[1:]))
    tokens = next(m for m in run.metrics("r2b") if "summary/tokens" in m)["summary/tokens"]
    assert tokens == len(steps) * gbs // 3 * 64, tokens  # this replica's share of each step it trained


def _trained(dumps: list[dict], gbs: int) -> dict[int, list[tuple[int, int]]]:
    """iteration (1-based) -> the sample ranges [first, end) of its global batch a job trained."""
    out: dict[int, list] = {}
    for d in dumps:
        for consumed, offset, samples, _, _ in d.get("steps", []):
            out.setdefault(consumed // gbs + 1, []).append((offset, offset + samples))
    return out


def test_unequal_shares_cover_each_batch_once_through_a_death_and_a_rejoin(cache_dir, tmp_path):
    """Guards against replicas of unequal shares (--diloco-batch-split weight, weights 2 and
    1) that train a sample twice or skip one, that keep a dead replica's share unassigned,
    that disagree on the split (their ranks would read different samples) or on the agreed
    parameters: the shares are 8 and 4 of each global batch of 12, disjoint and covering it;
    when replica 1 dies the survivor takes the whole batch from its next outer step; when
    replica 1 restarts from its checkpoint it heals, the split is 8 and 4 again from the
    outer step it joins at, and its agreed parameters equal the survivor's bit for bit
    after every outer step. Each replica reports its batch share, its time at outer steps
    and its inner steps. With --diloco-sync-delay 1 (replica 1's checkpoint at 4 is written
    with the exchange of 4 in flight; it heals past it) and the survivor's exchange of the
    cycle at 20 lost (discarded on both at 21)."""
    gbs = 12
    run = Run(tmp_path, cache_dir, replicas=2, iters=24,
              extra=["--global-batch-size", str(gbs), "--diloco-batch-split", "weight", "--diloco-sync-delay", "1"])
    try:
        run.start("r0", 0, "--diloco-replica-weight", "2", env={**run.hold(15), "LOCO_TEST_FAULTS": "outer@20=lost"})
        run.start("r1", 1, "--save", str(tmp_path / "ck1"), "--save-interval", "4")
        run.wait_iteration("r1", 6)
        run.kill("r1")
        run.wait_iteration("r0", 14)
        run.start_then_release("r1b", 1, 15, "--load", str(tmp_path / "ck1"))
        codes = {name: run.finish(name) for name in ("r0", "r1b")}
        assert codes == {"r0": 0, "r1b": 0}, (run.log("r0")[-3000:], run.log("r1b")[-3000:])
    finally:
        run.close()
    log0 = run.log("r0")
    splits = [ln.split("DiLoCo: ", 1)[1] for ln in log0.splitlines() if "DiLoCo: batch split" in ln]
    assert splits[0] == "batch split from iteration 0: replica 0 8, replica 1 4 samples per step (weights 2, 1)", splits
    assert any(ln.endswith("replica 0 12 samples per step (weights 2)") for ln in splits), splits
    assert splits[-1].endswith("replica 0 8, replica 1 4 samples per step (weights 2, 1)"), splits
    ones = run.dumps(1)
    rejoin = [d for d in ones if d["at"] == "join"][-1]
    mine, theirs = _committed(ones), _committed(run.dumps(0))
    after = sorted(it for it in set(mine) & set(theirs) if it >= rejoin["iteration"])
    assert after and after[-1] >= run.iters - H, after
    assert all(mine[it]["agreed"] == theirs[it]["agreed"] and mine[it]["momentum"] == theirs[it]["momentum"]
               for it in after)
    zero, one = _trained(run.dumps(0), gbs), _trained(ones, gbs)
    assert sorted(zero) == list(range(1, run.iters + 1)), sorted(zero)
    for it in range(1, run.iters + 1):
        ranges = sorted(zero.get(it, []) + one.get(it, []))
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), (it, ranges)  # never a sample twice
        if it > rejoin["iteration"] or it <= 4:  # both live: the shares cover the batch
            assert ranges == [(0, 8), (8, 12)], (it, ranges)
    assert any(d["at"] == "fault" and d["iteration"] == 20 for d in run.dumps(0))
    assert "DiLoCo: the outer step was discarded (RuntimeError: injected loss" in log0, log0[-3000:]
    alone = [it for it in zero if zero[it] == [(0, 12)]]
    assert alone and max(alone) <= rejoin["iteration"] and min(alone) > 6, alone  # after the death, before the rejoin
    shares = {m["diloco/share_samples"] for m in run.metrics("r0") if "diloco/share_samples" in m}
    assert {8.0, 12.0} <= shares, shares
    assert all(m["diloco/outer_wait_s"] >= 0 and 0 <= m["diloco/outer_wait_share"] <= 1
               for m in run.metrics("r0") if "diloco/outer_wait_s" in m)
    summary = next(m for m in run.metrics("r1b") if "summary/diloco_inner_steps" in m)
    assert summary["summary/diloco_inner_steps"] == run.iters - rejoin["iteration"], summary
    assert summary["summary/tokens"] == sum(b - a for it in one if it > rejoin["iteration"] for a, b in one[it]) * 64
    assert "inner steps" in run.log("r1b") and "s at outer steps" in run.log("r1b")


def test_replicas_of_different_layouts_train_one_model_bit_for_bit(cache_dir, tmp_path):
    """Guards against replicas of different layouts exchanging mismatched elements (rank k
    of a TP 2 replica holds other parts of the model than rank k of a one-rank replica),
    against their different initial weights (megatron seeds each TP slice apart) never
    being reconciled, and against shares that overlap when the replicas' steps differ: a
    2-rank TP 2 replica (weight 2) and a 1-rank replica exchange over one lane each
    (--diloco-outer-ranks 1); their agreed parameters and momentum are bit-identical from
    the start and after every outer step, and their shares (8 and 4 of 12) tile each batch."""
    gbs = 12
    run = Run(tmp_path, cache_dir, replicas=2, iters=12,
              extra=["--global-batch-size", str(gbs), "--diloco-batch-split", "weight", "--diloco-outer-ranks", "1"])
    try:
        run.start("r0", 0, "--tensor-model-parallel-size", "2", "--diloco-replica-weight", "2", nproc=2)
        run.start("r1", 1)
        codes = [run.finish("r0"), run.finish("r1")]
        assert codes == [0, 0], (run.log("r0")[-3000:], run.log("r1")[-3000:])
    finally:
        run.close()
    a, b = run.dumps(0), run.dumps(1)
    joined = [d for d in a if d["at"] == "join"][-1], [d for d in b if d["at"] == "join"][-1]
    assert joined[0]["agreed"] == joined[1]["agreed"], joined  # the start: one model
    ca, cb = _committed(a), _committed(b)
    assert {4, 8, 12} <= set(ca) & set(cb)
    for it in (4, 8, 12):
        assert (ca[it]["agreed"], ca[it]["momentum"]) == (cb[it]["agreed"], cb[it]["momentum"]), it
        assert ca[it]["outer_steps"] == cb[it]["outer_steps"] == it // H
    finals = [d for d in a if d["at"] == "final"][-1], [d for d in b if d["at"] == "final"][-1]
    assert finals[0]["agreed"] == finals[1]["agreed"]
    zero, one = _trained(a, gbs), _trained(b, gbs)
    assert all(sorted(zero[it] + one[it]) == [(0, 8), (8, 12)] for it in range(1, 13)), (zero, one)
    assert "batch split from iteration 0: replica 0 8, replica 1 4 samples per step (weights 2, 1)" in run.log("r0")


def test_an_unequal_replica_killed_and_restarted_in_another_layout_heals_and_agrees(cache_dir, tmp_path):
    """Guards against a replica that cannot come back in another layout (its checkpoint and
    the heal are in its old shards), or that comes back with a stale share of the batch:
    a TP 2 replica is killed, restarted as DP 2 from its own checkpoint, heals from the
    one-rank replica (--diloco-batch-split throughput, --diloco-outer-ranks 1), and from the
    outer step it joins at their agreed parameters are bit-identical and their shares tile
    each batch (whole micro batches on each of its 2 data-parallel ranks)."""
    gbs = 12
    run = Run(tmp_path, cache_dir, replicas=2, iters=20,
              extra=["--global-batch-size", str(gbs), "--diloco-batch-split", "throughput", "--diloco-outer-ranks", "1"])
    try:
        run.start("r0", 0, "--tensor-model-parallel-size", "2", "--save", str(tmp_path / "ck0"), "--save-interval", "4",
                  nproc=2)
        run.start("r1", 1, env=run.hold(11))
        run.wait_iteration("r0", 5)
        run.kill("r0")
        run.wait_iteration("r1", 10)
        run.start_then_release("r0b", 0, 11, "--load", str(tmp_path / "ck0"), nproc=2)
        codes = [run.finish("r0b"), run.finish("r1")]
        assert codes == [0, 0], (run.log("r0b")[-3000:], run.log("r1")[-3000:])
    finally:
        run.close()
    log = run.log("r0b")
    assert "DiLoCo: healed from replica 1" in log, log[-3000:]
    zeros, ones = run.dumps(0), run.dumps(1)
    rejoin = [d for d in zeros if d["at"] == "join"][-1]
    assert rejoin["iteration"] >= 12, rejoin
    mine, theirs = _committed(zeros), _committed(ones)
    after = sorted(it for it in set(mine) & set(theirs) if it >= rejoin["iteration"])
    assert after and after[-1] == run.iters, after
    assert all((mine[it]["agreed"], mine[it]["momentum"]) == (theirs[it]["agreed"], theirs[it]["momentum"])
               for it in after)
    restarted = [d for d in zeros if zeros.index(d) >= zeros.index(rejoin)]
    steps = [s for d in restarted for s in d["steps"]]
    assert steps and all(s[4] == 2 and s[2] % 4 == 0 for s in steps), steps[:3]  # DP 2: whole micro batches each
    zero, one = _trained(restarted, gbs), _trained(ones, gbs)
    for it in range(rejoin["iteration"] + 1, run.iters + 1):
        spans = sorted(set(zero[it]) | set(one[it]))
        assert spans[0][0] == 0 and spans[-1][1] == gbs and all(x[1] == y[0] for x, y in zip(spans, spans[1:])), spans


def test_a_saved_split_this_layout_cannot_train_is_dropped_in_one_line(cache_dir, tmp_path):
    """Guards against a restart in another layout that takes its checkpoint's batch share
    as it was saved: a TP 2 replica (granule 2) saved 6 of each 12 samples under the
    ``weight`` split; restarted at DP 2 (whole micro batches of 2 on 2 ranks: granule 4) it
    crashed at start-up pushing 6 samples into its data iterator. The share is dropped in
    one line, the replica heals, and the run ends with both replicas agreeing."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=16,
              extra=["--global-batch-size", "12", "--diloco-batch-split", "weight"])
    try:
        run.start("r0", 0, "--tensor-model-parallel-size", "2", "--save", str(tmp_path / "ck0"), "--save-interval", "4",
                  nproc=2)
        run.start("r1", 1, env=run.hold(7))
        run.wait_iteration("r0", 5)
        run.kill("r0")
        run.wait_iteration("r1", 6)
        run.start_then_release("r0b", 0, 7, "--load", str(tmp_path / "ck0"), nproc=2)
        codes = [run.finish("r0b"), run.finish("r1")]
        assert codes == [0, 0], (run.log("r0b")[-3000:], run.log("r1")[-3000:])
    finally:
        run.close()
    log = run.log("r0b")
    line = ("DiLoCo: the checkpoint's batch split gives this replica 6 samples, not whole shares of 4 in this layout: "
            "dropped, the replicas split the batch anew at the next outer step")
    assert log.count(line) == 1 and "DiLoCo: healed from replica 1" in log, log[-3000:]
    mine, theirs = _committed(run.dumps(0)), _committed(run.dumps(1))
    assert mine[run.iters]["agreed"] == theirs[run.iters]["agreed"], (mine[run.iters], theirs[run.iters])


def test_a_replica_dying_inside_an_exchange_is_discarded_everywhere(cache_dir, tmp_path):
    """Guards against a half-applied outer step when a replica dies in the middle of an
    exchange (phase 1 launched, its peer waiting on it): the survivor discards that outer
    step (agreed parameters, momentum and outer-step count as before it), says so, and
    the next outer step goes on without the dead replica."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=16)
    try:
        run.start("r0", 0)
        run.start("r1", 1, env={"LOCO_TEST_DIE_IN_EXCHANGE": "8"})
        code = run.finish("r0")
        assert code == 0, run.log("r0")[-3000:]
        assert run.jobs["r1"].wait(timeout=120) != 0
    finally:
        run.close()
    log = run.log("r0")
    assert "the outer step was discarded" in log, log[-3000:]
    cycles = _committed(run.dumps(0))
    assert (cycles[8]["agreed"], cycles[8]["momentum"], cycles[8]["outer_steps"]) == \
        (cycles[4]["agreed"], cycles[4]["momentum"], cycles[4]["outer_steps"]), cycles
    assert cycles[12]["outer_steps"] == cycles[8]["outer_steps"] + 1 and cycles[12]["live"] == [0], cycles[12]
    assert sorted(train_losses(run.metrics("r0"))) == list(range(1, 17))


def test_two_ranks_per_replica_exchange_rank_by_rank(cache_dir, tmp_path):
    """Guards against rank k of one replica meeting another rank than rank k of the others
    (each holds its own shard of the optimizer), and against the replica's own world and
    the torchft groups getting in each other's way: 2 replica jobs of 2 ranks (inner DP 2)
    train to the end, and after every outer step rank 0 holds the same agreed parameters in
    both replicas, and so does rank 1, while ranks 0 and 1 hold different shards."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=12, extra=["--diloco-outer-ranks", "2"])
    try:
        for r in range(2):
            run.start(f"r{r}", r, nproc=2)
        codes = [run.finish(f"r{r}") for r in range(2)]
        assert codes == [0, 0], (run.log("r0")[-3000:], run.log("r1")[-3000:])
    finally:
        run.close()
    for rank in (0, 1):
        a, b = _committed(run.dumps(0, rank)), _committed(run.dumps(1, rank))
        assert {4, 8, 12} <= set(a) & set(b)
        assert all(a[it]["agreed"] == b[it]["agreed"] for it in (4, 8, 12))
    assert _committed(run.dumps(0, 0))[12]["agreed"] != _committed(run.dumps(0, 1))[12]["agreed"]


def test_bad_replicas_are_refused_in_one_line_and_the_run_goes_on(cache_dir, tmp_path):
    """Guards against a second job with a replica id already live, or a replica with
    another model shape, joining the run (torchft itself tells neither apart: a duplicate
    id gets a fresh suffix, and collectives of mismatched sizes abort the process): each is
    refused with one line naming the problem (the worker's exit status 2; what differs, by
    name) when it meets the live replica, which trains on to the end."""
    # (quorum timeout 30 s: the live job waits that long at the start for the replica expected)
    run = Run(tmp_path, cache_dir, replicas=2, iters=40, extra=["--diloco-quorum-timeout-s", "30"])
    try:
        run.start("live", 0, env=run.hold(3, 7))
        run.wait_log("live", "DiLoCo: waiting for the 2 replicas expected")  # its first cycle is done
        run.start_then_release("duplicate", 0, 3)
        assert run.jobs["duplicate"].wait(timeout=600) != 0, run.log("duplicate")[-3000:]  # (torchrun: 1)
        run.start_then_release("other_shape", 1, 7, "--hidden-size", "128")
        assert run.jobs["other_shape"].wait(timeout=600) != 0, run.log("other_shape")[-3000:]
        assert run.finish("live") == 0, run.log("live")[-3000:]
    finally:
        run.close()
    for name, line in (("duplicate", "pretrain_gpt.py: error: --diloco-replica-id 0: another live job already runs "
                                     "as replica 0 (each replica id once)"),
                       ("other_shape", "pretrain_gpt.py: error: --diloco-replica-id 1: the model (its tensors' names "
                                       "and shapes) differs from the run's (replica 0's; every replica must use the "
                                       "same)")):
        errors = [ln for ln in run.log(name).splitlines() if "pretrain_gpt.py: error:" in ln]
        assert errors and all(ln.endswith(line.split("error: ", 1)[1]) for ln in errors), run.log(name)[-3000:]
    assert sorted(train_losses(run.metrics("live"))) == list(range(1, 41))


def test_an_unreachable_lighthouse_is_one_line_within_seconds(tmp_path, cache_dir):
    """Guards against a replica that hangs (or tracebacks) when the lighthouse is not up: one
    line naming the address, exit 2, long before any quorum timeout would fire."""
    port = free_port()
    args = [*TINY, "--train-iters", "4", "--diloco-replicas", "2", "--diloco-lighthouse", f"http://localhost:{port}",
            "--diloco-replica-id", "0"]
    cmd, env = torchrun_command(1, args, cache_dir, tmp_path / "m.jsonl")
    t0 = time.monotonic()
    proc = run_launch(cmd, env, 300)  # on the suite's fork server: the run ends by itself
    assert proc.returncode != 0 and time.monotonic() - t0 < 240
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("pretrain_gpt.py: error:")]
    assert lines == [f"pretrain_gpt.py: error: --diloco-lighthouse: http://localhost:{port} cannot be reached "
                     f"([Errno 111] Connection refused); start it with torchft_lighthouse --min_replicas 1 --bind "
                     f"[::]:PORT (docs/diloco.md)"], proc.stderr[-2000:]


def test_refusal_keeps_the_job_that_was_there_first():
    """Guards against a second job started with a live replica's id (or another model
    shape) displacing the live one: at the start of a run both sit at iteration 0 and
    joining, and the tie went to whichever torchft ranked first, so the live job was
    refused and the newcomer trained on. The job that opened more cycles stays; a
    participant further on in iterations stays over any newcomer."""
    from loco_megatron.diloco.elastic.cycle import Fingerprint, refusal

    def refused(*ps: Fingerprint) -> tuple[str, set]:
        return refusal(list(ps), 12)

    live, newcomer = Fingerprint(0, 7, 0, True, cycles=5), Fingerprint(0, 7, 0, True, cycles=0)
    for order in ((newcomer, live), (live, newcomer)):
        line, ranks = refused(*order)
        assert "another live job already runs as replica 0" in line and ranks == {order.index(newcomer)}
    line, ranks = refused(Fingerprint(1, 9, 0, True, cycles=0), Fingerprint(0, 7, 0, True, cycles=3))
    assert line.startswith("--diloco-replica-id 1: its model shape or outer settings differ") and ranks == {0}
    line, ranks = refused(Fingerprint(1, 7, 0, True, cycles=50), Fingerprint(0, 9, 12, False, cycles=2))
    assert line.startswith("--diloco-replica-id 1:") and ranks == {0}  # the one 12 iterations on is the run
    assert refused(Fingerprint(0, 7, 4, False, cycles=1), Fingerprint(1, 7, 4, False, cycles=1)) == ("", set())
    line, ranks = refused(Fingerprint(1, 7, 0, True, cycles=0, lanes=2), Fingerprint(0, 7, 0, True, cycles=3, lanes=1))
    assert line.startswith("--diloco-replica-id 1: --diloco-outer-ranks 2 differs from the run's 1") and ranks == {0}


def test_an_elastic_jobs_batch_line_is_its_share_of_the_global_batch():
    """Guards against the start-up batch line of a replica job describing the whole global
    batch (`micro 2 x 6 micro batches x DP 1 = global 12 samples`) while the job trains on
    its share (12 / 3 replicas = 4 samples in 2 micro batches), which made its tokens per
    step and the run summary's token count disagree by the replica count."""
    from loco_megatron.cli import parse_config
    from loco_megatron.training import summary

    argv = ["--global-batch-size", "12", "--micro-batch-size", "2", "--diloco-replicas", "3"]
    one_job = parse_config(argv)
    assert summary.batch_line(one_job, 3) == "batch: micro 2 x 2 micro batches x DP 3 = global 12 samples = " \
        f"{12 * one_job.model.seq_length:,} tokens per step"
    elastic = parse_config([*argv, "--diloco-replica-id", "1", "--diloco-lighthouse", "http://localhost:1"])
    assert summary.batch_line(elastic, 1) == (
        f"batch: micro 2 x 2 micro batches x DP 1 = 4 samples = {4 * elastic.model.seq_length:,} tokens per step "
        "in this replica job (global 12 over 3 replica jobs)")


def test_torchft_logs_follow_the_users_rust_log_only():
    """Guards against a user's RUST_LOG being overridden (a user debugging torchft asks for
    its INFO lines) and against torchft's default, which prints them, when none is set."""
    from loco_megatron.cli import LaunchEnv

    assert LaunchEnv.from_environ({}).torchft_log == "error"
    assert LaunchEnv.from_environ({"RUST_LOG": "torchft=info"}).torchft_log == "torchft=info"
