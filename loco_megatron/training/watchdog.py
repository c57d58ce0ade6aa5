"""Heartbeats: a rank that stops responding ends the job within minutes, in one line naming it.

A stopped rank (SIGSTOP, a frozen node, a lost network) leaves the others blocked in their
next collective until its timeout (``--distributed-timeout-minutes``, 10 by default), which
then ends the job with a gloo or NCCL traceback that does not say which rank was at fault.
Each rank runs a :class:`Watchdog` during training instead: every few seconds a thread
writes a heartbeat (a count and the rank's last finished iteration) to the job's TCP store
(the one its process groups rendezvous through, hosted by the torchrun agent or by rank
0), rank 0 reads every rank's and the others read rank 0's. A heartbeat that has not
changed for ``timeout_s``, or a store that has not answered for that long, is reported by
one rank (the first to claim the report in the store, else in the folder its torchrun
agent shares with its ranks): one line on stderr and in torchrun's error file, then that
rank exits with :data:`EXIT_CODE` and torchrun stops the job.

Its threads only read and write the store: no collective, nothing on the training step's
path but an integer assignment (:attr:`Watchdog.iteration`). A thread keeps beating while
its rank waits in a collective, saves a checkpoint or computes, so the timeout does not
depend on how long those take; it stops only when the whole process does (or a native call
holds Python's lock that long).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

from loco_megatron.cli import LaunchEnv
from loco_megatron.config import TrainConfig
from loco_megatron.error_report import emit_error, first_to_report

EXIT_CODE = 3
"""A rank that reports a silent one exits with this (as an agreed abort does)."""
DONE = "done"
"""A heartbeat value that means "left training normally": no longer watched."""


def watchdog_for(env: LaunchEnv, train: TrainConfig, rank: int, world_size: int) -> Optional["Watchdog"]:
    """This rank's watchdog (not started), or None: a single rank, no TCP store (not started
    by torchrun or an ``env://`` launcher) or ``--heartbeat-timeout-seconds 0``.

    Its timeout is --heartbeat-timeout-seconds, at most half the collectives' timeout
    (:attr:`LaunchEnv.distributed_timeout_s` or --distributed-timeout-minutes), so the line
    naming the silent rank comes before any collective times out with a traceback."""
    collective_s = env.distributed_timeout_s or train.distributed_timeout_minutes * 60.0
    timeout_s = min(float(train.heartbeat_timeout_seconds), collective_s / 2)
    if world_size < 2 or env.store_at is None or timeout_s <= 0:
        return None
    return Watchdog(env.store_at, "the torchrun agent" if env.agent_store else "rank 0", rank, world_size, timeout_s,
                    env.restart_count, lambda line: emit_error(line, env.error_file),
                    lambda: first_to_report(env.error_file))


class Watchdog:
    """This rank's heartbeat (see the module docstring): two daemon threads.

    The beater talks to the store: it writes this rank's heartbeat and reads the watched
    ranks' every ``interval_s``. A store op can block for good (a client waiting for a
    stopped server's answer does not time out), so the judge decides on the clock alone:
    every ``interval_s`` it compares the beater's last answer and the heartbeats it read
    with ``timeout_s``.

    ``store_at``: (host, port) of the job's TCP store; ``store_host``: who hosts it, for
    the line ("the torchrun agent" or "rank 0"); ``attempt``: torchrun's restart count
    (keys of another attempt are never read); ``report``: prints the line and writes
    torchrun's error file; ``claim_locally``: whether this rank reports when the store
    cannot say (:func:`~loco_megatron.error_report.first_to_report`).
    """

    def __init__(self, store_at: tuple[str, int], store_host: str, rank: int, world_size: int, timeout_s: float,
                 attempt: int, report: Callable[[str], None], claim_locally: Callable[[], bool]):
        self.store_at, self.store_host = store_at, store_host
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.interval_s = min(max(timeout_s / 6, 0.5), 10.0)
        self.prefix = f"loco_megatron/attempt_{attempt}/watchdog"
        self.report, self.claim_locally = report, claim_locally
        self.iteration = 0
        """This rank's last finished iteration (the training loop sets it after each step)."""
        self.watched = tuple(range(1, world_size)) if rank == 0 else (0,)
        """Rank 0 watches every rank, the others watch rank 0 (replaced whole: two threads read it)."""
        self._answer: tuple[float, dict] = (time.monotonic(), {})
        """(when the store last answered, {rank: its heartbeat then}); replaced whole (atomic)."""
        self._who: dict[int, str] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "Watchdog":
        self._answer = (time.monotonic(), {})
        self._threads = [threading.Thread(target=run, name=name, daemon=True)
                         for run, name in ((self._beat, "loco-heartbeat"), (self._judge, "loco-watchdog"))]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; the beater marks this rank done (it left training: not silent)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.interval_s + 5.0)  # a beater blocked on a dead store is left behind
        self._threads = []

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/beat/{rank}"

    def _beat(self) -> None:
        beats, store = 0, None
        while True:
            try:
                if store is None:
                    host, port = self.store_at
                    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                          timeout=datetime.timedelta(seconds=max(self.timeout_s, 1.0)))
                    store.set(f"{self.prefix}/who/{self.rank}", f"pid {os.getpid()} on {socket.gethostname()}")
                if self._stop.is_set():
                    store.set(self._key(self.rank), DONE)
                    return
                beats += 1
                store.set(self._key(self.rank), f"{beats} {self.iteration}")
                # Ranks that have beaten are read in one round trip; the others key by key until they have.
                known = [r for r in self.watched if r in self._who]
                for r in self.watched:
                    if r not in self._who and store.check([self._key(r)]):
                        who = f"{self.prefix}/who/{r}"
                        self._who[r] = store.get(who).decode() if store.check([who]) else ""
                        known.append(r)
                values = store.multi_get([self._key(r) for r in known]) if known else []
                self._answer = (time.monotonic(), {r: v.decode() for r, v in zip(known, values)})
                wait = self.interval_s
            except dist.DistError:  # refused or reset: reconnect, a few times per timeout (each failure logs)
                store, wait = None, self.timeout_s / 3
            if self._stop.wait(wait) and store is None:
                return

    def _judge(self) -> None:
        """A rank is judged once it has beaten: one that never reaches training is left to
        the collectives' timeout, like the rest of start-up."""
        changed: dict[int, tuple[str, float]] = {}  # rank -> (its last heartbeat, when it changed)
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            answered, seen = self._answer
            if now - answered >= self.timeout_s:
                self._end(self._store_line(now - answered), via_store=False)
                return
            for r, beat in seen.items():
                if beat == DONE:
                    self.watched = tuple(w for w in self.watched if w != r)
                    changed.pop(r, None)
                elif changed.get(r, ("",))[0] != beat:
                    changed[r] = (beat, now)
            silent = [(now - since, r) for r, (_, since) in changed.items() if now - since >= self.timeout_s]
            if silent:
                silent_s, r = max(silent)
                self._end(self._rank_line(r, silent_s), via_store=True)
                return

    def _rank_line(self, rank: int, silent_s: float) -> str:
        where = f" ({self._who[rank]})" if self._who.get(rank) else ""
        return (f"rank {rank}{where} is not responding: no heartbeat for {silent_s:.0f} s (stopped, frozen, or its "
                f"node or network is down); rank {self.rank} has finished iteration {self.iteration}; ending the job: "
                f"check that node, then restart from the latest checkpoint (--load; --heartbeat-timeout-seconds sets "
                f"the wait)")

    def _store_line(self, silent_s: float) -> str:
        host, port = self.store_at
        return (f"{self.store_host}, which hosts the job's store at {host}:{port}, is not responding: no answer for "
                f"{silent_s:.0f} s (stopped, frozen, or its node or network is down); rank {self.rank} has finished "
                f"iteration {self.iteration}; ending the job: check that node, then restart from the latest checkpoint "
                f"(--load; --heartbeat-timeout-seconds sets the wait)")

    def _end(self, line: str, via_store: bool) -> None:
        """Report ``line`` and end this process, unless another rank claimed the report
        (then torchrun stops this one once the reporter has exited). The claim is a counter
        in the store while it answers (a client of its own: the beater's may be busy), else
        the marker of this node's torchrun agent."""
        first = None
        if via_store:
            try:
                host, port = self.store_at
                store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=max(self.timeout_s, 1.0)))
                first = store.add(f"{self.prefix}/reported", 1) == 1
            except dist.DistError:
                pass
        if first is None:
            first = self.claim_locally()
        if not first:
            return
        self.report(line)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_CODE)  # the main thread waits in a collective that will not return
