"""DiLoCo checkpoints (issue 34, item 6): a resume mid-interval at the same layout is
bit-exact in both formats, with an exchange in flight and outer error buffers; torch_dist
reshards to another inner layout or replica count, and loads across DiLoCo and plain runs.

The OuterStep's own save-then-load runs in this process (a one-rank group); the saving
runs share one 2-rank torchrun, the resumes at another layout one 4-rank torchrun
(tests/matrix_run.py, with its per-step checks: parameters identical inside each replica
after every step and across the replicas after each outer step)."""

from __future__ import annotations

import io
import pathlib

import numpy as np
import pytest
import torch

from conftest import TINY, finished_run, torchrun_runs, train_losses

ARGS = TINY + ["--lr", "0.003", "--lr-decay-iters", "8", "--train-iters", "6"]
STREAMING = ["--diloco-replicas", "2", "--diloco-inner-steps", "4", "--diloco-fragments", "2",
             "--diloco-sync-delay", "1", "--diloco-outer-bits", "4"]
"""Fragment 0 syncs at 2 and 6, fragment 1 at 4, each applied one step later: the save at 4
holds fragment 1's exchange in flight, error buffers and momentum from fragment 0's."""
FP32_OUTER = ["--diloco-replicas", "2", "--diloco-inner-steps", "3", "--diloco-outer-bits", "0", "--train-iters", "7"]
"""Outer steps at 3 and 6 in fp32: the save at 4 is mid-interval with momentum, and the
outer step at 6 (seen in the loss of 7) uses the resharded agreed parameters and momentum."""
RESUME_AT = 4
RESHARD_RTOL = 1e-4
"""Same weights, same replicas, same global batch: only the inner DP reduction order differs."""
REPLICA_RTOL = 1e-2
"""Replica r of 4 takes saved replica r mod 2, whose data was another part of the batch."""
RESET = "RNG re-seeded and LoCo error buffers start at zero"
SIZES = ((300, 77), (129,))
"""Parameter sizes per fragment of the in-process OuterStep."""


def _outer_step(params: list, log: list, start: int = 0):
    """An OuterStep over ``params`` (per fragment) as the trainer drives it: H 4, F 2, tau 1,
    4-bit outer gradients with error feedback, on this process's one-rank group; ``start``:
    the first element of each parameter the views hold (another shard)."""
    from loco_megatron.config import LoCoConfig
    from loco_megatron.diloco.exchange import OuterChannel
    from loco_megatron.diloco.outer import OuterStep, ShardViews
    from loco_megatron.diloco.schedule import FragmentSchedule
    from loco_megatron.loco.quantize import QuantOptions

    channels = {}
    for f, ps in enumerate(params):
        views = ShardViews([p[start:] for p in ps], [(p, start, p.numel()) for p in ps])
        channels[f"opt0.fragment{f}"] = (views, OuterChannel(views.numel, None, 4, 256, QuantOptions(
            **LoCoConfig().options_for(4)), name=f"f{f}"), 0, f)
    return OuterStep(channels, FragmentSchedule(4, 2, 1), 0.7, 0.9, 0.5, lambda update: update(0),
                     lambda work: None, lambda: None, log.append)


def _inner(params: list, t: int) -> None:
    for f, ps in enumerate(params):
        for k, p in enumerate(ps):
            p.sub_(0.01 * torch.randn(p.numel(), generator=torch.Generator().manual_seed(100 * t + 10 * f + k)))


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


def test_outer_state_save_then_load(tmp_path):
    """Guards against OuterStep state that does not survive a save (an exchange in flight,
    the error buffers, momentum), a per-rank part loaded into other shards (error buffers
    read at the wrong elements), and a resume that drops an exchange in flight then crashes
    at its apply step (KeyError): a save at step 4 (fragment 1's exchange in flight) and a
    load continue bit for bit; other shards or another layout reset the per-rank part
    (other shards: one line), keep the agreed parameters and momentum, and step on; another
    schedule (--diloco-inner-steps changed) is said in one line, not silently taken."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        params = [[torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes] for sizes in SIZES]
        log: list = []
        outer = _outer_step(params, log)
        trace, saved = [], None
        for t in range(1, 9):
            _inner(params, t)
            outer.after_step(t)
            if t == 4:
                outer.settle()
                saved = (_roundtrip(outer.state_dict()), [[p.clone() for p in ps] for ps in params])
            trace.append([p.clone() for ps in params for p in ps])
        sd, at_save = saved
        assert list(sd["per_rank"]["pending"]) == ["opt0.fragment1"] and sd["momentum"]["opt0.fragment0"].any()
        resumed = _outer_step(at_save, log)
        resumed.load_state_dict(sd)
        for t in range(5, 9):
            _inner(at_save, t)
            resumed.after_step(t)
            assert all(torch.equal(a, b) for a, b in zip(trace[t - 1], (p for ps in at_save for p in ps))), t
        assert not log

        # Another layout (torch_dist: the per-rank part not read), then other shards (its part
        # does not fit): agreed parameters and momentum kept, error buffers zero, nothing in flight.
        for start in (0, 5):
            params = [[p.clone() for p in ps] for ps in at_save]
            other = _outer_step(params, log, start)
            if start:
                fitted = {k: other.agreed[k] * 0.5 for k in other.agreed}
                other.load_state_dict({**sd, "agreed": fitted, "momentum": fitted})
            else:
                other.load_state_dict({**sd, "per_rank": None})
                fitted = sd["agreed"]
                assert not log  # the caller's one layout line says it
            assert all(torch.equal(other.agreed[k], fitted[k]) for k in fitted)
            assert not other.pending and all(not ch.comp1.state_dict()["error"].any()
                                             for _, ch, _, _ in other.channels.values())
            for t in range(5, 9):
                _inner(params, t)
                other.after_step(t)
        assert log == ["DiLoCo: the outer error buffers start at zero (this rank's shards of the model changed); "
                       "the outer exchanges in flight are dropped (this rank's shards of the model changed)"], log

        # Another --diloco-inner-steps: said in one line, with the exchange in flight dropped.
        log.clear()
        other = _outer_step([[p.clone() for p in ps] for ps in at_save], log)
        other.load_state_dict({**sd, "schedule": [8, 2, 1]})
        assert not other.pending and log == [
            "DiLoCo: the outer schedule changes from H 8, F 2, tau 1 (checkpoint) to H 4, F 2, tau 1: each "
            "fragment's next outer step follows the new one; the 1 outer exchange(s) in flight are dropped"], log
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saves(cache_dir, tmp_path_factory) -> dict:
    """{run: (stdout, metrics)} of the 2-rank runs (the ``*_same`` ones resume the ``*_ref``
    ones from iteration 4 in the same processes) and the checkpoint folders under ``root``."""
    tmp = tmp_path_factory.mktemp("diloco_ckpt")
    runs = [("torch_ref", STREAMING + ["--ckpt-format", "torch", "--save", str(tmp / "torch"), "--save-interval", "2"]),
            ("torch_same", STREAMING + ["--ckpt-format", "torch", "--load", str(tmp / "torch"),
                                        "--save", str(tmp / "torch2"), "--save-interval", "2"]),
            ("dist_ref", STREAMING + ["--save", str(tmp / "dist"), "--save-interval", "2"]),
            ("dist_same", STREAMING + ["--load", str(tmp / "dist"), "--save", str(tmp / "dist2"),
                                       "--save-interval", "2"]),
            ("fp32_ref", FP32_OUTER + ["--save", str(tmp / "fp32"), "--save-interval", "4"]),
            ("plain_ref", ["--save", str(tmp / "plain"), "--save-interval", "4"])]
    launch = torchrun_runs(2, ARGS, cache_dir, tmp, runs, resume_at=RESUME_AT)
    out = {name: finished_run(launch, runs, name) for name, _ in runs}
    out["root"] = tmp
    return out


def _same(a, b, where: str = "") -> list[str]:
    """Where two loaded states differ (tensors bit for bit; megatron's serialised objects
    unpickled; the wall-clock counter left out)."""
    if isinstance(a, io.BytesIO):
        a, b = (torch.load(io.BytesIO(x.getvalue()), weights_only=False) for x in (a, b))
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))[:4]}"]
        return [d for k in a if k != "train_time_s" for d in _same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")] + (
            [f"{where}: lengths {len(a)} {len(b)}"] if len(a) != len(b) else [])
    if torch.is_tensor(a):
        return [] if torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b) else [where]
    if isinstance(a, np.ndarray):  # numpy's RNG state
        return [] if np.array_equal(a, b) else [where]
    return [] if a == b else [f"{where}: {a} vs {b}"]


def _dcp(folder: pathlib.Path, out: pathlib.Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=False)


def test_mid_interval_resume_is_bit_exact(saves, tmp_path):
    """Guards against DiLoCo state missing from either checkpoint format or restored wrong:
    the agreed parameters, the outer momentum, the outer error buffers (4-bit outer
    gradients with error feedback), the settled mean of the exchange in flight at the save
    (Streaming, fragment 1 started at the saved step 4 and applied at 5), every replica's
    own model and inner Adam state (torch_dist: replica 1's are not replica 0's copies).
    The resumed runs' losses equal the uninterrupted ones and their final checkpoints equal
    theirs, every tensor bit for bit; nothing announces a reset. (And the start-up line of
    a replica of one rank does not promise a per-step reduce-scatter it never runs.)"""
    root = saves["root"]
    start = saves["torch_ref"][0]
    assert "no data-parallel group of more than one rank inside a DiLoCo replica" in start, start[:3000]
    assert "reduce-scatters" not in start
    for fmt in ("torch", "dist"):
        (_, ref), (out_b, resumed) = saves[f"{fmt}_ref"], saves[f"{fmt}_same"]
        a, b = train_losses(ref), train_losses(resumed)
        assert sorted(b) == [5, 6] and all(a[i] == b[i] for i in b), (fmt, a, b)
        notes = [ln for ln in out_b.splitlines() if "DiLoCo:" in ln and not
                 ln.startswith(("DiLoCo: 2 replicas of", "DiLoCo: final outer step at iteration 6"))]
        assert "re-seeded" not in out_b and not notes, out_b[-2000:]
    saved = torch.load(root / "torch" / "iter_0000004" / "rank_00000.pt", weights_only=False)["diloco"]
    assert list(saved["per_rank"]["pending"]) == ["opt0.fragment1"], saved["per_rank"]["pending"]
    assert saved["per_rank"]["exchange"]["opt0.fragment0"]["comp1"]["error"].any()
    assert any(m.any() for m in saved["momentum"].values())
    for rank in (0, 1):  # torch: one file per rank, replica 1 = rank 1
        x, y = (torch.load(root / d / "iter_0000006" / f"rank_{rank:05d}.pt", weights_only=False)
                for d in ("torch", "torch2"))
        assert not _same(x, y), _same(x, y)[:5]
    x, y = (_dcp(root / d / "iter_0000006", tmp_path / f"{d}.pt") for d in ("dist", "dist2"))
    assert not _same(x, y), _same(x, y)[:5]
    replica1 = [k for k in x if k.startswith("diloco.replica1.")]
    assert any(k.startswith("diloco.replica1.optimizer.state.exp_avg.") for k in replica1), sorted(x)[:20]
    one = [k for k in replica1 if k.endswith("decoder.layers.mlp.linear_fc1.weight")][0]
    assert not torch.equal(x[one], x[one.removeprefix("diloco.replica1.")])  # its own weights, not replica 0's


def _resumed(nproc: int, runs: list, cache_dir: str, tmp: pathlib.Path) -> dict:
    launch = torchrun_runs(nproc, ARGS, cache_dir, tmp, runs, resume_at=RESUME_AT)
    return {name: finished_run(launch, runs, name) for name, _ in runs}


@pytest.fixture(scope="module")
def reshards(saves, cache_dir, tmp_path_factory) -> dict:
    """The 4-rank resumes from iteration 4 of the 2-rank checkpoints, in fresh processes."""
    root = saves["root"]
    runs = [("inner_dp2", FP32_OUTER + ["--load", str(root / "fp32")]),
            ("inner_tp2", FP32_OUTER + ["--tensor-model-parallel-size", "2", "--load", str(root / "fp32")]),
            ("replicas4", STREAMING + ["--diloco-replicas", "4", "--load", str(root / "dist")]),
            ("without", ["--train-iters", "7", "--load", str(root / "fp32")]),
            ("from_plain", FP32_OUTER + ["--train-iters", "6", "--load", str(root / "plain")])]
    return _resumed(4, runs, cache_dir, tmp_path_factory.mktemp("diloco_reshard"))


def _one_reset_line(out: str, *parts: str) -> None:
    """Exactly one line says what started afresh (the DiLoCo start-up line aside), naming ``parts``."""
    lines = [line for line in out.splitlines() if "re-seeded" in line or (
        "DiLoCo:" in line and "replicas of" not in line and not line.startswith("DiLoCo: final outer step"))]
    assert len(lines) == 1 and RESET in lines[0] and all(p in lines[0] for p in parts), lines


def _identical_after_outer_steps(out: str, iters: list) -> None:
    """matrix_run.py's checks: inside each replica after every step, across replicas after each outer step."""
    import re

    checks = re.findall(r"IDENTICAL rank=(\d+) iter=(\d+) dense=(\w+) expert=(\w+) tp=(\w+) outer=(\S+)", out)
    assert checks and all("False" not in c for c in checks), checks
    assert sorted({int(i) for _, i, *_, o in checks if o == "True"}) == iters, checks


@pytest.mark.parametrize("run", ["inner_dp2", "inner_tp2"])
def test_reshard_to_another_inner_layout(run, saves, reshards):
    """Guards against agreed parameters or outer momentum lost or misplaced by a change of
    the replicas' inner layout (2 replicas of 1 rank -> 2 replicas of 2 ranks, DP2 or TP2
    inside each: each replica reads its own model and optimizer, the outer state reshards
    over DP or TP): the losses up to 7 (the outer step at 6 uses both) follow the
    uninterrupted run within the reduction order's rounding, and one line says what
    started afresh."""
    a, b = train_losses(saves["fp32_ref"][1]), train_losses(reshards[run][1])
    assert sorted(b) == [5, 6, 7] and all(b[i] == pytest.approx(a[i], rel=RESHARD_RTOL) for i in b), (a, b)
    out = reshards[run][0]
    _one_reset_line(out, "each replica takes its own model and optimizer", "agreed parameters and outer momentum "
                    "resharded")
    _identical_after_outer_steps(out, [6])


def test_reshard_to_another_replica_count(saves, reshards):
    """Guards against a resume with more replicas than saved crashing (keys of replicas 2
    and 3 that do not exist), leaving the new replicas on fresh weights, or silently
    dropping the exchange in flight and the error buffers: replica r of 4 takes saved
    replica r mod 2, the replicas agree after the next outer steps, training continues near
    the uninterrupted run, and one line names the replica mapping and what was dropped."""
    a, b = train_losses(saves["dist_ref"][1]), train_losses(reshards["replicas4"][1])
    assert sorted(b) == [5, 6] and b[5] == pytest.approx(a[5], rel=REPLICA_RTOL), (a, b)
    out = reshards["replicas4"][0]
    _one_reset_line(out, "replica r takes saved replica r mod 2", "outer error buffers start at zero",
                    "fragment(s) [1] in flight dropped")
    _identical_after_outer_steps(out, [])  # fragments sync one at a time: no step where all agree


def test_diloco_and_plain_checkpoints_load_into_each_other(saves, reshards):
    """Guards against a checkpoint of a run without DiLoCo failing to load under DiLoCo
    (no outer state to read) or leaving the replicas on different weights, and a DiLoCo
    checkpoint failing to load without DiLoCo: the plain checkpoint gives every replica its
    model (replicas agree after the outer step at 6; the first loss, replica 0's on its half
    of the global batch, is the plain run's whole-batch loss up to that sampling: well
    within a quarter of what 4 steps of training took off, which fresh weights would
    undo); the DiLoCo one gives the plain run replica 0's; each says so in one line."""
    a, b = train_losses(saves["plain_ref"][1]), train_losses(reshards["from_plain"][1])
    assert sorted(b) == [5, 6] and abs(b[5] - a[5]) < 0.25 * (a[1] - a[5]), (a, b)
    _one_reset_line(reshards["from_plain"][0], "the checkpoint has no outer state")
    _identical_after_outer_steps(reshards["from_plain"][0], [6])
    a, b = train_losses(saves["fp32_ref"][1]), train_losses(reshards["without"][1])
    assert sorted(b) == [5, 6, 7] and b[5] == pytest.approx(a[5], rel=REPLICA_RTOL), (a, b)
    assert b[7] < a[1] - 0.05, (a, b)
    _one_reset_line(reshards["without"][0], "this run has no --diloco-replicas: it takes replica 0's model")
