"""Forked helpers (megatron's checkpoint writers) do not outlive a killed rank."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

from conftest import REPO

# A "rank": optionally registers the hook, installs the trainer's flag-only SIGTERM handler,
# forks a helper the way megatron's FileSystemWriterAsync does, prints its pid and waits.
RANK = textwrap.dedent("""
    import multiprocessing as mp, signal, sys, time
    from loco_megatron.training.children import die_with_parent
    if sys.argv[1] == "hook":
        assert die_with_parent()
    signal.signal(signal.SIGTERM, lambda *a: None)  # the rank's "stop after this step" flag
    helper = mp.get_context("fork").Process(target=time.sleep, args=(120,))
    helper.start()
    print(helper.pid, flush=True)
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie waiting for init to reap it is dead


def _helper_after_rank_killed(mode: str) -> tuple[int, bool]:
    rank = subprocess.Popen([sys.executable, "-c", RANK, mode], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    helper = int(rank.stdout.readline())
    rank.kill()
    rank.wait()
    deadline = time.monotonic() + 10
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.1)
    return helper, _alive(helper)


def test_forked_helper_dies_with_a_killed_rank():
    """Guards against megatron's forked shard writer surviving a SIGKILLed rank: it blocks
    forever on a lock the dead rank held and keeps the job's stdout open, so torchrun's
    caller (and the restart test on CI) waited for EOF until its timeout. Control: without
    the hook the same helper survives, so this test can fail."""
    helper, alive = _helper_after_rank_killed("nohook")
    try:
        assert alive, "control: a forked helper without the hook should outlive its parent"
    finally:
        os.kill(helper, signal.SIGKILL)
    _, alive = _helper_after_rank_killed("hook")
    assert not alive, "the forked helper outlived its SIGKILLed parent"


def test_forked_helper_gets_the_default_sigterm():
    """Guards against a helper inheriting the rank's flag-only SIGTERM handler, which makes
    `kill PID` (and torchrun's shutdown of a process tree) a no-op for it."""
    code = textwrap.dedent("""
        import multiprocessing as mp, os, signal, time
        from loco_megatron.training.children import die_with_parent
        die_with_parent()
        signal.signal(signal.SIGTERM, lambda *a: None)
        def work(ready):
            ready.set()  # after the at-fork hooks ran
            time.sleep(60)
        ctx = mp.get_context("fork")
        ready = ctx.Event()
        p = ctx.Process(target=work, args=(ready,))
        p.start()
        ready.wait(30)
        os.kill(p.pid, signal.SIGTERM)
        p.join(20)
        print(p.exitcode)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.stdout.strip() == str(-signal.SIGTERM), out.stdout + out.stderr
