"""Eager updates in elastic DiLoCo (--diloco-eager with --diloco-lighthouse): scripted
histories through the real coordinator and outer step on 2-rank replicas, torchft stubbed
(tests/elastic_replay.py): commits, discards, a replica killed with an exchange in flight,
heals and whole-run restarts from checkpoints saved with an exchange in flight."""

from __future__ import annotations

import random

import pytest
from test_elastic_replay import check, random_script, replay

H = 4
STEP = {0: 1e-3, 1: 7e-3}
"""What each inner step adds to every element of replica r's model (its share's offset, 0 or 6
of a fixed split of 12 over 2 replicas: elastic_replay.Replica.step)."""


def _eager(rounds: list, naive: bool = False, replicas: int = 2) -> dict:
    return {"replicas": replicas, "mode": "fixed", "tau": 0, "H": H, "eager": True, "naive": naive,
            "exchange_timeout": 3, "weights": {str(r): 1 for r in range(replicas)}, "rounds": rounds}


def _host(got: list, history: int = 0) -> dict:
    """{(round, replica): the lane host's report}."""
    return {(rep["round"], g["replica"]): rep for g in got if g["rank"] == 0 for rep in g["histories"][history]}


BOTH = {"0": "train", "1": "train"}
START = {"0": "restart:fresh", "1": "restart:fresh"}


@pytest.mark.parametrize("naive", [False, True], ids=["eager", "naive"])
def test_eager_cycles_commit_late_and_a_discard_carries_the_payload(naive):
    """Guards against an eager cycle committed where it opens (a blocking exchange) instead
    of at the next sync, a discarded one that loses its interval (the payload it carried not
    sent again) or applies something of its mean, and a naive control that applies the
    replica's own gradient ahead: 2 replicas of 2 ranks, H 4, the exchange of the cycle at 8
    lost on replica 0. Outer steps commit one sync late (none at 4, the cycle of 4 at 8,
    the discarded cycle of 8 not at 12, the cycle of 12 at 16); the payload sent at 12
    holds two intervals (8 to 12 and the lost 4 to 8), the others one; every rank of a
    replica alike and the replicas on one agreed state after every round; the replicas'
    parameters are their own eager part ahead of the agreed ones (naive: exactly on them)."""
    script = _eager([START, BOTH, {"0": "train+lose", "1": "train"}, BOTH, BOTH], naive=naive)
    got = replay([script])
    check([script], got)
    rep = _host(got)
    assert [rep[k, 0]["outer_steps"] for k in range(1, 5)] == [0, 1, 1, 2], rep
    for r in (0, 1):
        interval = -H * STEP[r]  # own - local after an interval: minus what the steps added
        sent = [rep[k, r]["sent"] for k in range(1, 5)]
        assert sent == pytest.approx([interval, interval, 2 * interval, interval], rel=1e-3), (r, sent)
        for k in range(1, 5):
            if naive:
                assert rep[k, r]["ahead"] == 0.0 and rep[k, r]["offset"] == 0.0, (k, r, rep[k, r])
            else:
                assert rep[k, r]["ahead"] == pytest.approx(rep[k, r]["offset"], abs=1e-6), (k, r, rep[k, r])
                assert rep[k, r]["offset"] != 0.0, (k, r)


def test_a_replica_killed_with_an_eager_exchange_in_flight_heals_without_its_eager_part():
    """Guards against a heal that hands over the agreed model without the state that goes
    with it (the healed replica keeping an eager part or a payload of its own, so it ends
    on another model than the others), and against survivors that lose an interval when a
    peer dies inside a cycle: 3 replicas; replica 2 dies one step after its sync at 4 (the
    cycle of 4 in flight: its commit vote never comes, so the others discard it at 8 and
    send their payloads of 0 to 4 again with 4 to 8), restarts fresh at round 4 and is
    healed in that round's cycle: one agreed state, no eager part, nothing sent and its
    parameters on the agreed ones on the healed replica, and the outer steps go on
    committing; then replica 1 stalls (behind with an eager part and a payload of its own)
    and is healed at its next sync: it drops both, as a fresh one."""
    three = {"0": "train", "1": "train", "2": "train"}
    script = _eager([{"0": "restart:fresh", "1": "restart:fresh", "2": "restart:fresh"}, three,
                     {"0": "train", "1": "train", "2": "die"}, {"0": "train", "1": "train", "2": "dead"},
                     {"0": "train", "1": "train", "2": "restart:fresh"}, three,
                     {"0": "train", "1": "stall", "2": "train"}, three, three], replicas=3)
    got = replay([script])
    check([script], got)
    rep = _host(got)
    assert [rep[k, 0]["outer_steps"] for k in (1, 2, 3)] == [0, 0, 1], rep  # (the cycle of 4: discarded at 8)
    for r in (0, 1):
        assert rep[2, r]["sent"] == pytest.approx(2 * rep[1, r]["sent"], rel=1e-3), rep  # (0 to 4 again, 4 to 8)
        assert rep[3, r]["sent"] == pytest.approx(rep[1, r]["sent"], rel=1e-3), rep
    healed = rep[4, 2]
    assert healed["iteration"] == rep[4, 0]["iteration"] and healed["state"] == rep[4, 0]["state"], rep
    assert healed["offset"] == 0.0 and healed["sent"] == 0.0 and healed["ahead"] == 0.0, healed
    assert rep[7, 0]["outer_steps"] > rep[4, 0]["outer_steps"], rep
    # Replica 1 stalls in round 6 (behind, with an eager part and a payload of its own) and
    # is healed in round 7: it drops both and trains on from the agreed parameters.
    assert rep[6, 1]["offset"] != 0.0 and rep[6, 1]["sent"] != 0.0, rep[6, 1]
    healed = rep[7, 1]
    assert healed["iteration"] == rep[7, 0]["iteration"] and healed["state"] == rep[7, 0]["state"], rep
    assert healed["offset"] == 0.0 and healed["sent"] == 0.0 and healed["ahead"] == 0.0, healed


def test_a_whole_run_restart_from_eager_checkpoints_loses_no_interval():
    """Guards against an eager checkpoint that stores the exchange in flight (its cycle never
    committed: a resume would commit a mean outside any quorum) or drops the payload it
    carried (the interval in flight lost on a whole-run restart): both replicas save right
    after their sync at 8 (the cycle of 8 in flight), both die, restart from those
    checkpoints and agree; the cycle of 8 is never committed, and the payload each sends at
    12 holds 4 to 8 again with 8 to 12; one agreed state after every round."""
    script = _eager([START, BOTH, {"0": "train+save", "1": "train+save"}, {"0": "die", "1": "die"},
                     {"0": "restart:2", "1": "restart:2"}, BOTH, BOTH])
    got = replay([script])
    check([script], got)
    rep = _host(got)
    assert rep[4, 0]["outer_steps"] == rep[4, 1]["outer_steps"] == 1, rep  # (the cycle of 4, committed at 8)
    for r in (0, 1):
        assert rep[4, r]["sent"] == pytest.approx(rep[2, r]["sent"], rel=1e-6), rep  # (the payload in flight, kept)
        assert rep[5, r]["sent"] == pytest.approx(2 * rep[2, r]["sent"], rel=1e-3), rep
    assert rep[6, 0]["outer_steps"] == 2 and rep[6, 0]["state"] == rep[6, 1]["state"], rep


def test_random_eager_histories_keep_every_rank_of_a_replica_alike():
    """Guards against any seam where eager state (the eager part, the payload, the open
    cycle) reaches some ranks of a replica and not others, or the replicas of a cycle end
    on different agreed states: random histories of 10 rounds over 3 replicas of 2 ranks
    (deaths and stalls inside an open eager cycle, fresh restarts and restarts from
    checkpoints saved with an exchange in flight, lost exchanges), checked after every round."""
    rng = random.Random("eager")
    scripts = []
    for _ in range(3):
        script = random_script(rng, "weight", 0)
        script.update(eager=True, exchange_timeout=3)
        scripts.append(script)
    check(scripts, replay(scripts))


def test_elastic_eager_run_with_a_lost_exchange_ends_bit_identical(cache_dir, tmp_path):
    """Guards against eager elastic replicas that drift apart or lose samples (real torchrun
    replica jobs, a real torchft lighthouse): 2 replica jobs of one rank, H 4, 16 steps, the
    exchange of replica 1's cycle at 8 lost (it completes, then fails there only). Each
    cycle commits one sync late (outer steps 0, 1, 1, 2 after the cycles at 4, 8, 12, 16:
    the cycle of 8 is discarded at 12 on both, says so, and its payloads go out again with
    the next); after every cycle the two hold bit-identical agreed parameters, momentum and
    outer-step counts; both end on the same final model, and the two shares tile every
    global batch of the run (no sample twice, none skipped)."""
    from conftest import train_losses
    from test_elastic import Run, _committed, _trained
    from test_elastic_faults import _bit_identical, _tiled

    run = Run(tmp_path, cache_dir, replicas=2, iters=16, extra=["--global-batch-size", "12", "--diloco-eager"])
    try:
        run.start("r0", 0)
        run.start("r1", 1, env={"LOCO_TEST_FAULTS": "outer@8=lost"})
        codes = [run.finish("r0"), run.finish("r1")]
        assert codes == [0, 0], (run.log("r0")[-3000:], run.log("r1")[-3000:])
    finally:
        run.close()
    zeros, ones = run.dumps(0), run.dumps(1)
    assert _bit_identical(zeros, ones) == [0, 4, 8, 12, 16]
    steps = {it: d["outer_steps"] for it, d in _committed(zeros).items()}
    assert [steps[it] for it in (4, 8, 12, 16)] == [0, 1, 1, 2], steps
    finals = [[d for d in dumps if d["at"] == "final"][-1] for dumps in (zeros, ones)]
    assert finals[0]["final"] is not None and finals[0]["final"] == finals[1]["final"], finals
    for name in ("r0", "r1"):
        assert sorted(train_losses(run.metrics(name))) == list(range(1, 17))
        assert run.log(name).count("DiLoCo: the outer step was discarded") == 1, run.log(name)[-3000:]
        assert "eager updates" in run.log(name)
    _tiled(_trained(zeros, 12), _trained(ones, 12), range(1, 17), 12)
