"""Elastic DiLoCo when things go wrong (real torchrun replica jobs and a real torchft
Lighthouse, gloo): Streaming DiLoCo across unequal sites, a failure injected into each
exchange, ranks that arrive late, a lighthouse that dies mid-quorum, too few replicas for
an outer step, every job killed and restarted, bad joiners and late starters.

The elastic part of the combination matrix: each failure runs with other features on, so
that elastic DiLoCo meets each of them under some failure (tests/test_elastic.py adds a
replica killed mid-interval and rejoining, one dying inside an exchange, a restart in
another layout, duplicate ids and another model shape):

=========================  ===========================  =========  ====  ===========  ==========
test                       layouts (ranks)              fragments  tau   inner LoCo   split
=========================  ===========================  =========  ====  ===========  ==========
streaming / run ended      TP2 (2) + 1                  2          0     -            weight
each exchange failing      DP2 (2) + 1                  1          0     4-bit        weight
late ranks                 DP2 (2) + DP2 (2), 2 lanes   1          0     4-bit        throughput
lighthouse restart         1 + 1                        2          1     -            fixed
a replica stalls           1 + 1                        1          0     -            fixed
too few replicas           1                            1          0     -            fixed
whole-run restart          TP2 (2) + 1                  1          0     -            fixed
bad joiner                 DP2 (2) + micro 6 (1)        1          0     -            weight
=========================  ===========================  =========  ====  ===========  ==========
"""

from __future__ import annotations

import http.server
import signal
import subprocess
import sys
import threading
import time

from conftest import REPO, run_launch, torchrun_command, train_losses
from test_elastic import Run, _committed, _trained

GBS = 12


def _bit_identical(a: list[dict], b: list[dict], since: int = 0) -> list[int]:
    """The cycle iterations both dumps hold from ``since`` on, asserting each is bit-identical
    (agreed parameters, momentum, outer steps)."""
    ca, cb = _committed(a), _committed(b)
    common = sorted(it for it in set(ca) & set(cb) if it >= since)
    for it in common:
        assert (ca[it]["agreed"], ca[it]["momentum"], ca[it]["outer_steps"]) == \
            (cb[it]["agreed"], cb[it]["momentum"], cb[it]["outer_steps"]), (it, ca[it], cb[it])
    return common


def _tiled(zero: dict, one: dict, iterations, gbs: int = GBS) -> None:
    """Every iteration's shares of the two replicas tile the global batch: no sample twice, none skipped."""
    for it in iterations:
        spans = sorted(zero.get(it, []) + one.get(it, []))
        assert spans and spans[0][0] == 0 and spans[-1][1] == gbs and all(
            x[1] == y[0] for x, y in zip(spans, spans[1:])), (it, spans)


def test_streaming_diloco_across_unequal_sites_and_a_replica_after_the_end(cache_dir, tmp_path):
    """Guards against --diloco-fragments with --diloco-lighthouse crashing at start-up (each
    fragment's lanes claimed the whole tensor megatron stacks the layers in), against
    replicas of different layouts drifting apart fragment by fragment, and against shares
    that do not tile the batch: a TP 2 replica (weight 2) and a one-rank replica train with
    2 fragments (a fragment syncs every 2 steps), both losses fall to within 0.2 of each
    other, after every cycle their agreed parameters and momentum are bit-identical, and
    their shares (8 and 4) tile every batch. Also against a replica started after the run
    ended waiting out the quorum timeout and training alone from scratch: it says the run
    already reached its last iteration, in one line, without training."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=12,
              extra=["--global-batch-size", str(GBS), "--diloco-batch-split", "weight", "--diloco-fragments", "2",
                     "--diloco-quorum-timeout-s", "600"])
    try:
        run.start("r0", 0, "--tensor-model-parallel-size", "2", "--diloco-replica-weight", "2", nproc=2)
        run.start("r1", 1)
        codes = [run.finish("r0"), run.finish("r1")]
        assert codes == [0, 0], (run.log("r0")[-3000:], run.log("r1")[-3000:])
        t0 = time.monotonic()
        run.start("late", 1)
        assert run.finish("late", timeout=300) != 0 and time.monotonic() - t0 < 300
    finally:
        run.close()
    cycles = _bit_identical(run.dumps(0), run.dumps(1))
    assert cycles == [0, 2, 4, 6, 8, 10, 12], cycles
    assert _committed(run.dumps(0))[12]["outer_steps"] == 6  # (one fragment per cycle)
    finals = [d for d in run.dumps(0) if d["at"] == "final"][-1], [d for d in run.dumps(1) if d["at"] == "final"][-1]
    assert finals[0]["agreed"] == finals[1]["agreed"]
    _tiled(_trained(run.dumps(0), GBS), _trained(run.dumps(1), GBS), range(1, 13))
    losses = [train_losses(run.metrics(name)) for name in ("r0", "r1")]
    for curve in losses:
        assert curve[12] < curve[1] - 0.1, curve
    assert abs(losses[0][12] - losses[1][12]) < 0.2, losses
    errors = [ln for ln in run.log("late").splitlines() if "pretrain_gpt.py: error:" in ln]
    assert errors and all("has already reached iteration 12 (its last quorum), and --train-iters is 12: nothing is "
                          "left to train" in ln for ln in errors), run.log("late")[-3000:]
    assert "iter 1/" not in run.log("late")


def test_a_failure_of_each_exchange_is_discarded_everywhere(cache_dir, tmp_path):
    """Guards against a failed exchange that some replicas keep and others do not, or that
    reaches the model, the outer state, the error buffers or the batch split: replica 1
    (one rank) and replica 0 (DP 2, 4-bit LoCo inside it) start from different states
    (replica 1's is moved); on replica 1 the
    first agreement on one model is lost (it completes, then fails there only), later a
    fingerprint gather is lost, an outer exchange fails before it is sent (the peer waits
    it out) and another is lost; on replica 0 one more is lost. The agreement and the
    cycle of the lost gather are asked again on both replicas before anyone trains on (the
    second tries commit); each failed outer exchange is discarded on both (no outer step
    counted anywhere); after every cycle the two hold bit-identical agreed parameters,
    momentum and outer-step counts, both train to the end, and the shares tile every batch."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=24,
              extra=["--global-batch-size", str(GBS), "--diloco-batch-split", "weight",
                     "--diloco-exchange-timeout-s", "20"])
    try:
        run.start("r0", 0, "--loco-bits", "4", "--diloco-replica-weight", "2", nproc=2,
                  env={"LOCO_TEST_FAULTS": "outer@16=lost"})
        run.start("r1", 1, env={"LOCO_TEST_FAULTS": "agreement@0=lost,fingerprint@4=lost,outer@8=raise,outer@12=lost",
                                "LOCO_TEST_PERTURB": "1"})
        codes = [run.finish("r0"), run.finish("r1")]
        assert codes == [0, 0], (run.log("r0")[-3000:], run.log("r1")[-3000:])
    finally:
        run.close()
    zeros, ones = run.dumps(0), run.dumps(1)
    assert [(d["phase"], d["iteration"]) for d in ones if d["at"] == "fault"] == \
        [("agreement", 0), ("fingerprint", 4), ("outer", 8), ("outer", 12)], ones
    assert [(d["phase"], d["iteration"]) for d in zeros if d["at"] == "fault"] == [("outer", 16)]
    joined = [d for d in zeros if d["at"] == "join"][-1], [d for d in ones if d["at"] == "join"][-1]
    assert joined[0]["agreed"] == joined[1]["agreed"] and joined[0]["outer_steps"] == 0, joined
    cycles = _bit_identical(zeros, ones)
    assert cycles == [0, 4, 8, 12, 16, 20, 24], cycles
    steps = {it: d["outer_steps"] for it, d in _committed(zeros).items()}
    assert [steps[it] for it in (4, 8, 12, 16, 20, 24)] == [1, 1, 1, 1, 2, 3], steps
    for name in ("r0", "r1"):
        assert sorted(train_losses(run.metrics(name))) == list(range(1, 25))
        assert "agreement on one model at iteration 0 was discarded" in run.log(name), run.log(name)[-3000:]
        assert "DiLoCo: replicas 0, 1 start from replica 0's initial weights" in run.log(name)
        assert run.log(name).count("DiLoCo: the outer step was discarded") == 3, run.log(name)[-4000:]
        assert run.log(name).count("DiLoCo: the cycle at iteration 4 failed") == 1, run.log(name)[-4000:]
    _tiled(_trained(zeros, GBS), _trained(ones, GBS), range(1, 25))


def test_a_rank_that_arrives_late_never_changes_the_collective_order(cache_dir, tmp_path):
    """Guards against control decided by each rank's own clock (a rank of a 2-rank replica
    left the join loop while rank 0, which entered it 1.5 s later, opened another cycle: a
    misleading 'no quorum' death, a hang where a rank hosts no lane, a corrupted collective
    on NCCL): in two 2-rank replicas with a lane on each rank, rank 0 of replica 0 starts its
    join 1.5 s late, rank 1 of replica 1 arrives 3 s late at the cycle of iteration 4 and
    rank 1 of replica 0 2 s late at iteration 8; both replicas train to the end and hold
    bit-identical outer state on each lane after every cycle."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=12,
              extra=["--diloco-outer-ranks", "2", "--loco-bits", "4", "--diloco-batch-split", "throughput"])
    try:
        run.start("r0", 0, nproc=2, env={"LOCO_TEST_DELAY": "0:join=1.5,1:8=2"})
        run.start("r1", 1, nproc=2, env={"LOCO_TEST_DELAY": "1:4=3"})
        codes = [run.finish("r0"), run.finish("r1")]
        assert codes == [0, 0], (run.log("r0")[-3000:], run.log("r1")[-3000:])
    finally:
        run.close()
    for rank in (0, 1):
        assert _bit_identical(run.dumps(0, rank), run.dumps(1, rank)) == [0, 4, 8, 12]
    assert _committed(run.dumps(0))[12]["outer_steps"] == 3


def test_a_lighthouse_killed_and_restarted_mid_quorum_costs_at_most_that_outer_step(cache_dir, tmp_path):
    """Guards against a quorum request in flight when the lighthouse dies being waited out
    (--diloco-quorum-timeout-s, then both replicas died and the interval was lost, with a
    line that blamed the lighthouse) and against a restarted lighthouse, which numbers its
    quorums from 1 again, making the replicas reuse the rendezvous keys of an old group
    (Streaming DiLoCo, 2 fragments, each outer step applied one step after it starts):
    replica 0 asks for the quorum of iteration 8 while replica 1 is held; the lighthouse is
    killed, restarted on its port 3 s later, and replica 1 released; both train to the
    end, every outer step from 10 on commits on both, and their outer state is
    bit-identical after every cycle."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=16,
              extra=["--diloco-quorum-timeout-s", "300", "--diloco-fragments", "2", "--diloco-sync-delay", "1"])
    try:
        run.start("r0", 0)
        run.start("r1", 1, env=run.hold(7))
        deadline = time.monotonic() + 600
        while not (tmp_path / "dump" / "replica0_rank0.cycle.8").exists():
            assert time.monotonic() < deadline and run.jobs["r0"].poll() is None, run.log("r0")[-3000:]
            time.sleep(0.2)
        time.sleep(2.0)  # (replica 0's request is with the lighthouse, waiting for replica 1)
        run.restart_lighthouse(down_s=3.0)
        (tmp_path / "release.7").touch()
        codes = [run.finish("r0"), run.finish("r1")]
        assert codes == [0, 0], (run.log("r0")[-3000:], run.log("r1")[-3000:])
    finally:
        run.close()
    cycles = _bit_identical(run.dumps(0), run.dumps(1))
    assert set(range(8, 17)) <= set(cycles), cycles  # (a cycle starts at even iterations, applies at odd ones)
    steps = {it: d["outer_steps"] for it, d in _committed(run.dumps(0)).items()}
    assert steps[16] >= 6 and steps[16] - steps[9] == 3, steps  # (7 in all: at most the one started at 8 lost)
    for name in ("r0", "r1"):
        assert sorted(train_losses(run.metrics(name))) == list(range(1, 17))


def test_a_replica_that_stalls_is_left_behind_and_heals_keeping_its_optimizer(cache_dir, tmp_path):
    """Guards against a stalled replica (every process stopped, as a hung node) holding the
    others back past its heartbeat, against it rejoining on a stale model, and against its
    line saying its inner optimizer state is fresh when it kept it: replica 1 is stopped
    mid-interval until replica 0 has taken its next outer step without it (after asking
    the lighthouse once more); replica 1, continued, heals from replica 0 at a later outer
    step, says its inner optimizer state is its own, kept, and from then on their outer
    state is bit-identical after every cycle; both train to the end."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=20)
    try:
        run.start("r0", 0, env=run.hold(11))  # (held until replica 1 asks again: they must meet after the stall)
        run.start("r1", 1)
        run.wait_iteration("r1", 5)
        run.signal("r1", signal.SIGSTOP)
        run.wait_held("r0", 0, 11)  # (its outer step at 8 went on without replica 1: past the heartbeat timeout)
        run.signal("r1", signal.SIGCONT)
        deadline = time.monotonic() + 600
        while not (tmp_path / "dump" / "replica1_rank0.cycle.8").exists():
            assert time.monotonic() < deadline and run.jobs["r1"].poll() is None, run.log("r1")[-3000:]
            time.sleep(0.2)
        (tmp_path / "release.11").touch()
        codes = [run.finish("r0"), run.finish("r1")]
        assert codes == [0, 0], (run.log("r0")[-3000:], run.log("r1")[-3000:])
    finally:
        run.close()
    assert "replica 1 left" in run.log("r0") and "replica 1 joined" in run.log("r0"), run.log("r0")[-3000:]
    log = run.log("r1")
    assert "DiLoCo: healed from replica 0" in log, log[-3000:]
    assert "DiLoCo: the inner optimizer state is this replica's own, kept from its training so far" in log, log[-3000:]
    healed = next(d for d in run.dumps(1) if d["at"] == "cycle" and d["live"] == [0, 1] and d["iteration"] > 8)
    assert _bit_identical(run.dumps(0), run.dumps(1), since=healed["iteration"])[-1] == 20
    for name in ("r0", "r1"):
        assert sorted(train_losses(run.metrics(name)))[-1] == 20


def test_too_few_replicas_never_end_on_the_initial_weights(cache_dir, tmp_path):
    """Guards against --diloco-min-replicas 2 with one live replica silently losing all
    training: every outer step was discarded, the final step handed every replica the
    initial weights, saved them as the run's result and exited 0. Now each sync point says
    the outer step is withheld, the replica trains on (its loss falls), the run ends in one
    line with a non-zero exit after saving the checkpoint that keeps its training (no
    diloco.final in it), the summary says no outer step committed, and the export refuses
    the checkpoint's agreed model (the initial one)."""
    save = tmp_path / "ck"
    run = Run(tmp_path, cache_dir, replicas=2, iters=8,
              extra=["--diloco-min-replicas", "2", "--diloco-quorum-timeout-s", "5", "--save", str(save)])
    try:
        run.start("r0", 0)
        code = run.finish("r0")
    finally:
        run.close()
    log = run.log("r0")
    assert code != 0, log[-3000:]
    withheld = [ln for ln in log.splitlines() if ln.startswith("DiLoCo: the outer step at iteration")]
    assert withheld == [f"DiLoCo: the outer step at iteration {t} is withheld (1 live replica(s), --diloco-min-replicas "
                        "2): the replicas train on and their progress goes into the next outer step" for t in (4, 8)], \
        log[-3000:]
    errors = [ln for ln in log.splitlines() if ln.startswith("pretrain_gpt.py: error:") or "DiLoCo: the final" in ln]
    assert any("the final outer step at iteration 8 is withheld (1 live replica(s), --diloco-min-replicas 2): the run "
               "has no agreed final model; the checkpoint at iteration 8 keeps this replica's training" in ln
               for ln in errors), log[-3000:]
    assert "took part in 0 of the 0 outer steps committed while it was live (0 in the run)" in log
    losses = train_losses(run.metrics("r0"))
    assert losses[8] < losses[1], losses  # (it trained on)
    folder = save / "iter_0000008"
    assert folder.is_dir()
    export = subprocess.run([sys.executable, "tools/export_hf.py", "--load", str(folder), "--out", str(tmp_path / "hf")],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert export.returncode == 2 and not (tmp_path / "hf").exists(), export.stderr[-2000:]
    assert "holds no trained agreed model: its run committed no outer step yet" in export.stderr, export.stderr[-2000:]


def test_a_whole_run_restart_resumes_at_one_committed_outer_step(cache_dir, tmp_path):
    """Guards against a whole-run restart (every job killed, all restarted with --load) that
    does not come back to the agreed model: the first replica back trained alone, an extra
    momentum-only outer step ran with no training in between, a replica was healed past
    samples nobody trained. Replica 0 (TP 2) saves every 4 steps, replica 1 (one rank)
    every 6; both are held
    after step 10 and killed (checkpoints 8 and 6); replica 0 restarts first and waits for
    the other, replica 1 restarts and (its first heal failing on the way in, asked again)
    heals to replica 0's committed step at 8 (its own steps 7-8 went into that step before
    the kill); no outer step is taken at the
    restart, both train 9-20 on bit-identical outer state, and their shares tile every
    batch from 9 on."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=20)
    ck = [tmp_path / "ck0", tmp_path / "ck1"]
    try:
        run.start("r0", 0, "--tensor-model-parallel-size", "2", "--save", str(ck[0]), "--save-interval", "4",
                  nproc=2, env=run.hold(10))
        run.start("r1", 1, "--save", str(ck[1]), "--save-interval", "6", env=run.hold(10))
        for r, name in enumerate(("r0", "r1")):
            run.wait_held(name, r, 10)
        run.kill("r0")
        run.kill("r1")
        run.start("r0b", 0, "--tensor-model-parallel-size", "2", "--load", str(ck[0]), "--save", str(ck[0]),
                  "--save-interval", "4", nproc=2)
        run.wait_log("r0b", "DiLoCo: waiting for the 2 replicas expected")
        run.start("r1b", 1, "--load", str(ck[1]), "--save", str(ck[1]), "--save-interval", "6",
                  env={"LOCO_TEST_FAULTS": "heal@6=raise"})
        codes = [run.finish("r0b"), run.finish("r1b")]
        assert codes == [0, 0], (run.log("r0b")[-3000:], run.log("r1b")[-3000:])
    finally:
        run.close()
    assert "loading checkpoint" in run.log("r0b") and "iter_0000008" in run.log("r0b")
    assert "DiLoCo: healed from replica 0" in run.log("r1b"), run.log("r1b")[-3000:]
    zeros, ones = run.dumps(0), run.dumps(1)
    restart = [d for d in zeros if d["at"] == "join"][-1], [d for d in ones if d["at"] == "join"][-1]
    assert restart[0]["iteration"] == restart[1]["iteration"] == 8, restart
    assert restart[0]["agreed"] == restart[1]["agreed"] and restart[0]["outer_steps"] == restart[1]["outer_steps"] == 2
    after = [d for d in zeros[zeros.index(restart[0]):]], [d for d in ones[ones.index(restart[1]):]]
    assert _bit_identical(*after) == [8, 12, 16, 20]
    assert _committed(after[0])[20]["outer_steps"] == 5  # 4, 8 before the kill; 12, 16, 20 after: nothing extra
    _tiled(_trained(after[0], 8), _trained(after[1], 8), range(9, 21), gbs=8)  # (fixed: 4 + 4 of TINY's 8)


def test_a_joiner_that_cannot_share_the_batch_ends_alone(cache_dir, tmp_path):
    """Guards against a joiner whose smallest share (micro batch x DP) cannot split the
    global batch with the live replicas' ending the live ones too (both exited 2 with the
    split's error), and against a stack printed on a live replica's ranks: a 2-rank
    replica (DP 2 x micro 2) trains under --diloco-batch-split weight; a joiner with micro
    batch 6 is refused in one line naming its share and exits, and the live replica trains
    on to the end with no traceback on its console."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=16,
              extra=["--global-batch-size", str(GBS), "--diloco-batch-split", "weight",
                     "--diloco-quorum-timeout-s", "20"])
    try:
        run.start("live", 0, nproc=2, env=run.hold(7))
        run.wait_held("live", 0, 7)
        run.start_then_release("bad", 1, 7, "--micro-batch-size", "6")
        assert run.jobs["bad"].wait(timeout=600) != 0, run.log("bad")[-3000:]
        assert run.finish("live") == 0, run.log("live")[-3000:]
    finally:
        run.close()
    line = ("--diloco-replica-id 1: its smallest batch share (micro batch x data-parallel size = 6 samples) and the "
            "run's (4) do not split --global-batch-size 12 into whole shares for 2 replicas")
    errors = [ln for ln in run.log("bad").splitlines() if "pretrain_gpt.py: error:" in ln]
    assert errors and all(ln.endswith(line) for ln in errors), run.log("bad")[-3000:]
    live = run.log("live")
    assert f"DiLoCo: {line}; that replica is refused" in live, live[-3000:]
    assert "Traceback" not in live and "Exception" not in live, live[-3000:]
    assert sorted(train_losses(run.metrics("live"))) == list(range(1, 17))


def test_an_address_that_is_not_a_lighthouse_is_one_line_within_seconds(cache_dir, tmp_path):
    """Guards against a --diloco-lighthouse that points at another HTTP server passing the
    reachability check and leaving the job silent until the quorum timeout: one line saying
    it is not a torchft lighthouse, exit 2, long before any timeout."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"http://127.0.0.1:{server.server_address[1]}"
        args = ["--train-iters", "4", "--diloco-replicas", "2", "--diloco-lighthouse", address,
                "--diloco-replica-id", "0", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "64"]
        cmd, env = torchrun_command(1, args, cache_dir, tmp_path / "m.jsonl")
        t0 = time.monotonic()
        proc = run_launch(cmd, env, 300)
    finally:
        server.shutdown()
    assert proc.returncode != 0 and time.monotonic() - t0 < 240
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("pretrain_gpt.py: error:")]
    assert lines == [f"pretrain_gpt.py: error: --diloco-lighthouse: {address} answers, but not as a torchft "
                     f"lighthouse ({address}/status: HTTP 404); start one with torchft_lighthouse --min_replicas 1 "
                     "--bind [::]:PORT"], (proc.stdout + proc.stderr)[-2000:]
