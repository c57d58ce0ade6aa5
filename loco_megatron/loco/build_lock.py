"""The lock around a build (or a load) of the C++ CPU kernels in one build folder, and what a
process that has to wait on it does.

Every process of ours that builds or loads the kernels holds an ``flock`` on
``<build folder>/loco_build.flock`` meanwhile (:func:`build_lock`) and writes who it is
into that file (:class:`Holder`). A process that finds the lock taken:

- **says what it waits for**, after :data:`NOTE_EVERY_S` and every :data:`NOTE_EVERY_S`
  after that (a first build takes minutes; a silent wait looks hung);
- **never waits on a niced build at that build's priority.** The background build that a
  run with ``--loco-kernels auto`` starts runs under ``nice 10`` (so it never slows the
  training ranks beside it) in a session of its own; on a busy machine it takes most of
  an hour. A process that needs the kernels now (a test, ``--loco-kernels cpu``) raises
  every process of that session (the build, ninja, each compiler: ninja puts each
  compiler in a process group of its own, so the session is what holds them all) to its
  own priority, and waits for the build to finish. That keeps the finished work of the
  build and builds nothing twice; a second build in a folder of its own would compile
  everything again, on cores the niced build still takes a share of. Raising a priority
  needs root (or ``CAP_SYS_NICE``); where it is refused, the waiter stops the niced
  build instead (SIGTERM to its process group; ninja passes it to the compilers and
  removes their unfinished objects) and builds in the same folder itself, at its own
  priority, which reuses every object file the stopped build finished.

A build in the foreground of another process (a test session, a ``--loco-kernels cpu``
rank) runs at that process's priority and is only waited for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import signal
import sys
import time
from typing import Callable, Iterator, Optional

LOCK_FILE = "loco_build.flock"
NOTE_EVERY_S = 20.0
"""Seconds of waiting before the first line saying what for, and between two such lines."""
POLL_S = 0.25
"""Seconds between two tries of the lock while waiting (each also re-raises the build's
priority: a compiler that ninja started between two tries inherits it from ninja anyway)."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds the build lock, as its holder wrote it into the lock file."""

    pid: int
    session: int
    """Its session id; a background build runs in a session of its own, whose id is its pid
    and its process group's."""
    started: float
    """``time.time()`` when it took the lock."""
    log: Optional[str]
    """Where its output goes (the background build's ``build.log``); None: its own terminal."""
    background: bool
    """The niced background build (``python -m loco_megatron.loco.cpu_kernels``)."""

    def describe(self) -> str:
        log = f", log {self.log}" if self.log else ""
        return f"pid {self.pid}, started {time.time() - self.started:.0f} s ago{log}"


def _say(line: str) -> None:
    # sys.stderr looked up at each call: a test fixture that lifts pytest's capture swaps it
    print(line, file=sys.stderr, flush=True)


def read_holder(lock_file: pathlib.Path) -> Optional[Holder]:
    """The holder recorded in ``lock_file``, or None (none recorded yet, or it has exited)."""
    try:
        holder = Holder(**json.loads(lock_file.read_text()))
        os.kill(holder.pid, 0)
    except (OSError, ValueError, TypeError):  # no record, a half-written one, or a dead pid
        return None
    return holder


def session_members(session: int) -> list[int]:
    """The thread ids of every live process in ``session`` (Linux ``/proc``; elsewhere only
    the session leader, whose pid is the session id). A thread is what a nice value belongs to."""
    proc = pathlib.Path("/proc")
    if not proc.is_dir():
        return [session]
    tids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
            # A zombie (a stopped build its starter has not reaped) runs nothing.
            state, _, _, sid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:4]
            if int(sid) == session and state not in "ZX":
                tids += [int(t.name) for t in (entry / "task").iterdir()]
        except (OSError, IndexError, ValueError):  # exited while being read
            continue
    return tids


def raise_priority(session: int, nice: int) -> bool:
    """Every thread of ``session`` whose nice value is above ``nice`` set to ``nice``; True
    when one was. PermissionError where this process may not raise priorities."""
    raised = False
    for tid in session_members(session):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                raised = True
        except ProcessLookupError:  # exited meanwhile
            continue
    return raised


class _Waiter:
    """One wait for the lock: the lines it prints and what it did to a niced build."""

    def __init__(self, lock_file: pathlib.Path, say: Callable[[str], None], note_every_s: float):
        self.lock_file, self.say, self.every = lock_file, say, note_every_s
        self.t0 = time.monotonic()
        self.next_note = self.t0 + note_every_s
        self.nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.raised: set[int] = set()  # sessions raised (announced once each)
        self.stopped: set[int] = set()  # sessions stopped (or that may not be)

    def step(self) -> None:
        holder = read_holder(self.lock_file)
        if holder is not None and holder.background and holder.session not in self.stopped:
            self._hurry(holder)
        if time.monotonic() >= self.next_note:
            self.next_note += self.every
            what = (f"the C++ kernels' build ({holder.describe()})" if holder is not None
                    else f"the C++ kernels' build lock ({self.lock_file}, held by another process)")
            self.say(f"loco: waiting for {what} ... ({time.monotonic() - self.t0:.0f} s so far)")

    def _hurry(self, holder: Holder) -> None:
        try:
            if raise_priority(holder.session, self.nice) and holder.session not in self.raised:
                self.raised.add(holder.session)
                self.say(f"loco: raised the C++ kernels' background build ({holder.describe()}) to this "
                         f"process's priority (nice {self.nice}), which waits for it")
            return
        except PermissionError:
            pass
        self.stopped.add(holder.session)
        try:
            os.killpg(holder.session, signal.SIGTERM)
        except OSError:  # another user's build: it can only be waited for
            return
        self.say(f"loco: stopped the niced background build of the C++ kernels ({holder.describe()}): raising "
                 f"its priority needs root; this process builds them in the same folder at its own priority, "
                 f"reusing what that build finished")
        # ninja removes its unfinished objects after the build's process has died (and its
        # lock is free): the folder is left to this process once the whole session is gone.
        deadline = time.monotonic() + 30
        while session_members(holder.session) and time.monotonic() < deadline:
            time.sleep(0.05)
        if holder.log:  # its last line (ninja writes to it until it has gone)
            with contextlib.suppress(OSError), open(holder.log, "a") as log:
                log.write(f"stopped by pid {os.getpid()}, which builds the kernels at its own priority\n")


@contextlib.contextmanager
def build_lock(build_dir: pathlib.Path, background: bool = False, log: Optional[pathlib.Path] = None,
               say: Callable[[str], None] = _say, note_every_s: float = NOTE_EVERY_S) -> Iterator[None]:
    """Hold the build lock of ``build_dir`` (created) while torch builds or loads the
    extension there, recorded as this process (``background``: the niced background build,
    writing to ``log``); waiting for it as the module docstring says, ``say`` getting the
    lines (default: this process's stderr). Also clears a stale torch build lock.

    torch's own lock is a plain file (``build_dir/lock``) created by the process that
    builds and removed when it finishes; a build killed part-way (Ctrl-C, a job time
    limit, an OOM kill) leaves it behind, and every later start then waits on it forever.
    The kernel drops a flock when its holder dies: so once we hold it, no live build of
    ours is running, and a ``lock`` file left in the folder is stale. It is removed with
    one printed line. Processes queue on the flock exactly as they would have on torch's
    lock (the first builds, the others then only load)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    lock_file = build_dir / LOCK_FILE
    with open(lock_file, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiter = _Waiter(lock_file, say, note_every_s)
            while True:
                waiter.step()
                time.sleep(POLL_S)
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    continue
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(dataclasses.asdict(Holder(os.getpid(), os.getsid(0), time.time(),
                                                              str(log) if log else None, background))))
            handle.flush()
            stale = build_dir / "lock"
            if stale.exists():
                say(f"loco: removed {stale}, a build lock left by an interrupted build of the C++ kernels")
                stale.unlink(missing_ok=True)
            yield
        finally:
            handle.seek(0)
            handle.truncate()  # a waiter never reads a holder that has gone
            fcntl.flock(handle, fcntl.LOCK_UN)
