"""Waiting on a build of the C++ CPU kernels (``loco/build_lock.py``): never at the niced
background build's priority, never silent. The builds here are real background builds
(``python -m loco_megatron.loco.cpu_kernels``: its nice, its session, torch's ninja, which
puts each compiler in a process group of its own) with a stand-in compiler that takes as
long as its priority stays below the waiter's, so no test compiles the kernels."""

import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
from loco_megatron.loco import cpu_kernels
from loco_megatron.loco.build_lock import LOCK_FILE, read_holder

SLOW_CXX = """#!/bin/sh
# Answers torch's compiler checks; a compile runs until its nice value is at most {target}
# (the waiter's), records it and fails; after 2 minutes it records the nice value it kept.
case "$1" in -dump*) echo 12.2.0; exit 0;; -v|--version) echo "gcc version 12.2.0"; exit 0;; esac
n=0
while [ "$(nice)" -gt {target} ] && [ $n -lt 2400 ]; do sleep 0.05; n=$((n + 1)); done
nice >> {record}
exit 1
"""

WAITER = """
from loco_megatron.loco import cpu_kernels
from loco_megatron.loco.build_lock import build_lock
with build_lock(cpu_kernels.build_directory()):
    print("took the lock", flush=True)
"""

PROBE = "import os; os.nice(1); os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - 1)"


def _background_build(tmp_path, monkeypatch):
    """A real background build (``--loco-kernels auto``'s) in an empty extensions folder
    with :data:`SLOW_CXX` as its compiler, once it holds the build lock:
    ``(its holder record, its folder, the compilers' record file)``."""
    target = os.getpriority(os.PRIO_PROCESS, 0)
    record = tmp_path / "nice_values"
    cxx = tmp_path / "bin" / "g++"  # a name torch's compiler check accepts
    cxx.parent.mkdir()
    cxx.write_text(SLOW_CXX.format(target=target, record=record))
    cxx.chmod(0o755)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    assert cpu_kernels.start_background_build() is not None
    folder = cpu_kernels.build_directory()
    deadline = time.monotonic() + 300
    while (holder := read_holder(folder / LOCK_FILE)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert holder is not None and holder.background, (folder / "build.log").read_text()
    return holder, folder, record


@pytest.mark.parametrize("privilege", ["as-is", "without-CAP_SYS_NICE"])
def test_a_waiter_never_waits_on_the_niced_background_build_at_its_priority(privilege, tmp_path, monkeypatch):
    """Guards against a test (or a --loco-kernels cpu run) that needs the C++ kernels
    waiting, minutes to most of an hour, on the background build at nice 10: a waiter
    that may raise priorities (root) raises every process of the build (the compilers
    too, which ninja starts in process groups of their own) to its own, and that build
    finishes; one that may not (here: root without CAP_SYS_NICE, or any other user)
    stops the build, saying so on its stderr and in the build's log, without recording
    it as a failed build (later runs would then never build), and takes the folder over
    to build there at its own priority."""
    prefix = ["setpriv", "--bounding-set=-sys_nice"] if privilege != "as-is" and os.geteuid() == 0 else []
    may_raise = subprocess.run(prefix + [sys.executable, "-c", PROBE], capture_output=True).returncode == 0
    holder, folder, record = _background_build(tmp_path, monkeypatch)
    waiter = subprocess.run(prefix + [sys.executable, "-c", WAITER], capture_output=True, text=True, timeout=600)
    assert waiter.returncode == 0 and waiter.stdout == "took the lock\n", waiter.stderr[-3000:]
    if may_raise:
        assert f"loco: raised the C++ kernels' background build (pid {holder.pid}, " in waiter.stderr
        kept = record.read_text().split()  # each compile that ran: the nice value it ran at
        assert kept and set(kept) == {str(os.getpriority(os.PRIO_PROCESS, 0))}, kept
        return
    assert f"loco: stopped the niced background build of the C++ kernels (pid {holder.pid}, " in waiter.stderr
    assert "stopped by pid" in (folder / "build.log").read_text()
    assert not record.exists() or not record.read_text(), "a compile of the stopped build ran to its end"
    assert not (folder / cpu_kernels.FAILED_MARK).exists()


INNER = """
import pathlib, sys
sys.path.insert(0, {tests!r})
from conftest import on_terminal
from loco_megatron.loco.build_lock import build_lock


def test_hidden():
    print("loco-test: stderr of a passing test", file=sys.stderr)


def test_shown(pytestconfig):
    with on_terminal(pytestconfig), build_lock(pathlib.Path({folder!r}), note_every_s=0.3):
        pass
"""

HOLDER = """
import pathlib, sys, time
from loco_megatron.loco.build_lock import build_lock
folder = pathlib.Path(sys.argv[1])
with build_lock(folder):
    (folder / "ready").touch()
    deadline = time.monotonic() + 120
    while not (folder / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_a_long_wait_says_what_it_waits_for_on_the_terminal_under_pytest(tmp_path):
    """Guards against a wait on another process's build sitting silent (16 minutes with
    nothing on screen under ``pytest -q``): past its threshold a waiter prints which
    build it waits for (pid, how long ago it started), and the fixture's way of printing
    (:func:`conftest.on_terminal`) reaches the terminal through pytest's capture, which
    does hide a passing test's plain stderr. The build holding the lock lets go only
    once the waiting line has shown."""
    folder = tmp_path / "build"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], env=env)
    deadline = time.monotonic() + 300
    while not (folder / "ready").exists() and holder.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    (tmp_path / "test_inner.py").write_text(INNER.format(tests=str(REPO / "tests"), folder=str(folder)))
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    shown = []
    for line in inner.stdout:
        shown.append(line)
        if line.startswith(f"loco: waiting for the C++ kernels' build (pid {holder.pid}, started "):
            (folder / "release").touch()
    assert inner.wait(timeout=60) == 0 and holder.wait(timeout=60) == 0, "".join(shown)
    waiting = [ln for ln in shown if ln.startswith("loco: waiting for")]
    assert waiting and all(" s ago) ... (" in ln and ln.endswith(" s so far)\n") for ln in waiting), shown
    assert not any("loco-test: stderr of a passing test" in ln for ln in shown), shown  # capture was on
