"""pretrain_gpt.py of one elastic DiLoCo replica, with what tests/test_elastic.py checks.

Each rank appends one JSON line per outer cycle to ``$LOCO_TEST_DUMP_DIR/replica<R>_rank<K>.jsonl``
(after the join, after every sync point's cycle, after the run's final step):
``{"at", "iteration", "outer_steps", "agreed", "momentum", "steps", "live"}`` with
``agreed``/``momentum`` SHA-256 digests of this rank's shards (rank k holds the same shards
in every replica; after the final step also ``final``, of the model every replica ends
on) and ``steps`` the ``[consumed samples, share offset, share samples, data rank, data
ranks]`` each training step since the last line started from (the sample stream it read). ``LOCO_TEST_DIE_IN_EXCHANGE=T``: the
rank SIGKILLs itself right after launching its first outer exchange at iteration ``T``
(mid-exchange: its peers are waiting on it). ``LOCO_TEST_FAULTS=PHASE@T=MODE,...``: the
collective of ``PHASE`` ("fingerprint", "agreement", "outer"; "heal": taking a healed state)
in the cycle at iteration ``T`` fails once on this replica, ``raise`` (never issued: the
peers wait on it) or ``lost`` (it completes, then fails here only)
(:attr:`~loco_megatron.diloco.elastic.coordinator.ElasticCoordinator.faults`), or ``stop``
(the rank touches ``replica<R>_rank<K>.stopped.<T>`` in the dump folder and SIGSTOPs
itself there, inside the cycle: a test continues it); each injection appends
``{"at": "fault", ...}`` to the dump. ``LOCO_TEST_HOLD_AT=T1,T2,..`` with
``LOCO_TEST_RELEASE=PATH``: after step ``Ti`` the rank waits until ``PATH.Ti`` exists (a
test holds the live replicas before a sync point until a (re)started one is about to ask;
while held the rank touches ``replica<R>_rank<K>.held.<Ti>`` in the dump folder).
Before its join every rank touches ``replica<R>_rank<K>.asking.<pid>`` in the dump folder,
and before each sync point's cycle ``replica<R>_rank<K>.cycle.<T>``.
``LOCO_TEST_STOP_AT=T``: after step ``T`` the rank touches ``replica<R>_rank<K>.stopped.<T>``
and SIGSTOPs itself (a stalled node, at a known step: a test continues it).
``LOCO_TEST_DELAY=K:join=S,K:T=S,...``: rank ``K`` sleeps ``S`` seconds before its join, or
before the cycle at iteration ``T`` (a rank that arrives late: the others wait on it).
``LOCO_TEST_PERTURB=1``: before its join the replica's agreed parameters move by 1e-3 on
its lane hosts (replicas whose states differ at the start: they must agree on one).
``LOCO_TEST_DUMP_LAYS=1``: each re-lay of the channels (other replicas take part) appends
``{"at": "lay", "iteration", "for", "before", "after", "nonzero", "dropped"}``: the digests of
the SparseLoCo error buffers (the channels whose state outlives a re-lay) before and after
it, whether they held anything before, and whether the re-lay dropped other error buffers;
and every other line gets ``errors``: whether those buffers hold anything.
"""

import hashlib
import json
import os
import pathlib
import signal
import sys
import time
import warnings

import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.config import ConfigError
from loco_megatron.diloco import exchange
from loco_megatron.diloco.setup import build_outer_step
from loco_megatron.error_report import report_error
from loco_megatron.failures import RunAborted
from loco_megatron.training.trainer import train


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        if tensors[key] is not None:
            h.update(key.encode())
            h.update(tensors[key].detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def checked_outer_step(config, chunks, optimizer, stats, log, coordinator=None):
    outer = build_outer_step(config, chunks, optimizer, stats, log, coordinator=coordinator)
    out = pathlib.Path(os.environ["LOCO_TEST_DUMP_DIR"]) / \
        f"replica{config.diloco.diloco_replica_id}_rank{dist.get_rank()}.jsonl"
    die_at = int(os.environ.get("LOCO_TEST_DIE_IN_EXCHANGE", "0"))
    now = {"t": 0}

    lays = bool(os.environ.get("LOCO_TEST_DUMP_LAYS"))

    def errors() -> dict:
        return {k: ch.comp1.error for k, (_, ch, _, _) in outer.channels.items()
                if getattr(ch, "world_independent", False) and ch.comp1 is not None}

    def dump(at: str, t: int) -> None:
        record = {"at": at, "iteration": outer._progress().get("iteration", t), "outer_steps": outer.outer_steps,
                  "agreed": _digest(outer.agreed), "momentum": _digest(outer.momentum), "steps": list(STEPS),
                  "live": outer.coordinator.live}
        if lays:
            record["errors"] = any(bool(e.any()) for e in errors().values())
        if at == "final":
            record["final"] = _digest(outer.final) if outer.final is not None else None
        STEPS.clear()
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    join, after_step, finish = outer.join, outer.after_step, outer.finish

    hold_at = {int(x) for x in os.environ.get("LOCO_TEST_HOLD_AT", "").split(",") if x}
    stop_at = {int(x) for x in os.environ.get("LOCO_TEST_STOP_AT", "").split(",") if x}

    delays = {}
    for item in filter(None, os.environ.get("LOCO_TEST_DELAY", "").split(",")):
        where, seconds = item.split("=")
        rank, when = where.split(":")
        if int(rank) == dist.get_rank():
            delays[when] = float(seconds)

    def joined(t: int) -> None:
        time.sleep(delays.get("join", 0.0))
        if os.environ.get("LOCO_TEST_PERTURB"):
            for a in outer.agreed.values():
                a.add_(1e-3)
        out.with_name(f"{out.stem}.asking.{os.getpid()}").touch()
        join(t)
        dump("join", t)

    def after(t: int) -> None:
        now["t"] = t
        if outer.schedule.starts(t):
            time.sleep(delays.get(str(t), 0.0))
            out.with_name(f"{out.stem}.cycle.{t}").touch()
        after_step(t)
        if outer.schedule.starts(t) or outer.schedule.applies(t):
            dump("cycle", t)
        if t in stop_at:
            out.with_name(f"{out.stem}.stopped.{t}").touch()
            os.kill(os.getpid(), signal.SIGSTOP)
        if t in hold_at:
            out.with_name(f"{out.stem}.held.{t}").touch()
            release, deadline = pathlib.Path(f"{os.environ['LOCO_TEST_RELEASE']}.{t}"), time.monotonic() + 900
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.2)

    def finished(t: int, exchange: bool = True) -> dict:
        done = finish(t, exchange)
        dump("final", t)
        return done

    outer.join, outer.after_step, outer.finish = joined, after, finished
    faults = {}
    for item in filter(None, os.environ.get("LOCO_TEST_FAULTS", "").split(",")):
        where, mode = item.split("=")
        phase, at = where.split("@")
        faults[phase, int(at)] = mode

    def fault(phase: str):
        mode = faults.pop((phase, outer._progress().get("iteration", 0)), None)
        if mode:
            with out.open("a") as f:
                f.write(json.dumps({"at": "fault", "phase": phase, "mode": mode,
                                    "iteration": outer._progress().get("iteration", 0)}) + "\n")
        if mode == "stop":  # (stalled inside the cycle: its heartbeats stop with it)
            out.with_name(f"{out.stem}.stopped.{outer._progress().get('iteration', 0)}").touch()
            os.kill(os.getpid(), signal.SIGSTOP)
            return None
        return mode

    if faults:
        outer.coordinator.faults = fault
    start = exchange.OuterChannel.start

    def start_then_die(self, delta):
        work = start(self, delta)
        if die_at and now["t"] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-exchange: phase 1 launched, the peers wait on it
        return work

    exchange.OuterChannel.start = start_then_die
    if lays:
        lay = outer._lay

        def laid(contributors: tuple) -> bool:
            before, nonzero = _digest(errors()), any(bool(e.any()) for e in errors().values())
            dropped = lay(contributors)
            record = {"at": "lay", "iteration": outer._progress().get("iteration", now["t"]),
                      "for": list(contributors), "before": before, "after": _digest(errors()), "nonzero": nonzero,
                      "dropped": dropped}
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            return dropped

        outer._lay = laid
    return outer


STEPS: list = []
"""``[consumed samples, share offset, share samples, data rank, data ranks]`` of each step
since the last dump."""


def _recording_step(step):
    def recorded(self):
        STEPS.append([self.consumed_samples, self.offset, self.samples, self.dp_rank, self.dp_size])
        return step(self)
    return recorded


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    from loco_megatron.data.dataset import MicroBatchIterator

    MicroBatchIterator.step = _recording_step(MicroBatchIterator.step)
    config, env = main_config(sys.argv[1:])
    try:  # as pretrain_gpt.py: a refusal is one line and exit status 2, a run that cannot end well 3
        train(config, env, outer_step_factory=checked_outer_step)
    except ConfigError as e:
        report_error(e, env.rank, env.error_file)
        sys.exit(2)
    except RunAborted as e:
        report_error(e, env.rank, env.error_file)
        sys.exit(3)
