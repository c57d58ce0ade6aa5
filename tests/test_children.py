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
    from loco_megatron.children import die_with_parent
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


def test_helpers_ignore_the_stop_signals_and_die_with_the_rank():
    """Guards against the stop save losing its helpers (issue 32): torchrun forwards SIGTERM
    with killpg to each rank's whole process group (Slurm sends it to every process), and
    the forked writers and the spawned writer Manager, with the default SIGTERM, died of it
    before the stop save used them ("broken pipe"; iter_N.tmp removed, the step lost). Now
    both survive SIGTERM/SIGUSR1/SIGINT and still go when their rank is SIGKILLed."""
    code = textwrap.dedent("""
        import multiprocessing as mp, os, signal, sys, time
        from loco_megatron.children import die_with_parent
        from loco_megatron.checkpoint import torch_dist
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        die_with_parent()
        signal.signal(signal.SIGTERM, lambda *a: None)  # the rank's "stop after this step" flag
        def work(ready):
            ready.set()  # after the at-fork hooks ran
            time.sleep(120)
        ctx = mp.get_context("fork")
        ready = ctx.Event()
        forked = ctx.Process(target=work, args=(ready,))
        forked.start()
        ready.wait(30)
        torch_dist.start_writer_manager_detached()
        kids = [int(p) for p in open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()]
        for pid in kids:
            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                os.kill(pid, sig)
        filesystem_async._results_queue.put("still served")  # the Manager answers after the signals
        print(filesystem_async._results_queue.get(), flush=True)
        forked.join(2)
        print(" ".join(map(str, kids)), forked.exitcode, flush=True)
        time.sleep(120)
    """)
    rank = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert rank.stdout.readline().strip() == "still served"
        *kids, exitcode = rank.stdout.readline().split()
        kids = [int(pid) for pid in kids]
        assert exitcode == "None" and len(kids) >= 2, (kids, exitcode)  # the forked helper runs on
        assert all(_alive(pid) for pid in kids), kids
    finally:
        rank.kill()
        rank.wait()
    deadline = time.monotonic() + 30  # a bound for the kernel's parent-death signals, not a measurement
    while any(_alive(pid) for pid in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in kids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "helpers outlived their SIGKILLed rank"


def test_the_writers_result_manager_imports_neither_torch_nor_the_rank_script(tmp_path):
    """Guards against the writers' result Manager (spawned by every rank at its first
    torch_dist save) running the rank's script again (multiprocessing's spawn re-runs
    ``__main__``: torch, megatron-core, this package) and unpickling the write results
    it carries (torch.distributed.checkpoint's ``WriteResult``: torch again): seconds of
    CPU per rank and a second copy of torch in memory, for a queue. A rank script that
    imports torch starts the Manager, passes a real ``WriteResult`` through it intact, and
    the Manager process has mapped no torch library; the script's own ``__file__`` is back."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.storage import WriteResult
        from loco_megatron.checkpoint import torch_dist
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        torch_dist.start_writer_manager_detached()
        result = {0: [WriteResult(index=MetadataIndex("w", (0,)), size_in_bytes=8, storage_data="f")]}
        filesystem_async._results_queue.put(result)
        assert filesystem_async._results_queue.get_nowait() == result
        assert sys.modules["__main__"].__file__ == __file__
        kids = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
        for kid in kids:  # the Manager, and multiprocessing's resource tracker
            role = "manager" if b"spawn_main" in open(f"/proc/{kid}/cmdline", "rb").read() else "other"
            print(role, "torch" if "libtorch" in open(f"/proc/{kid}/maps").read() else "no-torch", flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "manager no-torch" in lines and not any(line.endswith(" torch") for line in lines), proc.stdout
