"""Checkpoint failures on a real 2-rank gloo group: a failed write or a bad file ends every
rank with the same one line (file and rank), without a hang, with ``iter_N.tmp`` removed
and the previous checkpoint loadable; durable commits; recovery from an interrupted re-save;
aborts that finish an in-flight --async-save; no orphaned writer processes."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, TINY, read_metrics, torchrun_command, train_losses

WORKER = REPO / "tests" / "ckpt_fault_worker.py"


def _launch(args: list[str], **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    # Own session: on a hang the test kills the whole tree instead of blocking.
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)


def _communicate(proc: subprocess.Popen, timeout: int) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"hung (killed after {timeout}s):\n{out[-3000:]}")
    return out


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children, ...)."""
    parents = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - out
        out |= frontier
    return out


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_tree(pid: int) -> None:
    for child in _descendants(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _per_rank(out: str, tag: str) -> dict[int, str]:
    found = {}
    for line in out.splitlines():
        for chunk in line.split(f"{tag} rank=")[1:]:  # two ranks' lines can share a console line
            rank, _, rest = chunk.partition(" ")
            found[int(rank)] = rest.split(" LEFT rank=")[0].split(" ERROR rank=")[0].strip()
    return found


@pytest.mark.parametrize("scenario,expected", [
    ("shard", ["iter_0000002.tmp", "__1_0.distcp", "rank 1", "no space left on device"]),
    ("common", ["iter_0000002.tmp/common.pt failed on rank 0", "no space left on device"]),
    ("async", ["iter_0000002.tmp", "__1_0.distcp", "rank 1", "no space left on device"]),
    ("missing", ["iter_0000001/sha256.rank_00001.json is missing", "rank 1"]),
    ("torch_corrupt", ["iter_0000001/rank_00001.pt does not match its checksum", "rank 1"]),
])
def test_checkpoint_failure_ends_every_rank_with_one_line(scenario, expected, tmp_path):
    """Guards against checkpoint failures that hang or end in tracebacks (issue 21):
    shard: one rank's torch_dist shard write failing raised DCP's CheckpointException, a
    BaseException that ``except Exception`` missed: tracebacks on every rank, iter_N.tmp left;
    common: rank 0's common.pt write failing left rank 0 in the error agreement while the others
    were in the shard write's collectives: a hang until the distributed timeout;
    async: a failed background write escaped the commit as a traceback, iter_N.tmp left;
    missing: a shard deleted with its sha256.rank_N.json passed the integrity check and ended in
    a FileNotFoundError traceback (nothing checked every writing rank left its checksums);
    torch_corrupt: --ckpt-format torch checked corruption per rank, so only the corrupt rank
    raised and the other one died in its next collective.
    Now every rank ends with the same line naming the file and the rank, no traceback, only
    the previous checkpoint is left and it loads."""
    root = tmp_path / "ck"
    out = _communicate(_launch([str(WORKER), scenario, str(root)]), timeout=300)
    errors = _per_rank(out, "ERROR")
    assert sorted(errors) == [0, 1], out[-3000:]
    assert errors[0] == errors[1], errors
    assert "\n" not in errors[0] and all(fragment.lower() in errors[0].lower() for fragment in expected), errors[0]
    assert "Traceback" not in out, out[-3000:]
    assert set(_per_rank(out, "LEFT").values()) == {"['iter_0000001', 'latest_checkpointed_iteration.txt']"}, out
    if scenario in ("shard", "common", "async"):
        assert errors[0].startswith("--save: ") and "removed iter_0000002.tmp, iter_0000001 is the latest" in errors[0]
        assert _per_rank(out, "LOADED") == {0: "[1.0]", 1: "[1.0]"}, out[-3000:]


def test_no_writer_process_outlives_a_killed_rank(tmp_path):
    """Guards against megatron's torch_dist writer Manager (a ~275 MB spawned server) and
    multiprocessing's resource tracker staying alive under init forever after ``kill -9``
    of a rank that had written a checkpoint: every process started below the ranks is gone
    once the job has ended."""
    import re

    proc = _launch([str(WORKER), "idle", str(tmp_path / "ck")])
    seen, below, left = "", set(), set()
    try:
        while seen.count("SAVED rank=") < 2:
            line = proc.stdout.readline()
            assert line, seen[-3000:]
            seen += line
        ranks = {int(pid) for pid in re.findall(r"SAVED rank=\d+ pid=(\d+)", seen)}
        below = set().union(*(_descendants(pid) for pid in ranks))
        assert len(below) >= 2, below  # each rank's writer Manager (and the resource tracker) runs
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=120)
        left = {pid for pid in below if _alive(pid)}
        deadline = time.monotonic() + 60  # a bound for the kernel's parent-death signals, not a measurement
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = {pid for pid in left if _alive(pid)}
        assert not left, {pid: pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()[:100] for pid in left}
    finally:
        _kill_tree(proc.pid)
        for pid in below:  # orphans were re-parented away from the tree: kill them by pid
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
