"""Graceful stop: SIGTERM, SIGUSR1 and ``--stop-file`` become one decision all ranks share.

Slurm sends SIGTERM on preemption and ``scancel`` (to every process of the step) and,
with ``--signal=USR1@N``, SIGUSR1 before the time limit; torchrun forwards the SIGTERM
it receives to its workers. The handler only records the signal (no I/O: it may run
between any two bytecodes). At the end of every step each rank contributes what it saw
to one tiny all-reduce, so every rank stops after the same iteration, then saves and
exits 0, even when the signal reached the ranks at different steps.

The same all-reduce carries whether the torchrun agent that started the rank is still its
parent: when the agent dies (``kill -9``, an OOM kill) nothing supervises the ranks any
more (no restart, no shutdown of a failed group), so they stop at the same step, save it
and leave with an error instead of training on under init.

Under DiLoCo that all-reduce runs inside each replica only (``group``: the replica's
ranks), so no step waits on the link between sites; the replicas agree on a stop at their
outer steps (:mod:`loco_megatron.diloco.flags`), carrying :meth:`StopRequest.wish`.
"""

from __future__ import annotations

import os
import pathlib
import signal
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.diloco.flags import ABORT_REPLICA, AGENT_LOST, SIGNUM, STOP_FILE, STOP_REPLICA
from loco_megatron.training.health import RunAborted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """This rank's view of "stop after this step", and the agreed decision.

    ``stop_file``: path whose existence (seen by rank 0) asks for a stop; honoured files
    are removed so the next job does not stop after one step; one older than this run
    (``started_at``, seconds since the epoch) is stale: reported and removed at start-up.
    """

    def __init__(self, stop_file: Optional[str], is_rank0: bool, started_at: float,
                 print_fn: Callable = print, launcher_pid: Optional[int] = None):
        self.stop_file = pathlib.Path(stop_file) if stop_file else None
        self.is_rank0, self.started_at, self.print = is_rank0, started_at, print_fn
        self.launcher_pid = launcher_pid
        """The torchrun agent (this rank's parent) to watch; None: nothing to watch."""
        self.orphaned = ""
        """Once agreed: the line saying the agent is gone (the run must end non-zero)."""
        self.signum = 0
        self._previous: dict = {}
        self._wish = [0, 0, 0]

    def _handler(self, signum, frame) -> None:
        self.signum = signum  # flag only: the loop acts on it at the end of the step

    def install(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def discard_stale_file(self) -> None:
        """Rank 0: a stop file written before this run started is left over from an earlier
        job; remove it (with a warning) instead of stopping after the first step."""
        if not (self.is_rank0 and self.stop_file and self.stop_file.exists()):
            return
        if self.stop_file.stat().st_mtime < self.started_at:
            self.print(f"warning: --stop-file {self.stop_file} predates this run; ignoring and removing it",
                       flush=True)
            self.stop_file.unlink(missing_ok=True)

    def agreed(self, device: torch.device, skipped: bool = False, group=None) -> tuple[Optional[str], bool]:
        """Collective over ``group`` (None: the world; every rank of it, every step): the
        reason to stop now (or None), and whether any rank's optimizer skipped this step
        (``skipped``: this rank's). The group's answer is also kept as :meth:`wish` (what
        this replica asks of the others at the next outer step)."""
        file_seen = bool(self.is_rank0 and self.stop_file and self.stop_file.exists())
        lost = bool(self.launcher_pid and os.getppid() != self.launcher_pid)  # reparented: the agent died
        flags = torch.tensor([float(self.signum), float(file_seen), float(skipped), float(lost)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        signum, file_flag, skipped_any, lost_any = (int(v) for v in flags.tolist())
        # Latched: a stop wish stays until the stop happens (under DiLoCo, at an outer step).
        self._wish = [max(a, b) for a, b in zip(self._wish, (signum, file_flag, lost_any))]
        return self.reason(*self._wish), bool(skipped_any)

    def wish(self) -> list[int]:
        """``[signal number, stop file seen, agent lost]`` agreed inside the group so far (0: no)."""
        return list(self._wish)

    def reason(self, signum: int, file_flag: int, lost_any: int) -> Optional[str]:
        """The stop reason of agreed flags (None: no stop); sets :attr:`orphaned` when an
        agent is gone."""
        if lost_any:
            who = (f"the torchrun agent (pid {self.launcher_pid})" if self.launcher_pid and self._wish[2]
                   else "a torchrun agent (of another replica)")
            self.orphaned = f"{who} exited and nothing supervises the ranks any more: stopped"
            return f"{who} exited"
        if not (signum or file_flag):
            return None
        return f"{signal.Signals(signum).name} received" if signum else f"stop file {self.stop_file}"

    def honour(self) -> None:
        """The stop happens now: a stop file this rank saw is removed, so that the next job
        does not stop after one step."""
        if self.is_rank0 and self.stop_file and self._wish[1]:
            self.stop_file.unlink(missing_ok=True)


def decide(agreed: list[int], stop: StopRequest, own_abort: Optional[str], replicas: int) -> Optional[str]:
    """The stop reason from flags every rank agreed on (:mod:`loco_megatron.diloco.flags`),
    None to go on; raises RunAborted (the same on every rank) when a replica's skip guard
    gave up (``own_abort``: this replica's line, if it was this one)."""
    if agreed[ABORT_REPLICA]:
        raise RunAborted(own_abort or f"--max-skipped-consecutive: replica {agreed[ABORT_REPLICA] - 1} skipped "
                                      f"too many consecutive steps for NaN/Inf gradients; every replica stops "
                                      f"without saving, earlier checkpoints are kept")
    reason = stop.reason(agreed[SIGNUM], agreed[STOP_FILE], agreed[AGENT_LOST])
    if reason is None:
        return None
    stop.honour()
    return f"{reason} on replica {agreed[STOP_REPLICA] - 1}" if replicas > 1 else reason
