"""Helper processes live and die with their rank, and leave stopping to it.

megatron-core starts helper processes from a rank: the shard writers of every torch_dist
save (``FileSystemWriterAsync``, forked, one per write bucket), the background process of
``--async-save`` (forked) and the writers' result ``SyncManager`` (spawned, see
:func:`loco_megatron.checkpoint.torch_dist.start_writer_manager_detached`; started under
:func:`main_not_rerun`, it does not run the rank's script again). Two rules:

- **They ignore the stop signals** (SIGTERM, SIGUSR1, SIGINT). torchrun forwards the
  SIGTERM it gets with ``killpg`` to each worker's whole process group and Slurm sends
  it to every process of the step, so the helpers receive it together with their rank.
  The rank answers with a stop save, which needs them: a helper that died of the signal
  (the Manager, a write in flight) turned that save into "broken pipe" and lost the step.
- **They die with their rank** (Linux ``PR_SET_PDEATHSIG`` = SIGKILL). When the rank dies
  by SIGKILL (OOM killer, torchrun ending a failed group) mid-write, a writer is left
  blocked forever on a multiprocessing lock the dead rank held, keeping the rank's
  stdout, sockets and open files (on a GPU node, its share of the CUDA context), so a
  launcher that waits for the job's output never returns and every restart leaks another.

``die_with_parent()`` applies both to every child forked from then on (an at-fork hook;
CPython runs those for ``os.fork``/``multiprocessing`` only, not for ``subprocess``); a
spawned helper calls :func:`become_helper` first thing and is started inside
:func:`stop_signals_blocked`, so no signal finds it between its start and that call.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from typing import Iterator

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HELPER_IGNORED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""What launchers and schedulers send to stop a job: the rank decides how to stop, the
helpers it needs for that ignore them."""


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def become_helper(parent: int) -> None:
    """Run first in a helper process of the rank ``parent``: SIGKILL when the rank exits,
    the stop signals ignored. Exits at once when the rank is already gone."""
    prctl = _prctl()
    if prctl is not None:
        # PDEATHSIG fires when the *thread* that started the helper exits; megatron starts
        # them from the rank's main thread, which lives as long as the rank.
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the rank died before prctl took effect
        os._exit(1)
    for sig in HELPER_IGNORED:
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):  # not the interpreter's main thread: leave it
            pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELPER_IGNORED)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Around starting a helper that execs (multiprocessing's spawn): it inherits the
    blocked mask, so a stop signal sent before its :func:`become_helper` ran stays pending
    instead of killing it; this process gets its own once the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HELPER_IGNORED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def main_not_rerun() -> Iterator[None]:
    """Around starting a spawned helper that needs nothing of the rank's script (the
    writers' result Manager): multiprocessing's spawn runs the parent's ``__main__`` again
    in the child, by its ``__spec__`` name or else its ``__file__`` (pretrain_gpt.py: its
    imports are torch, megatron-core and this package: seconds of CPU per rank, and
    another copy of torch in memory), unless ``__main__`` has neither. Hide both while the
    child starts (the preparation data is taken in this thread during ``start()``), then
    put them back."""
    main = sys.modules["__main__"]
    saved = {key: main.__dict__[key] for key in ("__spec__", "__file__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def die_with_parent() -> bool:
    """Register the at-fork hook; False (nothing done) where the platform has no ``prctl``."""
    if _prctl() is None:
        return False
    parent = []  # the forking process's pid, set just before each fork (hooks run in that thread)

    def before() -> None:
        parent[:] = [os.getpid()]

    def after_in_child() -> None:
        become_helper(parent[0])

    os.register_at_fork(before=before, after_in_child=after_in_child)
    return True
