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

from conftest import REPO, TINY, read_metrics, run_launch, torchrun_command, train_losses
from test_checkpoint import _Weights  # the stand-in model

WORKER = REPO / "tests" / "ckpt_fault_worker.py"


def _launch(args: list[str], nproc: int = 2, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    # Own session: on a hang the test kills the whole tree instead of blocking.
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)


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
            for other in ("LEFT[", "ERROR[", "AGREED[", "LOADED[", "SAVED "):
                rest = rest.split(f" {other}")[0]
            found[int(rank)] = rest.strip()
    return found


FAULTS = {  # scenario of tests/ckpt_fault_worker.py: what its one line names
    "build": ["building the state to save into", "iter_0000002.tmp", "failed on rank 1", "MemoryError"],
    "torch_build": ["building the state to save into", "iter_0000002.tmp", "failed on rank 1", "MemoryError"],
    "staging": ["staging or writing", "iter_0000002.tmp", "failed on rank 1", "CUDA out of memory"],
    "staging_async": ["staging", "iter_0000002.tmp for --async-save failed on rank 1", "CUDA out of memory"],
    "shard": ["iter_0000002.tmp", "__1_0.distcp", "rank 1", "no space left on device"],
    "common": ["iter_0000002.tmp/common.pt failed on rank 0", "no space left on device"],
    "async": ["iter_0000002.tmp", "__1_0.distcp", "rank 1", "no space left on device"],
    "async_all": ["iter_0000002.tmp failed on ranks 0, 1: ", "no space left on device"],
    "dcp_metadata": ["iter_0000002.tmp/.metadata failed on rank 0", "no space left on device"],
    "metadata_json": ["iter_0000002.tmp/metadata.json failed on rank 0", "no space left on device"],
    "sidecar": ["writing checksums into", "iter_0000002.tmp failed on rank {last}", "no space left on device"],
    "missing": ["iter_0000001/sha256.rank_00001.json is missing", "rank 1"],
    "torch_corrupt": ["iter_0000001/rank_00001.pt does not match its checksum", "rank 1"],
    "common_unreadable": ["iter_0000001/common.pt is not a readable checkpoint (RuntimeError: PytorchStreamReader "
                          "failed reading zip archive: failed finding central directory) (on rank 1 of 2)"],
}
LOAD_FAULTS = ("missing", "torch_corrupt", "common_unreadable")


@pytest.mark.parametrize("nproc,scenarios", [
    (2, list(FAULTS)),
    (4, ["build", "staging_async", "dcp_metadata", "sidecar"]),
])
def test_checkpoint_failure_ends_every_rank_with_one_line(nproc, scenarios, tmp_path):
    """Guards against checkpoint failures that hang or end in tracebacks (issues 21, 32). A
    failure on one rank at any step of a save (building the state, staging it to host
    memory, the shard write, rank 0's common.pt, DCP's .metadata and metadata.json, a
    checksum file, the background write) left that rank in the caller's error agreement
    while the others waited in megatron's next collective (save_preprocess' all-gather,
    DCP's plan or finalize broadcast, a barrier): a hang until the distributed timeout, or,
    for the shard write, DCP's CheckpointException (a BaseException ``except Exception``
    missed) as tracebacks with iter_N.tmp left. At load: a shard deleted with its
    sha256.rank_N.json passed the integrity check; --ckpt-format torch checked corruption
    per rank, so only the corrupt rank raised. Now every rank ends with the same line
    naming the step, the file and the rank, no traceback, only the previous checkpoint is
    left and it loads. Also guards against such a line being printed by every rank (it was
    not marked agreed: two copies on the console, run together) and against one naming the
    wrong rank (a full disk failing every rank's background write said "rank 0" only), or
    cut mid-word (an unreadable common.pt ended "...This is an interna)", and did not say
    it was one rank's finding), and against the result of an --async-save write abandoned
    after staging failed elsewhere (staging_async) staying in megatron's results queue,
    where the same processes' next write (async_all, later) took it for its own: rank 0's
    failure went unseen. All scenarios run one after another in one launch per world size."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKER),
           ",".join(scenarios), str(tmp_path)]
    try:  # on the suite's fork server: the ranks run to their end, nothing signals them
        proc = run_launch(cmd, dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)), 600)
    except subprocess.TimeoutExpired:
        pytest.fail("hung (killed after 600s)")
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-3000:]
    for scenario in scenarios:
        errors = _per_rank(out, f"ERROR[{scenario}]")
        assert sorted(errors) == list(range(nproc)), (scenario, out[-3000:])
        assert len(set(errors.values())) == 1, (scenario, errors)
        line = errors[0]
        expected = [fragment.format(last=nproc - 1) for fragment in FAULTS[scenario]]
        assert "\n" not in line and all(f.lower() in line.lower() for f in expected), (scenario, line)
        agreed = _per_rank(out, f"AGREED[{scenario}]")
        assert agreed == {r: "True" for r in range(nproc)}, (scenario, agreed)  # rank 0 alone prints it
        left = set(_per_rank(out, f"LEFT[{scenario}]").values())
        assert left == {"['iter_0000001', 'latest_checkpointed_iteration.txt']"}, (scenario, left)
        if scenario not in LOAD_FAULTS:
            assert line.startswith("--save: ") and "removed iter_0000002.tmp, iter_0000001 is the latest" in line
            loaded = _per_rank(out, f"LOADED[{scenario}]")
            assert loaded == {r: "[1.0]" for r in range(nproc)}, (scenario, out[-3000:])


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


class _Counter:
    def __init__(self, value: float):
        self.n = torch.full((3,), value)

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


@pytest.fixture
def one_rank(tmp_path):
    """A 1-rank gloo group (the checkpoint code is collective) on a CPU 'device'."""
    import torch.distributed as dist

    from loco_megatron.platform import detect_platform, platform_context

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with platform_context(detect_platform(0)):
            yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_commit_fsyncs_files_folders_and_latest(fmt, tmp_path, monkeypatch, one_rank):
    """Guards against commits that are not durable: nothing was fsynced (shards, checksum
    files, the folder, ``latest``), so a power loss after the commit could leave ``latest``
    naming a folder whose files never reached the disk."""
    from loco_megatron.checkpoint import Checkpointer

    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(pathlib.Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    root = tmp_path / "ck"
    layout = {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "model": [1, 3, 2, None]}
    stateful = {"model": _Weights(1.0)} if fmt == "torch_dist" else {"c": _Counter(1.0)}
    Checkpointer(str(root), None, 0, layout, ckpt_format=fmt).save(1, stateful)
    final = root / "iter_0000001"
    tmp = root / "iter_0000001.tmp"
    # Files are fsynced where they were written (in iter_N.tmp), before the rename.
    written = {tmp / p.name for p in final.iterdir()}
    as_named = {q.with_name(q.name.removesuffix(".part")) for q in synced}  # torch: written as .part, renamed
    assert written <= as_named, sorted(written - as_named)
    assert tmp in synced and root in synced  # the entries of both folders
    assert root / "latest_checkpointed_iteration.txt.tmp" in synced
    # `latest` is written durably only after the folder rename is durable.
    assert synced.index(root) < synced.index(root / "latest_checkpointed_iteration.txt.tmp")
    assert synced[-1] == root  # and its own rename is made durable


def test_interrupted_resave_recovers_at_start(tmp_path, one_rank):
    """Guards against a crash between ``final.rename(old)`` and ``tmp.rename(final)`` while
    re-saving an iteration: ``latest`` then named a missing folder and start-up failed
    instead of using ``iter_N.old`` (or, without it, the newest complete checkpoint); and
    against the next save of that iteration failing on the leftover ``iter_N.old``."""
    from loco_megatron.checkpoint import Checkpointer

    root = tmp_path / "ck"
    saver = Checkpointer(str(root), str(root), 0, {"world_size": 1})
    saver.save(1, {"c": _Counter(1.0)})
    saver.save(2, {"c": _Counter(2.0)})
    (root / "iter_0000002").rename(root / "iter_0000002.old")  # the crash: first rename done,
    (root / "iter_0000002.tmp").mkdir()  # the re-save's folder never renamed

    loader = Checkpointer(None, str(root), 0, {"world_size": 1}, log=lambda _: None)
    path = loader.find_resume_dir()
    assert path == root / "iter_0000002.old"
    assert "\n" not in loader.start_note and "iter_0000002.old is used" in loader.start_note, loader.start_note
    counter = _Counter(0.0)
    assert loader.load(path, {"c": counter}) == 2 and torch.all(counter.n == 2.0)
    assert Checkpointer.iteration_of(path) == 2

    saver.save(2, {"c": _Counter(3.0)})  # the resumed run saves iteration 2 again
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]

    (root / "iter_0000002").rename(root / "elsewhere")  # no .old either: the previous complete one
    path = loader.find_resume_dir()
    assert path == root / "iter_0000001" and "newest complete checkpoint" in loader.start_note


def _train(args: list[str], cache: str, tmp_path: pathlib.Path, name: str) -> tuple[int, str, list[dict]]:
    """A training launch that runs to its end untouched: on the suite's fork server
    (conftest.run_launch; a hang past the timeout kills the launch and fails the test)."""
    metrics = tmp_path / f"{name}.jsonl"
    cmd, env = torchrun_command(2, args, cache, metrics)
    try:
        proc = run_launch(cmd, env, 600)
    except subprocess.TimeoutExpired:
        pytest.fail("hung (killed after 600s)")
    return proc.returncode, proc.stdout + proc.stderr, read_metrics(metrics)


def test_abort_finishes_the_in_flight_async_save(cache_dir, tmp_path):
    """Guards against --async-save losing a fully written checkpoint when the run aborts:
    --max-skipped-consecutive raised before ``ckpt.poll()`` and nothing waited for the
    write, so iter_N.tmp (every shard present) was never committed and a restart began
    from scratch. Now the abort finalizes the write first and says so."""
    ck = tmp_path / "ck"
    args = TINY + ["--train-iters", "10", "--save", str(ck), "--save-interval", "2", "--async-save",
                   "--inject-nan", "3-:1", "--max-skipped-consecutive", "1"]
    rc, out, _ = _train(args, cache_dir, tmp_path, "abort")
    assert rc != 0 and "--max-skipped-consecutive: 1 consecutive steps skipped" in out, out[-3000:]
    assert "--async-save: finished and committed the in-flight save of iteration 2 before stopping" in out, out[-3000:]
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_save_before_the_first_optimizer_step_is_skipped(fmt, cache_dir, tmp_path):
    """Guards against a save before the first successful optimizer step crashing a run that
    would have recovered (``--inject-nan 1-2:0 --save-interval 2``: KeyError 'exp_avg' with
    torch_dist, KeyError 'step' with torch, iter_N.tmp left): that save is skipped with one
    line, the run goes on, and its later checkpoint resumes."""
    ck = tmp_path / "ck"
    args = TINY + ["--train-iters", "4", "--lr-decay-iters", "6", "--save", str(ck), "--save-interval", "2",
                   "--inject-nan", "1-2:0", "--ckpt-format", fmt]
    rc, out, metrics = _train(args, cache_dir, tmp_path, "nan")
    assert rc == 0, out[-3000:]
    assert out.count("checkpoint: iteration 2 not saved: no optimizer step has succeeded yet") == 1, out[-3000:]
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    assert sorted(train_losses(metrics)) == [3, 4]  # 1 and 2 were skipped
    rc, out, resumed = _train(args[:-4] + ["--ckpt-format", fmt, "--train-iters", "6", "--load", str(ck)],
                              cache_dir, tmp_path, "resumed")
    assert rc == 0 and f"resuming from {ck / 'iter_0000004'}" in out, out[-3000:]
    assert sorted(train_losses(resumed)) == [5, 6]


def _refused(call) -> str:
    """The ConfigError line ``call()`` raises; it must be one line that every rank agreed on
    (so rank 0 alone prints it)."""
    from loco_megatron.config import ConfigError

    with pytest.raises(ConfigError) as e:
        call()
    assert "\n" not in str(e.value) and getattr(e.value, "agreed", False), (str(e.value), vars(e.value))
    return str(e.value)


def test_damaged_checksum_and_rank_files_are_one_line(tmp_path, one_rank):
    """Guards against damaged small JSON files of a checkpoint ending in tracebacks (issue 32):
    a torch_dist ``sha256.rank_R.json`` that is not JSON (JSONDecodeError from
    ``files.sidecar_entries``, 66 lines) and a truncated --ckpt-format torch ``rank_R.json``.
    Each is now one line naming the file, printed once."""
    from loco_megatron.checkpoint import Checkpointer

    layout = {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "model": [1, 3, 2, None]}
    root = tmp_path / "dist"
    Checkpointer(str(root), None, 0, layout, ckpt_format="torch_dist").save(1, {"model": _Weights(1.0)})
    side = root / "iter_0000001" / "sha256.rank_00000.json"
    side.write_text("not json {")
    loader = Checkpointer(None, str(root), 0, layout, ckpt_format="torch_dist", log=lambda _: None)
    line = _refused(lambda: loader.load(loader.find_resume_dir(collective=True), {"model": _Weights(0.0)}))
    assert f"{side} is not valid JSON" in line, line

    root = tmp_path / "torch"
    Checkpointer(str(root), None, 0, layout).save(1, {"c": _Counter(1.0)})
    meta = root / "iter_0000001" / "rank_00000.json"
    meta.write_text(meta.read_text()[:20])  # truncated
    loader = Checkpointer(None, str(root), 0, layout, log=lambda _: None)
    assert f"{meta} is not valid JSON" in _refused(lambda: loader.find_resume_dir(collective=True))
    assert f"{meta} is not valid JSON" in _refused(lambda: loader.load(root / "iter_0000001", {"c": _Counter(0.0)}))


@pytest.mark.parametrize("fmt,change,named", [
    ("torch_dist", {"ffn_hidden_size": 256}, "ffn hidden size 384 saved, 256 now"),
    ("torch", {"num_query_groups": 2}, "num query groups 4 saved, 2 now"),
    ("torch_dist", {"swiglu": False}, "swiglu True saved, False now"),
])
def test_resume_with_another_model_dimension_is_refused_naming_it(fmt, change, named, tmp_path, one_rank):
    """Guards against the shape check comparing only layers, hidden size, vocabulary and
    experts (issue 32): --ffn-hidden-size 256 against a torch_dist checkpoint saved with 384
    ended in "could not be loaded (CheckpointException ranks: dict_keys([0, 1]))",
    --num-query-groups 2 against a torch checkpoint in a 56-line "size mismatch for
    ...linear_qkv.weight". Every dimension that changes a tensor's shape is recorded and
    compared before the model is built; the line names the one that differs, printed
    once. A checkpoint that recorded only the first four dimensions still loads."""
    import dataclasses

    from loco_megatron.checkpoint import Checkpointer
    from loco_megatron.checkpoint.model_shape import model_shape
    from loco_megatron.config.model import ModelConfig

    base = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=384)
    layout = {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "model": model_shape(base, 4096)}
    root = tmp_path / "ck"
    state = {"model": _Weights(1.0)} if fmt == "torch_dist" else {"c": _Counter(1.0)}
    Checkpointer(str(root), None, 0, layout, ckpt_format=fmt).save(1, state)
    other = {**layout, "model": model_shape(dataclasses.replace(base, **change), 4096)}
    loader = Checkpointer(None, str(root), 0, other, ckpt_format=fmt, log=lambda _: None)
    line = _refused(lambda: loader.find_resume_dir(collective=True))
    assert "holds a model of another shape" in line and named in line, line
    assert line.count("saved,") == 1, line  # only the dimension that differs

    older = {**layout, "model": layout["model"][:4]}  # what checkpoints recorded before
    root = tmp_path / "older"
    Checkpointer(str(root), None, 0, older, ckpt_format=fmt).save(1, state)
    same = Checkpointer(None, str(root), 0, layout, ckpt_format=fmt, log=lambda _: None)
    assert same.find_resume_dir(collective=True) == root / "iter_0000001"


def test_short_write_names_the_full_disk(tmp_path, monkeypatch):
    """Guards against a torch_dist write on a full disk being reported as torch's zip-writer
    text "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598" (issue 32):
    the line now says "no space left on device"."""
    import shutil

    from loco_megatron.checkpoint import files, torch_dist
    from torch.distributed.checkpoint.api import CheckpointException

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    failure = CheckpointException("write", {1: RuntimeError(f"Worker failure: {short}")})
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=4096))  # the disk is full
    line = torch_dist.describe_write_failure(failure, tmp_path)
    assert "failed on rank 1" in line and line.endswith("(no space left on device)"), line
    assert files.cause(short, tmp_path) == "no space left on device"
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1 << 30))  # e.g. over a quota
    assert "no space left on device, or over a quota" in files.cause(short, tmp_path)


def test_train_iters_below_the_loaded_iteration_is_refused(tmp_path):
    """Guards against ``--train-iters 2`` with a checkpoint at iteration 4 exiting 0 with no
    word (issue 32): below the loaded iteration it is a one-line error (exit 2), printed
    once; equal to it, the run says there is nothing to train (see the resume test)."""
    from loco_megatron.training.schedule import check_train_iters

    line = _refused(lambda: check_train_iters(2, 4, tmp_path / "iter_0000004"))
    assert line.startswith("--train-iters 2 is below iteration 4 of the checkpoint") and "nothing to train" in line
    check_train_iters(4, 4, tmp_path / "iter_0000004")  # a finished run: not an error


class _StackedWeights(_Weights):
    """Like megatron's layer-stacked parameters (``prepend_axis_num``): their load goes
    through torch's deprecated ShardedTensor, which warns."""

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        return {"model": {"w": ShardedTensor.from_rank_offsets("w", self.w, (0, 0, 1), replica_id=0,
                                                               prepend_axis_num=1)}}


def test_load_does_not_print_the_sharded_tensor_deprecation_warning(tmp_path, one_rank):
    """Guards against every checkpoint load printing megatron-core's FutureWarning "Please use
    DTensor instead and we are deprecating ShardedTensor." (twice on 2 ranks): exactly that
    warning is not shown during the load; others still are, and the filters are as before."""
    import warnings

    from loco_megatron.checkpoint import Checkpointer

    layout = {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "model": [1, 3, 2, None]}
    Checkpointer(str(tmp_path / "ck"), None, 0, layout, ckpt_format="torch_dist").save(1, {"model": _StackedWeights(1.0)})
    loader = Checkpointer(None, str(tmp_path / "ck"), 0, layout, ckpt_format="torch_dist", log=lambda _: None)
    weights = _StackedWeights(0.0)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        loader.load(loader.find_resume_dir(collective=True), {"model": weights})
        assert warnings.filters == filters
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
    assert weights.w.unique().tolist() == [1.0]
    messages = [str(w.message) for w in shown]
    assert messages.count("Please use DTensor instead and we are deprecating ShardedTensor.") == 1, messages


def test_unreadable_common_pt_is_one_whole_agreed_line(tmp_path, one_rank):
    """Guards against a truncated ``common.pt`` ending the run with its error cut mid-word
    ("... failed finding central directory. This is an interna)") and printed by every rank
    (not agreed): the line keeps the exception's type and first sentence, whole, and every
    rank raises it together (rank 0 alone prints it)."""
    from loco_megatron.checkpoint import Checkpointer

    layout = {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "model": [1, 3, 2, None]}
    root = tmp_path / "ck"
    Checkpointer(str(root), None, 0, layout, ckpt_format="torch_dist").save(1, {"model": _Weights(1.0)})
    common = root / "iter_0000001" / "common.pt"
    common.write_bytes(common.read_bytes()[:200])
    loader = Checkpointer(None, str(root), 0, layout, ckpt_format="torch_dist", log=lambda _: None)
    line = _refused(lambda: loader.find_resume_dir(collective=True))
    assert line == (f"--load: {common} is not a readable checkpoint (RuntimeError: PytorchStreamReader failed "
                    f"reading zip archive: failed finding central directory)"), line
