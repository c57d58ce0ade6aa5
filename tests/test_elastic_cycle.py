"""Elastic DiLoCo's decisions as data (loco_megatron/diloco/elastic/cycle.py, split.py,
agreement.py, lighthouse.py), in one process (the adoption on 3 real gloo ranks, the status
page from a real torchft_lighthouse): what a cycle does from the gathered fingerprints,
how replicas agree on one model, and the batch split replayed through churn."""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, program, spawn_ranks
from loco_megatron.config import ConfigError
from loco_megatron.diloco.elastic.agreement import adopt, state_hash, tensor_sums
from loco_megatron.diloco.elastic.cycle import (AGREE, NOTHING, OUTER, RECHECK, REFUSE, WAIT, WITHHELD, PARTS, Fingerprint,
                                                combine, live_mask, missing, plan, progress, settings_parts)
from loco_megatron.diloco.elastic.lighthouse import Status, check_lighthouse, parse_status, read_status
from loco_megatron.diloco.elastic.split import Member, Share, next_split, split_id
from loco_megatron.diloco.elastic.waits import WaitNotice

GBS = 12


def fp(replica: int, **kw) -> Fingerprint:
    base = dict(config=7, iteration=8, joining=False, outer_steps=2, state=99, granule=2)
    return Fingerprint(replica, **{**base, **kw})


def test_a_fingerprint_travels_as_one_int64_row():
    """Guards against a field lost or reordered between the gather's tensor and the plan (a
    replica would read another's share, speed or state)."""
    p = fp(3, healed=True, cycles=4, split=123, offset=4, samples=8, trained=40, speed=2500, weight=2000, lanes=2,
           ready=True, world=2, live=live_mask([0, 3]), recheck=True, state=(1 << 62) + 5, synced=True,
           parts=(7, -3, 1 << 61))
    row = p.tensor()
    assert row.dtype == torch.int64 and row.shape == (Fingerprint.WIDTH,)
    assert Fingerprint.of(row) == p


def test_the_start_waits_for_the_replicas_expected_then_agrees_on_the_lowest_id():
    """Guards against replicas started together training apart (the first one asking went
    alone), and against a start where they did not agree on one model: joining replicas wait
    while fewer than expected are there and none has waited out its timeout; then, when
    their states differ, every one takes the lowest replica id's (whoever waited longer)."""
    one = [fp(1, iteration=0, outer_steps=0, joining=True, state=5, cycles=9)]
    assert plan(one, 0, expected=2, min_replicas=1, mode="fixed", global_batch=GBS).action == WAIT
    ready = [dataclasses.replace(one[0], ready=True)]
    assert plan(ready, 0, 2, 1, "fixed", GBS).action == NOTHING
    both = [fp(1, iteration=0, outer_steps=0, joining=True, state=5, cycles=9),
            fp(0, iteration=0, outer_steps=0, joining=True, state=6, cycles=0)]
    cycle = plan(both, 0, 2, 1, "fixed", GBS)
    assert (cycle.action, cycle.source) == (AGREE, 0)
    same = [dataclasses.replace(p, state=5) for p in both]
    assert plan(same, 0, 2, 1, "fixed", GBS).action == NOTHING  # (same layout and seed: nothing to agree)


def test_a_restart_at_equal_progress_with_other_states_agrees_on_the_furthest():
    """Guards against replicas restarted from checkpoints of other moments training on
    different models at equal progress (no heal: torchft heals only whoever is behind):
    the states differ, so the cycle agrees instead of exchanging, on the lowest id among
    the furthest in outer steps."""
    ps = [fp(2, state=1, outer_steps=3), fp(0, state=2, outer_steps=2), fp(1, state=1, outer_steps=3)]
    cycle = plan(ps, 0, 3, 1, "fixed", GBS)
    assert (cycle.action, cycle.source) == (AGREE, 1)


def test_outer_steps_need_enough_contributors_and_a_missing_replica_is_asked_for_once():
    """Guards against an outer step taken by fewer live replicas than --diloco-min-replicas
    (a healed replica sends zeros and does not count), against a quorum that lost a live
    replica for good after a lighthouse restart (it asks once more), and against asking
    forever for one that is gone."""
    ps = [fp(0, live=live_mask([0, 1])), fp(1, live=live_mask([0, 1]))]
    assert plan(ps, 0, 2, 2, "fixed", GBS).action == OUTER
    healed = [ps[0], dataclasses.replace(ps[1], healed=True)]
    assert plan(healed, 0, 2, 2, "fixed", GBS).action == WITHHELD
    assert plan(healed, 0, 2, 1, "fixed", GBS).action == OUTER
    alone = [fp(1, live=live_mask([0, 1]))]
    assert missing(alone) == [0] and plan(alone, 0, 2, 1, "fixed", GBS).action == RECHECK
    assert plan([dataclasses.replace(alone[0], recheck=True)], 0, 2, 1, "fixed", GBS).action == OUTER
    joiner = [fp(1, live=live_mask([1])), fp(2, joining=True, iteration=0, healed=True)]
    assert plan(joiner, 0, 3, 1, "fixed", GBS).action == OUTER  # (a newcomer is not a loss)


def test_a_joiner_whose_share_cannot_split_the_batch_is_refused_alone():
    """Guards against a joiner whose smallest share (micro batch x DP) leaves no split of the
    global batch ending the live replicas too (every replica raised the split's error): the
    less advanced participant is refused, with a line naming its share and the run's."""
    live = fp(0, granule=4, joining=False)
    joiner = fp(1, granule=6, joining=True, iteration=0, outer_steps=0, healed=True)
    cycle = plan([joiner, live], 1, 2, 1, "weight", GBS)
    assert cycle.action == REFUSE and cycle.refused_ranks == {0}
    assert cycle.refused == ("--diloco-replica-id 1: its smallest batch share (micro batch x data-parallel size = 6 "
                             "samples) and the run's (4) do not split --global-batch-size 12 into whole shares for 2 "
                             "replicas")
    assert plan([live, dataclasses.replace(joiner, granule=2)], 0, 2, 1, "weight", GBS).action == OUTER


def test_a_refusal_names_the_setting_that_differs():
    """Guards against a joiner refused as "model shape or outer settings differ" without the
    flag that differs (issue 55: another --diloco-inner-steps read as a mystery): each shared
    setting travels as its own hash, and the refusal names the one(s) that differ."""
    names, parts = settings_parts([("--diloco-inner-steps", 32), ("--seq-length", 64), ("--seed", 1)])
    _, other = settings_parts([("--diloco-inner-steps", 16), ("--seq-length", 64), ("--seed", 1)])
    ps = [fp(0, parts=parts, cycles=3), fp(1, config=8, parts=other, joining=True)]
    cycle = plan(ps, 0, 2, 1, "fixed", GBS, names=tuple(names))
    assert cycle.action == REFUSE and cycle.refused_ranks == {1}
    assert "--diloco-replica-id 1: --diloco-inner-steps differs from the run's (replica 0's" in cycle.refused
    many, _ = settings_parts([(f"--s{i}", i) for i in range(40)])
    assert len(many) == PARTS and many[-1] == "the other shared settings"


def test_the_final_cycles_fragments_are_the_most_advanced_contributors_for_all():
    """Guards against replicas that disagreed on the last commit exchanging different
    fragment sets in the run's final cycle (issue 55: each took its set from its own record
    of the last commit, and they ended on different final models): every participant takes
    the most advanced contributor's verdict (a healed one's is the source's: it sends zeros)."""
    behind = [fp(0, outer_steps=3, synced=True, state=5), fp(1, outer_steps=2, synced=False, state=5)]
    assert plan(behind, 0, 2, 1, "fixed", GBS).synced is True
    assert plan(behind[::-1], 1, 2, 1, "fixed", GBS).synced is True
    healed = [fp(0, outer_steps=3, synced=False, state=5), fp(1, outer_steps=3, synced=True, healed=True, state=5)]
    assert plan(healed, 0, 2, 1, "fixed", GBS).synced is False


def test_a_joiner_with_another_inner_optimizer_is_refused_alone():
    """Guards against a MuLoCo run silently mixing inner optimizers (a site started with
    --optimizer adam taking part in a Muon run's outer steps, or ending it): the joiner is
    refused with a line naming both optimizers, the live replica goes on."""
    live = fp(0, joining=False, inner=1)
    joiner = fp(1, joining=True, iteration=0, outer_steps=0, healed=True)
    cycle = plan([joiner, live], 1, 2, 1, "fixed", GBS)
    assert cycle.action == REFUSE and cycle.refused_ranks == {0}
    assert cycle.refused == ("--diloco-replica-id 1: --optimizer adam differs from the run's muon (replica 0's; "
                             "every replica trains with the same inner optimizer)")
    assert plan([dataclasses.replace(joiner, inner=1), live], 1, 2, 1, "fixed", GBS).action != REFUSE
    assert Fingerprint.of(live.tensor()) == live


def test_the_lanes_of_a_replica_decide_as_one():
    """Guards against lanes of one replica going different ways (one exchanging, one agreeing,
    one broken): a failed lane breaks the cycle, lanes that saw other participants break it,
    and any lane whose states differ makes the whole replica agree."""
    ps = [fp(0), fp(1)]
    a, b = plan(ps, 0, 2, 1, "fixed", GBS), plan(ps, 0, 2, 1, "fixed", GBS)
    assert combine([a, b]).action == OUTER and combine([a, None]) is None
    other = plan([fp(0), fp(1, healed=True)], 0, 2, 1, "fixed", GBS)
    assert combine([a, other]) is None
    differ = plan([fp(0, state=1), fp(1, state=2)], 0, 2, 1, "fixed", GBS)
    assert (combine([a, differ]).action, combine([a, differ]).source) == (AGREE, 0)


def test_state_hashes_see_every_bit_and_ignore_the_order_of_addition():
    """Guards against replicas whose models differ in one element (or a -0.0) passing as
    the same, and against a hash that depends on how the sum was reduced (replicas on other
    devices would never match): integer sums modulo 2^64 of the fp32 bit patterns."""
    torch.manual_seed(0)
    a = {"fragment0": torch.randn(1000), "fragment1": torch.randn(7)}
    m = {"fragment0": torch.randn(1000), "fragment1": None}
    h = state_hash(a, m, 3)
    assert h == state_hash({k: v.clone() for k, v in a.items()}, m, 3) and h > 0
    b = {k: v.clone() for k, v in a.items()}
    b["fragment0"][500] = torch.nextafter(b["fragment0"][500], torch.tensor(10.0))
    assert state_hash(b, m, 3) != h and state_hash(a, m, 4) != h
    z = torch.zeros(4)
    assert tensor_sums(z) != tensor_sums(-z)
    x = torch.randn(3000)
    bits = x.view(torch.int32).to(torch.int64).tolist()
    mask = (1 << 64) - 1
    assert tensor_sums(x) == (3000, sum(bits) & mask, sum(v * v for v in bits) & mask)


def _adopt_worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        agreed = {"fragment0": torch.randn(50, generator=g), "fragment1": torch.randn(9, generator=g)}
        momentum = {"fragment0": torch.randn(50, generator=g), "fragment1": None}
        if rank == 1:
            agreed["fragment0"][3] = -0.0
        took_a, took_m = adopt(agreed, momentum, rank == 1, lambda t: dist.all_reduce(t))
        queue.put((rank, {k: v.numpy().tobytes() for k, v in took_a.items()},
                   took_m["fragment0"].numpy().tobytes(), took_m["fragment1"] is None,
                   {k: v.numpy().tobytes() for k, v in agreed.items()}, state_hash(took_a, took_m, 2)))
    finally:
        dist.destroy_process_group()


def test_adoption_gives_every_participant_the_sources_state_bit_for_bit():
    """Guards against an agreement that leaves replicas on different models: on 3 gloo ranks
    (rank 1 the source, its parameters holding a -0.0) every rank ends with the source's
    agreed parameters and momentum, bit for bit the same everywhere (the -0.0 reads alike
    on all, the source included), and the same state hash."""
    got = dict((r, rest) for r, *rest in spawn_ranks(_adopt_worker, 3, 3))
    source = got[1]
    for rank in range(3):
        agreed, momentum, none, _, h = got[rank]
        assert agreed == source[0] and momentum == source[1] and none and h == source[4]
    original = torch.frombuffer(bytearray(source[3]["fragment0"]), dtype=torch.float32)
    took = torch.frombuffer(bytearray(source[0]["fragment0"]), dtype=torch.float32)
    assert torch.equal(took, original) and not torch.signbit(took[3])  # (-0.0 + 0.0 = +0.0, on every rank)


def test_the_lighthouse_status_page_says_who_asked_and_how_far():
    """Guards against a replica that joins a run which already ended (it waited out the
    quorum timeout and trained alone from scratch), and against reading the status page of
    something else as a lighthouse's: the page of a real torchft_lighthouse is parsed (the
    quorum id, a member's iteration from its step, the heartbeats), the run's last iteration
    ends a replica whose --train-iters it reached, and other pages are refused."""
    from torchft._torchft import LighthouseClient

    port = free_port()
    address = f"http://localhost:{port}"
    lighthouse = subprocess.Popen([program("torchft_lighthouse"), "--min_replicas", "1", "--bind", f"[::]:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status = read_status(address)
                break
            except ConfigError:
                assert time.monotonic() < deadline and lighthouse.poll() is None
                time.sleep(0.2)
        assert status.members == [] and status.last_iteration() is None and status.quorum_id == 0
        check_lighthouse(address, 10)
        client = LighthouseClient(address, connect_timeout=datetime.timedelta(seconds=10))
        client.quorum(replica_id="replica3:abc", timeout=datetime.timedelta(seconds=10), address="x",
                      store_address="y", step=progress(40, 9), world_size=2)
        status = read_status(address)
        assert [(m.replica_id, m.iteration, m.world_size) for m in status.members] == [("replica3:abc", 40, 2)]
        assert status.quorum_id == 1 and "replica3:abc" in status.heartbeats
        check_lighthouse(address, 41)
        with pytest.raises(ConfigError, match="has already reached iteration 40 .its last quorum., and --train-iters is "
                                              "40: nothing is left to train"):
            check_lighthouse(address, 40)
    finally:
        lighthouse.kill()
        lighthouse.wait(timeout=60)
    assert parse_status("<html>Directory listing</html>") is None


def test_a_listener_that_never_answers_is_refused_after_one_read_timeout():
    """Guards against a --diloco-lighthouse address held by a listener that accepts and says
    nothing (not HTTP) costing three full read timeouts of retries (~30 s) before its line:
    a reply that times out on an accepted connection is not asked again."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held = []
    stop = threading.Event()

    def accept():  # (accepts every connection and keeps it open, silent)
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    address = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        with pytest.raises(ConfigError, match="accepts connections but does not answer as a torchft lighthouse"):
            read_status(address, timeout_s=2.0)
        assert len(held) == 1  # (one read: it was not asked again)
    finally:
        stop.set()
        for conn in held:
            conn.close()
        server.close()


def test_a_long_wait_on_other_replicas_says_for_what_and_whom_and_when_it_ended():
    """Guards against silent waits (issue 55: a live replica blocked for the exchange timeout
    by a peer stalled inside a cycle, or for a lighthouse outage, printed nothing): past its
    threshold a wait names its phase, iteration and the replicas whose heartbeat stopped
    (or the lighthouse not answering), and says when it ended; a short wait says nothing."""
    lines: list[str] = []
    status = Status(3, "New quorum not ready, only have 1 participants", [],
                    {"replica0:aa": 0.1, "replica1:bb": 12.0, "replica2:cc": 0.3})
    notice = WaitNotice(lines.append, lambda: ("fingerprint", 8, [0, 1]), lambda: status, after_s=0.0)
    with notice:
        time.sleep(1.5)  # (the watcher looks once a second)
    assert len(lines) == 2, lines
    assert "for the replicas' fingerprints at iteration 8 among replicas 0, 1: replica 1 has not heartbeaten " \
           "for 12 s (stalled, cut off or gone)" in lines[0] and lines[0].startswith("DiLoCo: waiting ")
    assert lines[1].startswith("DiLoCo: the wait at iteration 8 ended after ")

    def down():
        raise ConfigError("--diloco-lighthouse: http://lh:1 cannot be reached (refused); start it with ...")

    outage = WaitNotice(lines.append, lambda: ("quorum", 9, [0, 1]), down)
    assert outage.describe(12.0) == ("DiLoCo: waiting 12 s for the quorum at iteration 9 among replicas 0, 1: the "
                                     "lighthouse does not answer (http://lh:1 cannot be reached (refused))")
    live = WaitNotice(lines.append, lambda: ("outer", 4, [0, 2]), lambda: status)
    assert live.describe(30.0).endswith("every replica heartbeats (one is slow to reach this point of the cycle)")
    lines.clear()
    with WaitNotice(lines.append, lambda: ("outer", 4, [0, 1]), lambda: status, after_s=30.0):
        time.sleep(1.2)
    assert lines == []


def _replay(rng: random.Random, mode: str, cycles: int) -> None:
    """One random membership history through the split: replicas come (fresh, or restarted
    from a checkpoint with the split it saved), go, miss quorums, heal; every cycle that
    passes the go vote re-splits (or keeps) from the participants' fingerprints, the way
    every participant computes it; the participants then train their shares for one
    interval (those not in the quorum wait in theirs); no sample may be trained twice or
    skipped."""
    ids = list(range(5))
    weights = {r: rng.choice([1, 2, 3]) for r in ids}
    state = {}  # replica -> (split id, shares of that split, outer steps)
    saved = {}  # replica -> its checkpoint's (split id, shares, outer steps)
    alive: set[int] = set()
    for _ in range(cycles):
        for r in ids:  # churn between cycles
            roll = rng.random()
            if r in alive and roll < 0.15:
                alive.discard(r)
                state.pop(r)
            elif r not in alive and roll < 0.35:
                alive.add(r)
                state[r] = saved.get(r, (0, {}, 0)) if rng.random() < 0.5 else (0, {}, 0)
        if not alive:
            continue
        quorum = sorted(r for r in alive if rng.random() < 0.85) or [min(alive)]
        furthest = max(state[r][2] for r in quorum)
        source = min(r for r in quorum if state[r][2] == furthest)
        for r in quorum:  # torchft heals whoever is behind: the source's outer state and split
            if state[r][2] < furthest:
                state[r] = state[source]
        members = [Member(r, state[r][1].get(r, Share(0, 0)).samples, 0.0, weights[r], 1, state[r][0])
                   for r in quorum]
        shares = next_split(mode, members, GBS)
        if shares is not None:
            ident = split_id(shares)
            for r in quorum:
                state[r] = (ident, shares, state[r][2])
        commit = rng.random() < 0.8
        for r in quorum:
            ident, held, steps = state[r]
            state[r] = (ident, held, steps + int(commit))
            if rng.random() < 0.5:
                saved[r] = state[r]
        spans = sorted((state[r][1][r].offset, state[r][1][r].offset + state[r][1][r].samples) for r in quorum)
        assert spans[0][0] == 0 and spans[-1][1] == GBS and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), \
            (quorum, spans)


@pytest.mark.parametrize("mode", ["weight", "throughput"])
def test_a_replayed_churn_never_trains_a_sample_twice_or_skips_one(mode):
    """Guards against shares kept across a change of the replica set (a replica returning
    with its stale share trained samples another replica held, and the rest were skipped):
    300 random histories of 12 cycles over 5 replicas (weights 1-3; leaves, fresh joins,
    restarts from checkpoints holding older splits, missed quorums, heals, discarded outer
    steps), replayed through the pure split functions: after every cycle the participants'
    shares tile the global batch exactly."""
    rng = random.Random(1234)
    for _ in range(300):
        _replay(rng, mode, 12)
