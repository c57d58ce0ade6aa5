"""Eager updates (--diloco-eager): the pure update against the paper's algorithm written here
with torch's own Nesterov SGD per replica (2 and 3 replicas simulated in one process), and
:class:`~loco_megatron.diloco.eager.EagerOuterStep` on 2 and 3 real gloo ranks (fp32 and LoCo
4/2-bit outer exchanges, fragments, the final outer step, a save and resume mid-interval)."""

from __future__ import annotations

import io
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks

from loco_megatron.config import ConfigError, DiLoCoConfig, LoCoConfig
from loco_megatron.diloco.eager import EagerOuterStep
from loco_megatron.diloco.exchange import OuterChannel
from loco_megatron.diloco.outer import ShardViews
from loco_megatron.diloco.outer_math import eager_correction, nesterov_step
from loco_megatron.diloco.schedule import FragmentSchedule
from loco_megatron.loco.quantize import QuantOptions

H, LR, MU = 4, 0.7, 0.9
SIZES = ((300, 77), (129,))
"""Parameter shards per fragment (fragment 0: two, fragment 1: one)."""
TOL = 1e-5
"""fp32 against the reference: the same operations in another order (torch's SGD, a
stacked mean) round differently by a few ulps per step, far below the 1e-2 a missing
correction, a mean applied at the wrong sync or a sign error moves the parameters."""


def _grad(rank: int, t: int, size: int, k: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * rank + 10 * t + k))


def _start(sizes: tuple, n: int) -> list[list[torch.Tensor]]:
    return [[torch.randn(s, generator=torch.Generator().manual_seed(7 + s)) for s in ps] for ps in sizes[:n]]


def _inner(params: list, rank: int, t: int) -> None:
    for f, ps in enumerate(params):
        for k, p in enumerate(ps):
            p.sub_(0.01 * _grad(rank, t, p.numel(), 10 * f + k))


# -- the paper's algorithm, for R replicas in one process ----------------------------------------
def _paper(replicas: int, fragments: int, steps: int, lr: float, mu: float, naive: bool = False,
           means: dict | None = None) -> dict:
    """Eager DiLoCo as Kale et al. write it: replica r keeps its own outer parameters theta_r
    and a torch.optim.SGD(nesterov) over them; at the k-th sync of a fragment it computes
    d_k = theta_r - local_r and steps with g = mean(d_{k-1}) + (d_k - d_{k-1}) / R (naive:
    mean(d_{k-1})), then trains on from theta_r. The agreed parameters step with
    mean(d_{k-1}) alone. ``means``: {(fragment, sync): the mean to use for that sync's
    exchange} (a compressed exchange's decoded mean) instead of the exact mean.
    Returns {"trace": per step, per replica, per fragment the flat local parameters,
    "agreed": per step, per fragment, "final": per fragment}."""
    sched = FragmentSchedule(H, fragments)
    locals_ = [_start(SIZES, fragments) for _ in range(replicas)]
    theta = [[torch.nn.Parameter(torch.cat(ps)) for ps in locals_[r]] for r in range(replicas)]
    opts = [[torch.optim.SGD([p], lr=lr, momentum=mu, nesterov=mu > 0) for p in theta[r]] for r in range(replicas)]
    agreed = [torch.nn.Parameter(torch.cat(ps)) for ps in locals_[0]]
    agreed_opt = [torch.optim.SGD([a], lr=lr, momentum=mu, nesterov=mu > 0) for a in agreed]
    prev = [[torch.zeros_like(a) for a in agreed] for _ in range(replicas)]
    prev_mean = [None] * fragments
    trace, agreed_trace = [], []
    for t in range(1, steps + 1):
        for r in range(replicas):
            _inner(locals_[r], r, t)
        for f in sched.starts(t):
            d = [theta[r][f].detach() - torch.cat(locals_[r][f]) for r in range(replicas)]
            if prev_mean[f] is not None:
                agreed[f].grad = prev_mean[f].clone()
                agreed_opt[f].step()
            for r in range(replicas):
                last = prev_mean[f] if prev_mean[f] is not None else torch.zeros_like(d[r])
                theta[r][f].grad = last.clone() if naive else last + (d[r] - prev[r][f]) / replicas
                opts[r][f].step()
                for p, part in zip(locals_[r][f], theta[r][f].detach().split([p.numel() for p in locals_[r][f]])):
                    p.copy_(part)
                prev[r][f] = d[r]
            prev_mean[f] = (means or {}).get((f, t), torch.stack(d).mean(0))
        trace.append([[torch.cat(ps).clone() for ps in locals_[r]] for r in range(replicas)])
        agreed_trace.append([a.detach().clone() for a in agreed])
    final = []
    for f in range(fragments):  # the exchange in flight, then what was trained since the last sync
        a, m = agreed[f].detach().clone(), agreed_opt[f].state[agreed[f]].get("momentum_buffer")
        a = torch.nn.Parameter(a)
        opt = torch.optim.SGD([a], lr=lr, momentum=mu, nesterov=mu > 0)
        if m is not None:
            opt.state[a]["momentum_buffer"] = m.clone()
        if prev_mean[f] is not None:
            a.grad = prev_mean[f].clone()
            opt.step()
        if f not in sched.starts(steps):
            a.grad = torch.stack([theta[r][f].detach() - torch.cat(locals_[r][f]) for r in range(replicas)]).mean(0)
            opt.step()
        final.append(a.detach().clone())
    return {"trace": trace, "agreed": agreed_trace, "final": final}


def _pure(replicas: int, fragments: int, steps: int, lr: float, mu: float, naive: bool = False,
          discard: tuple = ()) -> dict:
    """The same run through :func:`eager_correction` and :func:`nesterov_step` with the state
    EagerOuterStep keeps (the agreed parameters and momentum; per replica its eager part E,
    E_m and what it sent, with the weight); ``discard``: (fragment, sync) whose exchange
    never arrives (elastic: a discarded cycle), so its payload goes out again with the next
    one. Returns the trace, the agreed parameters, each replica's own outer parameters
    (A + E) and what each sent last."""
    sched = FragmentSchedule(H, fragments, eager=True)
    locals_ = [[torch.cat(ps) for ps in _start(SIZES, fragments)] for _ in range(replicas)]
    agreed = [x.clone() for x in locals_[0]]
    momentum = [torch.zeros_like(a) if mu else None for a in agreed]
    offset = [[torch.zeros_like(a) for a in agreed] for _ in range(replicas)]
    offset_m = [[torch.zeros_like(a) if mu else None for a in agreed] for _ in range(replicas)]
    sent = [[torch.zeros_like(a) for a in agreed] for _ in range(replicas)]
    sent_w = [[0.0] * fragments for _ in range(replicas)]
    flight = {}
    trace, agreed_trace = [], []
    for t in range(1, steps + 1):
        for r in range(replicas):
            for f, x in enumerate(locals_[r]):
                x.sub_(0.01 * torch.cat([_grad(r, t, s, 10 * f + k) for k, s in enumerate(SIZES[f])]))
        for f in sched.starts(t):
            mean = flight.pop(f, None)
            payloads = [agreed[f] + offset[r][f] - locals_[r][f] for r in range(replicas)]
            if mean is None:
                payloads = [p + sent[r][f] for r, p in enumerate(payloads)]
            else:
                nesterov_step(agreed[f], momentum[f], mean.clone(), lr, mu)
            for r in range(replicas):
                w = 0.0 if naive else 1.0 / replicas
                c = torch.empty_like(payloads[r])
                eager_correction(c, sent[r][f], sent_w[r][f], payloads[r], w)
                nesterov_step(offset[r][f], offset_m[r][f], c, lr, mu)
                locals_[r][f].copy_(agreed[f] + offset[r][f])
                sent[r][f], sent_w[r][f] = payloads[r].clone(), w
            if (f, t) not in discard:
                flight[f] = torch.stack(payloads).mean(0)
        trace.append([[x.clone() for x in locals_[r]] for r in range(replicas)])
        agreed_trace.append([a.clone() for a in agreed])
    own = [[agreed[f] + offset[r][f] for f in range(fragments)] for r in range(replicas)]
    return {"trace": trace, "agreed": agreed_trace, "own": own, "sent": sent}


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("mu, naive", [(0.9, False), (0.0, False), (0.9, True)], ids=["nesterov", "sgd", "naive"])
def test_eager_update_is_the_papers(replicas, mu, naive):
    """Guards against an eager update that is not the paper's: the correction applied with
    the wrong sign or weight (own share not 1/R, or not taken back out once the mean
    arrives), the mean applied at the sync it started instead of the next one, the agreed
    parameters stepping with the eager gradient (they must take the mean alone, one
    interval behind), or the naive control applying the fresh gradient: 2 and 3 replicas,
    two fragments, 14 steps at H 4 (3 syncs of each), every replica's parameters after
    every step within ``TOL`` of the paper's algorithm on torch's Nesterov SGD, and naive
    replicas equal to the agreed parameters bit for bit right after each sync."""
    ref, got = _paper(replicas, 2, 14, LR, mu, naive), _pure(replicas, 2, 14, LR, mu, naive)
    for t, (a, b) in enumerate(zip(ref["trace"], got["trace"]), 1):
        for r in range(replicas):
            for f in range(2):
                assert torch.allclose(a[r][f], b[r][f], atol=TOL, rtol=0), (t, r, f)
        for f in range(2):
            assert torch.allclose(ref["agreed"][t - 1][f], got["agreed"][t - 1][f], atol=TOL, rtol=0), (t, f)
    sched = FragmentSchedule(H, 2)
    for t in range(1, 15):
        for f in sched.starts(t):
            mine = [got["trace"][t - 1][r][f] for r in range(replicas)]
            if naive:  # a one-interval-stale outer step: every replica on the agreed parameters
                assert all(torch.equal(x, got["agreed"][t - 1][f]) for x in mine), (t, f)
            elif t > H:  # the replicas differ by their eager parts right after a sync
                assert not torch.equal(mine[0], mine[1]), (t, f)


def test_eager_telescopes_and_a_discard_carries():
    """Guards against an eager part that accumulates (the replica's share applied twice, or
    never taken back), and a discarded exchange that loses or re-applies an interval: with
    outer lr 1 and no momentum (plain averaging) the replica's parameters after its k-th sync
    are exactly the start minus every committed mean minus its own latest share (the eager
    part telescopes); after a discarded exchange the next one carries the lost payload, so
    once it commits the agreed parameters hold all of every replica's training: the start
    minus the mean over replicas of everything each trained."""
    replicas, steps = 3, 3 * H
    ok = _pure(replicas, 1, steps, 1.0, 0.0)
    lost = _pure(replicas, 1, steps, 1.0, 0.0, discard=((0, 2 * H),))
    x0 = torch.cat(_start(SIZES, 1)[0])
    trained = [sum((0.01 * torch.cat([_grad(r, t, s, k) for k, s in enumerate(SIZES[0])]) for t in
                    range(1, steps + 1)), torch.zeros_like(x0)) for r in range(replicas)]
    # with lr 1, mu 0 the replicas' whole training is the sum of their inner steps; at the
    # last sync the agreed parameters hold every interval but the last (in flight)
    last = [sum((0.01 * torch.cat([_grad(r, t, s, k) for k, s in enumerate(SIZES[0])]) for t in
                 range(steps - H + 1, steps + 1)), torch.zeros_like(x0)) for r in range(replicas)]
    expect = x0 - torch.stack([trained[r] - last[r] for r in range(replicas)]).mean(0)
    assert torch.allclose(ok["agreed"][-1][0], expect, atol=1e-5, rtol=0)
    for r in range(replicas):  # own = agreed - (1/R) * its latest outer gradient
        assert torch.allclose(ok["own"][r][0], expect - last[r] / replicas, atol=1e-5, rtol=0), r
    # The exchange started at 2H never arrives: at 3H the agreed parameters hold only the
    # first interval, and the payload sent at 3H carries the second interval too.
    first = [sum((0.01 * torch.cat([_grad(r, t, s, k) for k, s in enumerate(SIZES[0])]) for t in
                  range(1, H + 1)), torch.zeros_like(x0)) for r in range(replicas)]
    assert torch.allclose(lost["agreed"][-1][0], x0 - torch.stack(first).mean(0), atol=1e-5, rtol=0)
    for r in range(replicas):
        assert torch.allclose(lost["sent"][r][0], trained[r] - first[r], atol=1e-5, rtol=0), r
        # and the replica holds its own share of all it trained that no mean holds yet
        assert torch.allclose(lost["own"][r][0], lost["agreed"][-1][0] - (trained[r] - first[r]) / replicas,
                              atol=1e-5, rtol=0), r


# -- EagerOuterStep on real gloo ranks ------------------------------------------------------------
STEPS = 14
SAVE_AT = 6
"""Mid-interval: fragment 0 synced at 2 and 6 (its exchange of 6 in flight), fragment 1 at 4."""


def _outer(params: list, bits: int, fragments: int, mu: float, naive: bool = False, log=print) -> EagerOuterStep:
    channels = {}
    for f in range(fragments):
        views = ShardViews(params[f])
        channels[f"opt0.fragment{f}"] = (views, OuterChannel(views.numel, None, bits, 256, QuantOptions(
            **LoCoConfig().options_for(bits)), name=f"f{f}"), 0, f)
    return EagerOuterStep(channels, FragmentSchedule(H, fragments, 0, True), LR, mu, 0.0, lambda update: update(0),
                          lambda work: None, lambda: None, log, naive=naive)


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


def _run(rank: int, bits: int, fragments: int, mu: float, naive: bool = False) -> dict:
    """Inner steps local -= 0.01 g(rank, t) and the eager outer step as the trainer drives it,
    a save at SAVE_AT (settled, through torch.save) resumed in a fresh EagerOuterStep beside
    the uninterrupted one; returns both traces, the means applied and the final models."""
    params = _start(SIZES, fragments)
    outer = _outer(params, bits, fragments, mu, naive)
    means = {}
    settled, stepping = outer._settled_mean, [False]

    def recording(key: str):  # {(fragment, start iteration): the mean applied at a sync}
        start = outer.pending[key][0]
        mean = settled(key)
        if stepping[0]:
            means[int(key[-1]), start] = mean.clone()
        return mean

    outer._settled_mean = recording
    after_step = outer.after_step

    def stepped(t: int) -> None:
        stepping[0] = True
        after_step(t)
        stepping[0] = False

    outer.after_step = stepped
    trace, resumed_trace, saved = [], [], None
    for t in range(1, STEPS + 1):
        _inner(params, rank, t)
        outer.after_step(t)
        trace.append([torch.cat(ps).clone() for ps in params])
        if t == SAVE_AT:
            outer.settle()
            saved = (_roundtrip(outer.state_dict()), [[p.clone() for p in ps] for ps in params])
    before = [torch.cat(ps).clone() for ps in params]
    outer.finish(STEPS)
    assert all(torch.equal(torch.cat(ps), b) for ps, b in zip(params, before))  # local untouched
    final = [outer.final[f"opt0.fragment{f}"].clone() for f in range(fragments)]
    sd, again = saved
    log = []
    resumed = _outer(again, bits, fragments, mu, naive, log.append)
    resumed.load_state_dict(sd)
    for t in range(SAVE_AT + 1, STEPS + 1):
        _inner(again, rank, t)
        resumed.after_step(t)
        resumed_trace.append([torch.cat(ps).clone() for ps in again])
    resumed.finish(STEPS)
    return {"trace": trace, "agreed": [outer.agreed[f"opt0.fragment{f}"].clone() for f in range(fragments)],
            "means": means, "final": final, "resumed": resumed_trace, "log": log,
            "resumed_final": [resumed.final[f"opt0.fragment{f}"].clone() for f in range(fragments)]}


CASES = {"fp32": (0, 2, MU, False), "loco4": (4, 2, MU, False), "loco2": (2, 1, 0.0, False),
         "naive": (0, 1, MU, True)}


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        buf = io.BytesIO()  # (bytes, not tensors: nothing shared with a process that exits)
        torch.save({name: _run(rank, *case) for name, case in CASES.items()}, buf)
        queue.put((rank, buf.getvalue()))
    except Exception:  # (the test fails at once, with the worker's traceback)
        queue.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _results(world: int) -> dict:
    got = spawn_ranks(_worker, world, world, timeout=600)
    errors = [data for _, data in got if isinstance(data, str)]
    assert not errors, errors[0]
    return {rank: torch.load(io.BytesIO(data), weights_only=False) for rank, data in got}


@pytest.mark.parametrize("world", [2, 3])
def test_eager_outer_step_on_gloo_ranks(world):
    """Guards against EagerOuterStep's plumbing diverging from the paper's update: an
    exchange applied at the sync it started (a blocking wait) or a mean of another
    fragment's exchange, the agreed parameters apart across replicas, a compressed mean not
    fed to both the agreed and the own step, the final outer step losing the interval in
    flight or the training since the last sync, and a save mid-interval (an exchange in
    flight, momentum, error buffers) that does not resume bit for bit. On 2 and 3 gloo
    ranks: fp32 with two fragments (against the exact-mean reference), LoCo 4-bit with two
    fragments and 2-bit without momentum (against the reference fed the decoded means each
    rank applied), the naive control: every rank's parameters after every step within
    ``TOL`` of the reference, the agreed parameters and the final model bit-identical on
    every rank and within ``TOL`` of the reference's, the resumed runs equal to the
    uninterrupted ones bit for bit with nothing announced."""
    res = _results(world)
    for name, (bits, fragments, mu, naive) in CASES.items():
        means = res[0][name]["means"]
        assert sorted(means) == sorted((f, t) for t in range(1, STEPS - H + 1)
                                       for f in FragmentSchedule(H, fragments).starts(t)), (name, sorted(means))
        ref = _paper(world, fragments, STEPS, LR, mu, naive, means=means if bits else None)
        for r in range(world):
            got = res[r][name]
            assert all(torch.equal(got["means"][k], means[k]) for k in means), (name, r)
            for t, (a, b) in enumerate(zip(ref["trace"], got["trace"]), 1):
                for f in range(fragments):
                    assert torch.allclose(a[r][f], b[f], atol=TOL, rtol=0), (name, t, r, f)
            for f in range(fragments):
                assert torch.equal(got["agreed"][f], res[0][name]["agreed"][f]), (name, r, f)
                assert torch.allclose(got["agreed"][f], ref["agreed"][-1][f], atol=TOL, rtol=0), (name, r, f)
                assert torch.equal(got["final"][f], res[0][name]["final"][f]), (name, r, f)
                if not bits:  # (compressed: the final exchange's mean is another decoded one)
                    assert torch.allclose(got["final"][f], ref["final"][f], atol=TOL, rtol=0), (name, r, f)
                assert torch.equal(got["resumed_final"][f], got["final"][f]), (name, r, f)
            for a, b in zip(got["resumed"], got["trace"][SAVE_AT:]):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (name, r)
            assert not got["log"], (name, got["log"])


@pytest.mark.parametrize("flags, message", [
    ({"diloco_eager": True, "diloco_sync_delay": 1, "diloco_fragments": 2},
     "--diloco-eager: overlaps the whole outer interval; --diloco-sync-delay 1 must be 0"),
    ({"diloco_eager_naive": True}, "--diloco-eager-naive: needs --diloco-eager"),
    ({"diloco_eager": True, "diloco_mixing_factor": 0.5}, "--diloco-mixing-factor: 0.5 needs --diloco-sync-delay"),
    ({"diloco_eager": True, "diloco_fragments": 2, "diloco_lighthouse": "http://localhost:29510",
      "diloco_replica_id": 0}, "--diloco-eager: with --diloco-lighthouse needs --diloco-fragments 1 \\(not 2\\)"),
    ({"diloco_eager": True, "diloco_outer_topk": 64},
     "--diloco-eager: does not compose with --diloco-outer-topk 64 yet"),
])
def test_eager_refuses_what_it_cannot_compose_with(flags, message):
    """Guards against eager updates starting with a Streaming delay (the exchange would be
    applied twice over: tau steps after its start and at the next sync) or a mixing factor
    (the replicas' own parameters are the eager step's, not a mix), the naive control
    without eager updates (silently plain DiLoCo), elastic eager updates over several
    fragments (their cycles would overlap: one closes before the next opens), or the sparse
    outer (its per-entry mean has no fixed share to swap: a wrong correction): one line
    naming the flag."""
    with pytest.raises(ConfigError, match=message):
        DiLoCoConfig(diloco_replicas=2, **flags)


# -- real training (pretrain_gpt.py on gloo ranks) -----------------------------------------------
def _lines(stdout: str, kind: str) -> dict:
    """{(rank, iteration): [the line's key=value fields]} of tests/diloco_check.py's ``kind`` lines."""
    import re

    out: dict = {}
    for rank, it, rest in re.findall(rf"^{kind} rank=(\d+) iter=(\d+) (.*)$", stdout, re.MULTILINE):
        out.setdefault((int(rank), int(it)), []).append(dict(kv.split("=") for kv in rest.split()))
    return out


@pytest.mark.parametrize("naive, extra", [(False, []), (True, []), (False, ["--optimizer", "muon"])],
                         ids=["eager", "naive", "muloco"])
def test_eager_training_keeps_the_agreed_parameters_agreed(naive, extra, cache_dir, tmp_path):
    """Guards against eager training whose agreed parameters drift apart across replicas (a
    rank applying its own eager gradient to them, or a mean some rank applied at another
    sync), a replica that does not train on from its own outer parameters after a sync, and
    eager parts that are not there (the replicas identical right after a sync, as if the
    exchange had blocked) or that the naive control keeps (it must leave every replica on
    the agreed parameters): 2 replicas of 2 ranks (inner DP 2, inner LoCo 4-bit, outer LoCo
    4-bit), bf16, H 2, 6 steps: at each sync the agreed parameters are bit-identical across
    the replicas and the main parameters are the replica's own; right after the syncs at 2,
    4 and 6 the replicas' models differ (eager) or are identical (naive), in between they
    differ; inside a replica the weights are always identical. MuLoCo (--optimizer muon:
    one channel per sub-optimizer, Muon's and AdamW's) alike."""
    from conftest import TINY, torchrun

    args = TINY + ["--train-iters", "6", "--loco-bits", "4", "--bf16", "--diloco-replicas", "2",
                   "--diloco-inner-steps", "2", "--diloco-outer-bits", "4", "--diloco-eager",
                   *(["--diloco-eager-naive"] if naive else []), *extra]
    proc, _ = torchrun(4, args, cache_dir, tmp_path, script="tests/diloco_check.py")
    agreed, model, inner = (_lines(proc.stdout, k) for k in ("AGREED", "MODEL", "INNER"))
    assert ("eager updates (each exchange runs through the next interval)" if not naive else
            "the naive one-interval delay (eager control)") in proc.stdout
    for rank in range(4):
        for it in range(1, 7):
            assert inner[(rank, it)] == [{"identical": "True"}], (rank, it)
            if it % 2 == 0:
                assert agreed[(rank, it)] and all(c["identical"] == c["own"] == "True"
                                                  for c in agreed[(rank, it)]), (rank, it, agreed[(rank, it)])
            if it % 2 == 0:
                assert model[(rank, it)] == [{"identical": str(naive)}], (rank, it)
            elif it > 1:  # (step 1 runs at lr 0: the warmup's first step changes nothing)
                assert model[(rank, it)] == [{"identical": "False"}], (rank, it)
    if extra:  # (sub-optimizer 0 is Muon, 1 megatron's AdamW)
        assert {"opt0", "opt1"} <= {c["key"].split(".")[0] for cs in agreed.values() for c in cs}


EAGER = ["--diloco-replicas", "2", "--diloco-inner-steps", "4", "--diloco-fragments", "2", "--diloco-eager",
         "--diloco-outer-bits", "4"]
"""Fragment 0 syncs at 2 and 6, fragment 1 at 4: the save at 4 holds both exchanges in flight
(fragment 0's of 2, applied at 6; fragment 1's of 4, applied by the final outer step)."""


@pytest.fixture(scope="module")
def eager_saves(cache_dir, tmp_path_factory) -> dict:
    """{run: (stdout, metrics)} of the 2-rank eager runs (the ``*_same`` ones resume the
    ``*_ref`` ones from iteration 4 in the same processes) and the checkpoint folders under ``root``."""
    from conftest import TINY, finished_run, torchrun_runs

    tmp = tmp_path_factory.mktemp("eager_ckpt")
    runs = [("torch_ref", EAGER + ["--ckpt-format", "torch", "--save", str(tmp / "torch"), "--save-interval", "2"]),
            ("torch_same", EAGER + ["--ckpt-format", "torch", "--load", str(tmp / "torch"),
                                    "--save", str(tmp / "torch2"), "--save-interval", "2"]),
            ("dist_ref", EAGER + ["--save", str(tmp / "dist"), "--save-interval", "2"]),
            ("dist_same", EAGER + ["--load", str(tmp / "dist"), "--save", str(tmp / "dist2"), "--save-interval", "2"])]
    args = TINY + ["--lr", "0.003", "--lr-decay-iters", "8", "--train-iters", "6"]
    launch = torchrun_runs(2, args, cache_dir, tmp, runs, resume_at=4)
    out = {name: finished_run(launch, runs, name) for name, _ in runs}
    out["root"] = tmp
    return out


def test_eager_resume_is_bit_exact(eager_saves, tmp_path):
    """Guards against a resume that re-applies or loses an interval (the mean in flight at the
    save applied at the resume, or dropped; the replica's own outer parameters or the
    payload it sent not saved, so its eager part is lost or applied twice) and eager state
    missing from either format: the save at 4 settles both exchanges in flight (their means
    are in it, with each replica's own state), the resumed runs' losses equal the
    uninterrupted ones and their final checkpoints (after the final outer step, which
    applies the exchange in flight and exchanges what was trained since) equal theirs,
    every tensor bit for bit; nothing announces a reset."""
    from conftest import train_losses
    from test_diloco_checkpoint import _dcp, _same

    root = eager_saves["root"]
    for fmt in ("torch", "dist"):
        (_, ref), (out_b, resumed) = eager_saves[f"{fmt}_ref"], eager_saves[f"{fmt}_same"]
        a, b = train_losses(ref), train_losses(resumed)
        assert sorted(b) == [5, 6] and all(a[i] == b[i] for i in b), (fmt, a, b)
        notes = [ln for ln in out_b.splitlines() if "DiLoCo:" in ln and not
                 ln.startswith(("DiLoCo: 2 replicas of", "DiLoCo: final outer step at iteration 6"))]
        assert "re-seeded" not in out_b and not notes, notes
    saved = torch.load(root / "torch" / "iter_0000004" / "rank_00000.pt", weights_only=False)["diloco"]
    assert sorted(saved["per_rank"]["pending"]) == ["opt0.fragment0", "opt0.fragment1"]
    assert saved["schedule"] == [4, 2, 0, 1] and saved["per_rank"]["eager"]["opt0.fragment0"]["sent"].any()
    for rank in (0, 1):
        x, y = (torch.load(root / d / "iter_0000006" / f"rank_{rank:05d}.pt", weights_only=False)
                for d in ("torch", "torch2"))
        assert not _same(x, y), _same(x, y)[:5]
        assert "final" in x["diloco"]
    x, y = (_dcp(root / d / "iter_0000006", tmp_path / f"{d}.pt") for d in ("dist", "dist2"))
    assert not _same(x, y), _same(x, y)[:5]


def test_eager_collectives_in_program_order(cache_dir, tmp_path, monkeypatch):
    """Guards against an eager exchange whose phases or apply are decided by polling or a
    clock (NCCL deadlocks where gloo forgives), and a wait on the link at a step that has no
    business crossing it: with 2 fragments, H 4 and 2-bit outer gradients, under random
    delays and random is_completed() answers every rank issues each communicator's
    operations in the same order, and the outer group carries two phases per exchange: the
    syncs at 2, 4, 6, 8, then the final outer step at 9 over both fragments (the exchanges
    in flight finished first)."""
    from conftest import TINY, recorded_collectives, torchrun

    monkeypatch.setenv("LOCO_TEST_RECORD_DIR", str(tmp_path))
    args = TINY + ["--train-iters", "9", "--loco-bits", "4", "--diloco-replicas", "2", "--diloco-inner-steps", "4",
                   "--diloco-fragments", "2", "--diloco-eager", "--diloco-outer-bits", "2"]
    torchrun(4, args, cache_dir, tmp_path, script="tests/record_collectives.py")
    logs = recorded_collectives(tmp_path, 4)  # (each communicator in one order on all its ranks)
    seen = {tuple(g) for log in logs.values() for g, _, _ in log}
    assert {(0, 2), (1, 3)} <= seen
    ops = [op for g, op, n in logs[0] if tuple(g) == (0, 2)]
    assert ops == ["all_to_all", "all_gather"] * 6, ops


def test_eager_crosses_replicas_only_at_syncs_and_second_phases(cache_dir, tmp_path, monkeypatch):
    """Guards against eager updates that touch the link between sites at other steps than
    the schedule's (a second phase issued at every step, or a wait on the exchange at the
    step after its start): with 2 replicas of one rank, H 4 and 4-bit outer gradients, with
    an evaluation every 2 steps, the collectives spanning both replicas come from the syncs
    (4, 8: the exchange of the previous interval finished, the next one and the stop flags
    started), the second phases half an interval later (6) and the end of the run only."""
    import json

    from conftest import TINY, torchrun

    monkeypatch.setenv("LOCO_COLLECTIVE_LOG_DIR", str(tmp_path))
    args = TINY + ["--train-iters", "9", "--diloco-replicas", "2", "--diloco-inner-steps", "4", "--diloco-eager",
                   "--diloco-outer-bits", "4", "--eval-interval", "2", "--eval-iters", "1"]
    torchrun(2, args, cache_dir, tmp_path, script="benchmarks/collective_log.py")
    for rank in (0, 1):
        log = json.loads((tmp_path / f"all_rank{rank}.json").read_text())
        crossing = {phase for phase, ranks, _, _ in log if 0 in ranks and 1 in ranks}
        assert {p for p in crossing if p not in (0, "end")} == {4, 6, 8}, (rank, sorted(crossing, key=str))
        assert "end" in crossing, rank


def test_eager_runs_are_labelled_apart():
    """Guards against eager, naive-delay and lockstep runs sharing one variant label (their
    metrics would be grouped as one run in the dashboards and the reports)."""
    from loco_megatron.metrics.variant import describe

    base = {"diloco_replicas": 2, "diloco_inner_steps": 32, "diloco_outer_bits": 4}
    labels = {describe(base), describe({**base, "diloco_eager": True}),
              describe({**base, "diloco_eager": True, "diloco_eager_naive": True})}
    assert len(labels) == 3 and any(label.endswith("H32 eager outer LoCo 4-bit") for label in labels), labels


def test_eager_resume_that_cannot_take_the_saved_mean_carries_it(tmp_path):
    """Guards against a resume that silently loses an interval: when the saved exchange in
    flight cannot be taken back (another --diloco-inner-steps: it is dropped, one line says
    so), the payload it carried must go out again with the next exchange, not vanish; a
    checkpoint of a run without eager updates starts the eager state afresh in one line
    (the replica's own parameters are then the agreed ones); another layout (no per-rank
    part) starts it afresh too, the caller's layout line saying so. One rank, 4-bit, F 2."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        params = _start(SIZES, 2)
        outer = _outer(params, 4, 2, MU)
        for t in range(1, SAVE_AT + 1):
            _inner(params, 0, t)
            outer.after_step(t)
        outer.settle()
        sd = _roundtrip(outer.state_dict())
        sent = {k: s.sent.clone() for k, s in outer.eager.items()}

        log: list = []
        other = _outer([[p.clone() for p in ps] for ps in params], 4, 2, MU, log=log.append)
        other.load_state_dict({**sd, "schedule": [8, 2, 0, 1]})
        assert not other.pending and log == [
            "DiLoCo: the outer schedule changes from H 8, F 2, tau 0, eager (checkpoint) to H 4, F 2, tau 0, eager: "
            "each fragment's next outer step follows the new one; the 2 outer exchange(s) in flight are dropped"], log
        state = other.eager["opt0.fragment1"]
        assert torch.equal(state.sent, sent["opt0.fragment1"])
        views = other.channels["opt0.fragment1"][0]
        for t in (7, 8):  # (fragment 1 syncs at 8, fragment 0 at 10)
            for k, v in enumerate(views.views):
                v.sub_(0.01 * _grad(0, t, v.numel(), 10 + k))
            if t == 8:
                fresh = state.own(other.agreed["opt0.fragment1"]) - torch.cat([v.clone() for v in views.views])
            other.after_step(t)
        assert torch.allclose(state.sent, fresh + sent["opt0.fragment1"], atol=1e-6, rtol=0)

        for changed, line in (({"per_rank": {**sd["per_rank"], "eager": {}}},
                               "the eager outer state starts afresh (the checkpoint has none"),
                              ({"per_rank": None}, None)):
            log.clear()
            fresh_step = _outer([[p.clone() for p in ps] for ps in params], 4, 2, MU, log=log.append)
            fresh_step.load_state_dict({**sd, **changed})
            for key, s in fresh_step.eager.items():
                assert not s.offset.any() and not s.sent.any(), key
            assert (line in log[0]) if line else not log, log
    finally:
        dist.destroy_process_group()


def test_dry_run_projects_the_exchange_against_the_interval():
    """Guards against a dry run that cannot say what the link needs (the exchange's time
    against the interval's compute, and whether eager updates hide it), and a bad link
    speed accepted: --diloco-link-gbps 1 prints one projection line naming the fraction;
    0 is one line naming the flag, exit 2."""
    import subprocess
    import sys

    from conftest import REPO

    base = [sys.executable, "pretrain_gpt.py", "--dry-run", "--world-size", "4", "--diloco-replicas", "2"]
    proc = subprocess.run(base + ["--diloco-eager", "--diloco-link-gbps", "0.001"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DiLoCo link: "))
    assert "at 0.001 Gbit/s" in line and "x the " in line and "eager updates hide" in line, line
    bad = subprocess.run(base + ["--diloco-link-gbps", "0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --diloco-link-gbps: 0.0 is not > 0"], bad.stderr
