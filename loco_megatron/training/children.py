"""Forked helpers die with their rank.

megatron-core forks helper processes from a rank: the shard writers of every torch_dist
save (``FileSystemWriterAsync``, one per write bucket) and the background process of
``--async-save``. When the rank dies by SIGKILL (OOM
killer, torchrun ending a failed group, ``scancel --signal=KILL``) mid-write, a writer is
left blocked forever on a multiprocessing lock the dead rank held. It keeps the rank's
stdout, sockets and open data files (on a GPU node, its share of the CUDA context), so a
launcher that waits for the job's output never returns, and every restart leaks another.

``die_with_parent()`` registers an at-fork hook: a child forked from this process from then
on asks the kernel for SIGKILL when its parent exits (Linux ``PR_SET_PDEATHSIG``), and gets
the default SIGTERM/SIGUSR1 handlers back instead of the rank's "stop after this step" flag,
which a helper never reads. Children that exec (``subprocess``) are not affected: CPython
runs at-fork hooks only for ``os.fork``/``multiprocessing``. Call it once per process, from
the entry point.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> bool:
    """Register the hook; False (nothing done) where the platform has no ``prctl``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    parent = []  # the forking process's pid, set just before each fork (hooks run in that thread)

    def before() -> None:
        parent[:] = [os.getpid()]

    def after_in_child() -> None:
        # PDEATHSIG fires when the *thread* that forked exits; megatron forks from the
        # rank's main thread, which lives as long as the rank.
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if parent and os.getppid() != parent[0]:  # the parent died before prctl took effect
            os._exit(1)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (ValueError, OSError):  # not the interpreter's main thread: leave it
                pass

    os.register_at_fork(before=before, after_in_child=after_in_child)
    return True
