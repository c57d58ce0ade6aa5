"""Elastic DiLoCo across restarts (real torchrun replica jobs and a real torchft Lighthouse,
gloo): a replica that stalls past its heartbeat, a run with too few replicas for an outer
step, and every job killed and restarted from its checkpoints. The rows marked * of the
elastic matrix in tests/test_elastic_faults.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from conftest import REPO, train_losses
from test_elastic import Run, _committed, _trained
from test_elastic_faults import _bit_identical, _tiled


def test_a_replica_that_stalls_is_left_behind_and_heals_keeping_its_optimizer(cache_dir, tmp_path):
    """Guards against a stalled replica (every process stopped, as a hung node) holding the
    others back past its heartbeat, against it rejoining on a stale model, and against its
    line saying its inner optimizer state is fresh when it kept it: replica 1 is stopped
    mid-interval until replica 0 has taken its next outer step without it (after asking
    the lighthouse once more); replica 1, continued, heals from replica 0 at a later outer
    step, says its inner optimizer state is its own, kept, and from then on their outer
    state is bit-identical after every cycle; both train to the end. Under MuLoCo (Muon
    inner): the kept state is Muon's momentum and its AdamW part's moments. With
    --diloco-sync-delay 2 and replica 0's outer exchange of the cycle at 4 lost (discarded
    at 6, where the stopped replica 1 never votes): the delayed exchanges in flight at the
    stall are discarded on both sides, never half applied."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=20, extra=["--optimizer", "muon", "--diloco-sync-delay", "2"])
    try:
        # (held until replica 1 asks again: they must meet after the stall)
        run.start("r0", 0, env={**run.hold(11), "LOCO_TEST_FAULTS": "outer@4=lost"})
        run.start("r1", 1, env={"LOCO_TEST_STOP_AT": "5"})  # (it stops itself after step 5: mid-interval)
        deadline = time.monotonic() + 600
        while not (tmp_path / "dump" / "replica1_rank0.stopped.5").exists():
            assert time.monotonic() < deadline and run.jobs["r1"].poll() is None, run.log("r1")[-3000:]
            time.sleep(0.2)
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
    # (the loss injected at 4, then the commit vote replica 1 never joins: the last error is named)
    assert any(d["at"] == "fault" and d["iteration"] == 4 for d in run.dumps(0))
    assert "DiLoCo: the outer step was discarded (" in run.log("r0"), run.log("r0")[-3000:]
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
              extra=["--diloco-min-replicas", "2", "--diloco-quorum-timeout-s", "10", "--save", str(save)])
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
    samples nobody trained; against a checkpoint that stored a delayed exchange in flight
    (issue 55: a resume closed a cycle it never opened, committing a saved mean outside any
    quorum, or died with KeyError: 'fragment0' when the vote said no); and against a heal
    that reached only a replica's lane host (its other rank kept its old batch share).
    H 2, --diloco-sync-delay 1, --diloco-batch-split weight (8 and 4 of a batch of 12):
    replica 0 (TP 2) saves every 6 steps, replica 1 (one rank) every 4; replica 1's outer
    exchange of the cycle at 8 fails (lost: discarded at 9); both are held after step 10
    and killed (checkpoints 6 and 8, each written with an exchange in flight, which it does
    not hold); replica 1 restarts first and waits for the other, replica 0 restarts (its
    first heal failing on the way in, asked again) and heals to replica 1's committed outer
    step 3, both of its ranks taking the split it holds; no outer step is taken or closed at
    the restart, both train 9-16 on bit-identical outer state, and their shares tile every
    batch from 9 on. Under MuLoCo (Muon inner, megatron's layer-wise optimizer: each site's
    Muon momentum saved and loaded at its own layout, TP 2 and one rank). Replica 1 keeps
    its loaded 4-bit outer error buffers (laid for the same two replicas)."""
    gbs = 12
    run = Run(tmp_path, cache_dir, replicas=2, iters=16,
              extra=["--optimizer", "muon", "--diloco-inner-steps", "2", "--diloco-sync-delay", "1",
                     "--diloco-batch-split", "weight", "--global-batch-size", str(gbs)])
    ck = [tmp_path / "ck0", tmp_path / "ck1"]
    tp2 = ["--tensor-model-parallel-size", "2", "--diloco-replica-weight", "2"]
    try:
        run.start("r0", 0, *tp2, "--save", str(ck[0]), "--save-interval", "6", nproc=2, env=run.hold(10))
        run.start("r1", 1, "--save", str(ck[1]), "--save-interval", "4",
                  env={**run.hold(10), "LOCO_TEST_FAULTS": "outer@8=lost"})
        for r, name in enumerate(("r0", "r1")):
            run.wait_held(name, r, 10)
        run.kill("r0")
        run.kill("r1")
        run.start("r1b", 1, "--load", str(ck[1]), "--save", str(ck[1]), "--save-interval", "4")
        run.wait_log("r1b", "DiLoCo: waiting for the 2 replicas expected")
        run.start("r0b", 0, *tp2, "--load", str(ck[0]), "--save", str(ck[0]), "--save-interval", "6", nproc=2,
                  env={"LOCO_TEST_FAULTS": "heal@6=raise"})
        codes = [run.finish("r0b"), run.finish("r1b")]
        assert codes == [0, 0], (run.log("r0b")[-3000:], run.log("r1b")[-3000:])
    finally:
        run.close()
    assert "the outer step was discarded (RuntimeError: injected loss of the outer collective)" in run.log("r1")
    assert ("DiLoCo: the checkpoint at iteration 8 holds outer step 3 (the last committed) and this replica's "
            "training since; the exchange of fragment(s) 0 in flight (started at 8) is not in it") in run.log("r1")
    assert "loading checkpoint" in run.log("r1b") and "iter_0000008" in run.log("r1b")
    assert "iter_0000006" in run.log("r0b") and "DiLoCo: healed from replica 1" in run.log("r0b"), run.log("r0b")[-3000:]
    assert "error buffers start at zero" not in run.log("r1b"), run.log("r1b")[-3000:]
    zeros, ones = run.dumps(0), run.dumps(1)
    restart = [d for d in zeros if d["at"] == "join"][-1], [d for d in ones if d["at"] == "join"][-1]
    assert restart[0]["iteration"] == restart[1]["iteration"] == 8, restart
    assert restart[0]["agreed"] == restart[1]["agreed"] and restart[0]["outer_steps"] == restart[1]["outer_steps"] == 3
    after = [d for d in zeros[zeros.index(restart[0]):]], [d for d in ones[ones.index(restart[1]):]]
    assert _bit_identical(*after) == list(range(8, 17))
    assert _committed(after[0])[16]["outer_steps"] == 6  # 2, 4, 6 before the kill; 10, 12, 14 after: nothing extra
    _tiled(_trained(after[0], gbs), _trained(after[1], gbs), range(9, 17), gbs=gbs)
    # (both ranks of replica 0, TP 2, read the same samples: the split reached the one hosting no lane too)
    second = run.dumps(0, rank=1)
    second = second[[i for i, d in enumerate(second) if d["at"] == "join"][-1]:]
    assert _trained(second, gbs) == _trained(after[0], gbs)


def test_a_peer_stalled_inside_a_cycle_costs_an_outer_step_and_never_ends_the_run_twice(cache_dir, tmp_path):
    """Guards against three faults a probe found (issue 55, item 7): a live replica that
    ended the whole run when a peer stalled inside a cycle for longer than
    --diloco-quorum-timeout-s (its first attempt's wait on the peer ate the timeout); a
    live replica silent while it waits out --diloco-exchange-timeout-s on that peer; and a
    split brain: the stalled replica, continued after the other had finished, trained the
    rest alone, exited 0 and exported a final model of its own as the run's. Replica 1
    stops itself (SIGSTOP) inside the cycle at 8 (in the fingerprint gather), for longer
    than both timeouts (20 s): replica 0 says whom it waits for and when the wait ended,
    takes its outer steps from 8 on alone and finishes with exit 0; replica 1, continued
    after that, ends in one line naming the run's end without it (exit 3), its checkpoint
    saved as its own, which the export refuses as the run's model."""
    run = Run(tmp_path, cache_dir, replicas=2, iters=16,
              extra=["--diloco-quorum-timeout-s", "20", "--diloco-exchange-timeout-s", "20"])
    ck1 = tmp_path / "ck1"
    try:
        run.start("r0", 0)
        run.start("r1", 1, "--save", str(ck1), "--save-interval", "4", env={"LOCO_TEST_FAULTS": "fingerprint@8=stop"})
        deadline = time.monotonic() + 600
        while not (tmp_path / "dump" / "replica1_rank0.stopped.8").exists():
            assert time.monotonic() < deadline and run.jobs["r1"].poll() is None, run.log("r1")[-3000:]
            time.sleep(0.2)
        assert run.finish("r0") == 0, run.log("r0")[-3000:]
        run.signal("r1", signal.SIGCONT)
        assert run.finish("r1") != 0, run.log("r1")[-3000:]
    finally:
        run.close()
    log0 = run.log("r0")
    assert "for the replicas' fingerprints at iteration 8 among replicas 0, 1: replica 1 has not heartbeaten for" in log0
    assert "DiLoCo: the wait at iteration 8 ended after" in log0, log0[-3000:]
    assert "replica 1 left" in log0 and "kept failing" not in log0, log0[-3000:]
    assert sorted(train_losses(run.metrics("r0")))[-1] == 16
    log1 = run.log("r1")
    assert "DiLoCo: the run reached --train-iters 16 without replica 1 (the lighthouse's last quorum: replica0 at " \
           "iteration 16): replica 1 ends here" in log1, log1[-3000:]
    assert "(the export refuses it as the run's model)" in log1 and "exitcode  : 3" in log1, log1[-3000:]
    export = subprocess.run([sys.executable, "tools/export_hf.py", "--load", str(ck1), "--out", str(tmp_path / "hf")],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert export.returncode == 2 and not (tmp_path / "hf").exists(), export.stderr[-2000:]
    assert "is one replica's own training, not the run's model" in export.stderr, export.stderr[-2000:]
