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
"""

from __future__ import annotations

import os
import pathlib
import signal
from typing import Callable, Optional

import torch
import torch.distributed as dist

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

    def agreed(self, device: torch.device, skipped: bool = False) -> tuple[Optional[str], bool]:
        """Collective (every rank, every step): the reason to stop now (or None), and whether
        any rank's optimizer skipped this step (``skipped``: this rank's; under DiLoCo each
        replica decides its own, and the skip guard must end every rank's run together)."""
        file_seen = bool(self.is_rank0 and self.stop_file and self.stop_file.exists())
        lost = bool(self.launcher_pid and os.getppid() != self.launcher_pid)  # reparented: the agent died
        flags = torch.tensor([float(self.signum), float(file_seen), float(skipped), float(lost)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signum, file_flag, skipped_any, lost_any = (int(v) for v in flags.tolist())
        if lost_any:
            self.orphaned = (f"the torchrun agent (pid {self.launcher_pid}) exited and nothing supervises the "
                             f"ranks any more: stopped")
            return f"torchrun agent pid {self.launcher_pid} exited", bool(skipped_any)
        if not (signum or file_flag):
            return None, bool(skipped_any)
        if file_seen:
            self.stop_file.unlink(missing_ok=True)  # honoured: must not stop the next run too
        return (f"{signal.Signals(signum).name} received" if signum else f"stop file {self.stop_file}",
                bool(skipped_any))
