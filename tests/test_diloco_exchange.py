"""DiLoCo's outer exchange and outer step on 3 real gloo ranks (an odd outer group, ragged
shards), against a plain-torch DiLoCo written here."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loco_megatron.config import LoCoConfig
from loco_megatron.diloco.exchange import OuterChannel
from loco_megatron.diloco.outer import OuterStep, ShardViews
from loco_megatron.diloco.schedule import FragmentSchedule
from loco_megatron.loco.quantize import QuantOptions
from conftest import free_port

R = 3
NUMEL = 1000  # not a multiple of 3 rows or of 256-element blocks
SIZES = ((300, 77), (129,))  # parameter shards per fragment (fragment 0: two, fragment 1: one)
H, F, TAU, ALPHA, LR, MU, STEPS = 4, 2, 1, 0.5, 0.7, 0.9, 14



def _grad(rank: int, t: int, size: int, k: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * rank + 10 * t + k))


def _exchanges(rank: int) -> dict:
    """Means of three exchanges per width (bits 0, 4, 2) of this rank's fixed delta."""
    out = {}
    for bits in (0, 4, 2):
        options = QuantOptions(**LoCoConfig().options_for(bits))  # 2 bits: the 2-bit default options
        channel = OuterChannel(NUMEL, None, bits, 256, options, name=f"test{bits}")
        means = []
        for _ in range(8):
            delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
            work = channel.start(delta)
            work.second_phase()
            work.wait()
            means.append(delta.clone())
        out[bits] = (means, work.bytes_sent, channel.uncompressed_bytes())
    return out


def _outer_run(rank: int, tau: int, alpha: float) -> list:
    """Inner steps local -= 0.01 g(rank, t) and the outer step driven as the trainer drives it;
    returns [(t, locals, agreed)] after every step."""
    params = [[torch.randn(n, generator=torch.Generator().manual_seed(7 + n)) for n in sizes] for sizes in SIZES]
    channels = {f"opt0.fragment{f}": (ShardViews(params[f]), OuterChannel(
        sum(SIZES[f]), None, 0, name=f"f{f}"), 0, f) for f in range(F)}
    outer = OuterStep(channels, FragmentSchedule(H, F, tau), LR, MU, alpha, lambda update: update(0),
                      lambda work: None, lambda: None, print)
    trace = []
    for t in range(1, STEPS + 1):
        for f, sizes in enumerate(SIZES):
            for k, p in enumerate(params[f]):
                p.sub_(0.01 * _grad(rank, t, sizes[k], 10 * f + k))
        outer.after_step(t)
        trace.append((t, [[p.clone() for p in ps] for ps in params],
                      [outer.agreed[f"opt0.fragment{f}"].clone() for f in range(F)]))
    before = [[p.clone() for p in ps] for ps in params]
    outer.finish(STEPS)
    assert all(torch.equal(p, q) for ps, qs in zip(params, before) for p, q in zip(ps, qs))  # local untouched
    return trace, [outer.final[f"opt0.fragment{f}"].clone() for f in range(F)]


def _worker(rank, port, queue, collected):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=R)
    try:
        queue.put((rank, _exchanges(rank), _outer_run(rank, TAU, ALPHA), _outer_run(rank, 0, 0.0)))
        collected.wait(timeout=300)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _results() -> dict:
    ctx = mp.get_context("spawn")
    queue, collected = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue, collected)) for r in range(R)]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in range(R):
            rank, *rest = queue.get(timeout=600)
            out[rank] = rest
    finally:
        collected.set()
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return out


def _reference(tau: int, alpha: float) -> list:
    """Streaming DiLoCo as the papers write it, for R replicas in one process: fragment f
    syncs at t = o_f + k H (o_f = (f+1) H // F), its mean pseudo-gradient applied tau steps
    later by Nesterov SGD, then local <- alpha local + (1 - alpha) agreed."""
    locals_ = [[[torch.randn(n, generator=torch.Generator().manual_seed(7 + n)) for n in sizes] for sizes in SIZES]
               for _ in range(R)]
    agreed = [torch.cat([p.clone() for p in ps]) for ps in locals_[0]]
    momentum = [torch.zeros_like(a) for a in agreed]
    pending = {}
    trace = []
    for t in range(1, STEPS + 1):
        for r in range(R):
            for f, sizes in enumerate(SIZES):
                for k, p in enumerate(locals_[r][f]):
                    p.sub_(0.01 * _grad(r, t, sizes[k], 10 * f + k))
        for f in range(F):
            o = (f + 1) * H // F
            if t >= o and (t - o) % H == 0:
                pending[(f, t + tau)] = torch.stack([agreed[f] - torch.cat(locals_[r][f]) for r in range(R)]).mean(0)
        for f in range(F):
            g = pending.pop((f, t), None)
            if g is None:
                continue
            momentum[f] = MU * momentum[f] + g
            agreed[f] = agreed[f] - LR * (g + MU * momentum[f])
            for r in range(R):
                flat = alpha * torch.cat(locals_[r][f]) + (1 - alpha) * agreed[f]
                for p, part in zip(locals_[r][f], flat.split(list(SIZES[f]))):
                    p.copy_(part)
        trace.append([[[p.clone() for p in ps] for ps in locals_[r]] for r in range(R)])
    # The run's final outer step: the exchange in flight applied (local mixed), then one
    # more outer step over what the replicas trained since.
    final = []
    for f in range(F):
        a, m = agreed[f].clone(), momentum[f].clone()
        locs = [torch.cat(locals_[r][f]) for r in range(R)]
        g = pending.pop((f, STEPS + tau), None) if tau else None
        if g is not None:
            m = MU * m + g
            a = a - LR * (g + MU * m)
            locs = [alpha * loc + (1 - alpha) * a for loc in locs]
        o = (f + 1) * H // F
        if g is None and tau == 0 and (STEPS - o) % H == 0:  # synced at STEPS itself: local == agreed
            final.append(a)
            continue
        g = torch.stack([a - loc for loc in locs]).mean(0)
        m = MU * m + g
        final.append(a - LR * (g + MU * m))
    return trace, agreed, final


def test_outer_exchange_and_step_on_three_ranks():
    """Guards against (a) replicas ending an exchange with different means (a rank keeping
    its own fp32 row instead of the decoded one, a sum in arrival order), (b) a compressed
    mean that is not the mean (a row sent to the wrong rank, scaling by R twice or never,
    a ragged last row dropped), (c) error feedback that does not carry the error into the
    next exchange (the running mean of repeated exchanges of one delta must approach the
    true mean), (d) byte counts that are not what the wire carries, and (e) an outer step
    that is not DiLoCo: against the plain-torch reference, with two fragments, a delay of
    one step and alpha 0.5, every rank's parameters and agreed parameters match at every
    step; with tau 0 and alpha 0 the replicas hold bit-identical parameters after every
    outer step; (f) the run's final outer step (``finish``) is the reference's (the
    exchange in flight applied, then one more outer step over what was trained since),
    identical on every replica, skipped for a fragment that synced at the last step, and
    leaves the local parameters as they were (the checkpoint's resumable state)."""
    res = _results()
    truth = torch.stack([torch.randn(NUMEL, generator=torch.Generator().manual_seed(r)) for r in range(R)]).mean(0)
    for bits in (0, 4, 2):
        means0, sent, fp32 = res[0][0][bits]
        for r in range(1, R):
            assert all(torch.equal(a, b) for a, b in zip(means0, res[r][0][bits][0])), (bits, r)
        err = (means0[0] - truth).norm() / truth.norm()
        if bits == 0:
            assert err < 1e-6 and sent == fp32 == 2 * (R - 1) * NUMEL * 4 // R
            continue
        assert err < {4: 0.2, 2: 0.6}[bits], (bits, float(err))
        running = (torch.stack(means0).mean(0) - truth).norm() / truth.norm()
        # Without error feedback every round sends the same codes: the running mean would not move.
        assert running < 0.8 * err, (bits, float(err), float(running))
        rows = -(-NUMEL // R)
        blocks = -(-rows // 256)
        assert sent == (R - 1) * 2 * (blocks * 256 * bits // 8 + 4 * blocks), (bits, sent)
    ref_trace, ref_agreed, ref_final = _reference(TAU, ALPHA)
    for r in range(R):
        trace, final = res[r][1]
        for (t, locals_, agreed), ref in zip(trace, ref_trace):
            for f in range(F):
                for p, q in zip(locals_[f], ref[r][f]):
                    assert torch.allclose(p, q, atol=1e-5, rtol=0), (r, t, f)
        for f in range(F):
            assert torch.allclose(trace[-1][2][f], ref_agreed[f], atol=1e-5, rtol=0), (r, f)
            assert torch.allclose(final[f], ref_final[f], atol=1e-5, rtol=0), (r, f)
            assert torch.equal(final[f], res[0][1][1][f]), (r, f)  # every replica ends on the same bits
            # the tau 0 run: fragment 0 synced at STEPS (no final exchange), fragment 1 takes one
            assert torch.equal(res[r][2][1][f], res[0][2][1][f]), (r, f)
    assert torch.equal(res[0][2][1][0], res[0][2][0][-1][2][0])
    assert not torch.equal(res[0][2][1][1], res[0][2][0][-1][2][1])
    outer_steps = {t for t in range(1, STEPS + 1) for f in range(F) if t >= (f + 1) * H // F
                   and (t - (f + 1) * H // F) % H == 0}
    for t in sorted(outer_steps):
        for r in range(1, R):
            synced = [f for f in range(F) if t >= (f + 1) * H // F and (t - (f + 1) * H // F) % H == 0]
            for f in synced:
                assert all(torch.equal(a, b) for a, b in zip(res[0][2][0][t - 1][1][f],
                                                             res[r][2][0][t - 1][1][f])), (t, r)
