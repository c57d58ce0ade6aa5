"""Elastic DiLoCo when things go wrong (real torchrun replica jobs and a real torchft
Lighthouse, gloo): Streaming DiLoCo across unequal sites, a failure injected into each
exchange, ranks that arrive late, a lighthouse that dies mid-quorum, bad joiners and late
starters (a replica that stalls, too few replicas and a whole-run restart:
tests/test_elastic_restarts.py).

The elastic part of the combination matrix: each failure runs with other features on, so
that elastic DiLoCo meets each of them under some failure (the rows marked * are in
tests/test_elastic_restarts.py; tests/test_elastic.py adds a replica killed mid-interval
and rejoining, one dying inside an exchange, a restart in another layout, duplicate ids
and another model shape):

=========================  ===========================  =========  ====  ===========  ==========  =========
test                       layouts (ranks)              fragments  tau   inner LoCo   split       optimizer
=========================  ===========================  =========  ====  ===========  ==========  =========
streaming / run ended      TP2 (2) + 1                  2          0     -            weight      adam
each exchange failing      DP2 (2) + 1                  1          0     4-bit        weight      adam
late ranks                 DP2 (2) + DP2 (2), 2 lanes   1          0     4-bit        throughput  adam
lighthouse restart         1 + 1                        2          1     -            fixed       adam
a replica stalls *         1 + 1                        1          0     -            fixed       muon
too few replicas *         1                            1          0     -            fixed       adam
whole-run restart *        TP2 (2) + 1                  1          0     -            fixed       muon
bad joiner                 DP2 (2) + micro 6 (1)        1          0     -            weight      adam
=========================  ===========================  =========  ====  ===========  ==========  =========
"""

from __future__ import annotations

import http.server
import threading
import time

from conftest import run_launch, torchrun_command, train_losses
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
