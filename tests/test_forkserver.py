"""The suite's fork server (tests/forkserver.py) against plain torchrun processes."""

import os
import pathlib
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY, read_metrics, run_launch, torchrun_command


def _both(args: list[str], cache: str, tmp_path: pathlib.Path) -> list:
    """The same launch on the fork server and as a plain torchrun: [(process, metrics)] each."""
    out = []
    for name in ("forked", "plain"):
        cmd, env = torchrun_command(2, args, cache, tmp_path / f"{name}.jsonl")
        if name == "forked":
            proc = run_launch(cmd, env, 600)
        else:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        out.append((proc, read_metrics(tmp_path / f"{name}.jsonl")))
    return out


def test_forked_launch_trains_and_fails_like_plain_torchrun(cache_dir, tmp_path):
    """Guards against the fork server changing what the suite tests: the same losses as
    fresh torchrun processes, the same console lines of the run (timings aside), and for a
    bad flag the same one error line per rank and the same exit status as the torchrun
    command (1: torchrun reports the failed workers)."""
    args = TINY + ["--train-iters", "3", "--lr-decay-iters", "3", "--loco-bits", "4"]
    (forked, fm), (plain, pm) = _both(args, cache_dir, tmp_path)
    assert forked.returncode == plain.returncode == 0, forked.stderr[-2000:] + plain.stderr[-2000:]
    losses = [[(m["iteration"], m["train/lm_loss"]) for m in ms if "train/lm_loss" in m] for ms in (fm, pm)]
    assert losses[0] == losses[1] and len(losses[0]) == 3

    def lines(proc):  # the run's own lines up to its first timing figure, without the first run's
        # one-time notes (corpus, tokenizer, C++ build: each says "first use only")
        return [line.split(" | tokens/s")[0].split("; wall time")[0] for line in proc.stdout.splitlines()
                if "first use only" not in line]

    assert lines(forked) == lines(plain) and any(line.startswith("iter 3/3") for line in lines(plain))
    (forked, _), (plain, _) = _both(args + ["--loco-bits", "3"], cache_dir, tmp_path)
    errors = [[line for line in p.stderr.splitlines() if "error:" in line] for p in (forked, plain)]
    assert forked.returncode == plain.returncode == 1 and errors[0] == errors[1] and errors[0], errors


def test_a_launch_past_its_timeout_is_killed(cache_dir, tmp_path):
    """Guards against a hung forked launch outliving its test: the timeout raises as
    subprocess.run's does, no process of the launch is left, and the server serves the
    next launch."""
    cmd, env = torchrun_command(2, TINY + ["--train-iters", "100000", "--lr-decay-iters", "100000"], cache_dir,
                                tmp_path / "m.jsonl")
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run_launch(cmd, env, 15)  # past torchrun's start of its workers, which must go too
    def left() -> list:
        out = []
        for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == err.value.pgid and fields[0] not in "ZX":
                out.append(stat.parent.name)
        return out

    deadline = time.monotonic() + 30  # SIGKILL is delivered at once, the exits take a moment
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), left()
    cmd, env = torchrun_command(2, TINY + ["--train-iters", "1", "--lr-decay-iters", "3"], cache_dir,
                                tmp_path / "m2.jsonl")
    proc = run_launch(cmd, env, 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert os.path.getsize(tmp_path / "m2.jsonl") > 0


SCRIPT = """
import os, sys, time
print("out", sys.argv[1:], os.getcwd() == os.environ["WANT_CWD"], flush=True)
print("err", file=sys.stderr)
if sys.argv[1] == "wait":  # side by side: this one ends only once the other one has started
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(0 if os.path.exists(sys.argv[2]) else 9)
if sys.argv[1] == "mark":
    open(sys.argv[2], "w").close()
    sys.exit(0)
{"int": lambda: sys.exit(3), "message": lambda: sys.exit("a message"), "none": lambda: sys.exit(),
 "raise": lambda: 1 / 0, "end": lambda: None}[sys.argv[1]]()
"""


def test_scripts_exit_and_print_like_a_plain_python_and_run_side_by_side(tmp_path):
    """Guards against the fork server's ``python script.py`` launches differing from a plain
    interpreter where tests look (exit status for ``sys.exit(3)``, ``sys.exit("message")``
    with the message on stderr, ``sys.exit()``, an exception's traceback and status 1,
    stdout, stderr, the working folder), and against launches that wait for each other
    (one waiter per launch: a job that only ends once a later one has started)."""
    from conftest import Launch, fork_server

    if fork_server() is None:
        pytest.skip("LOCO_TEST_FORKSERVER=0: no fork server to compare")
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", WANT_CWD=str(tmp_path))
    for case in ("int", "message", "none", "raise", "end"):
        cmd = [sys.executable, str(script), case]
        forked = run_launch(cmd, env, 120, cwd=tmp_path)
        plain = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert getattr(forked, "forked", False) and (forked.returncode, forked.stdout) == (plain.returncode, plain.stdout)
        # (a traceback's last line names the error; the frames above it differ by design)
        assert forked.stderr.strip().splitlines()[-1:] == plain.stderr.strip().splitlines()[-1:], (case, forked.stderr)
    flag = tmp_path / "started"
    first = Launch(fork_server(), [sys.executable, str(script), "wait", str(flag)], env,
                   str(tmp_path / "a.log"), str(tmp_path / "a.log"), cwd=tmp_path)
    second = Launch(fork_server(), [sys.executable, str(script), "mark", str(flag)], env,
                    str(tmp_path / "b.log"), str(tmp_path / "b.log"), cwd=tmp_path)
    assert second.wait(120) == 0 and first.wait(120) == 0, (tmp_path / "a.log").read_text()
    assert (tmp_path / "a.log").read_text().splitlines() == ["out ['wait', '%s'] True" % flag, "err"]
