"""Faults a cluster throws at a run: hangs, preemption, lost `latest`, bad --save, divergence,
bit rot, worker restarts. Real torchrun processes (gloo, 2 ranks) and real signals."""

import hashlib
import os
import pathlib
import re
import signal
import subprocess
import time

import pytest

from conftest import REPO, TINY, read_metrics, run_launch, torchrun, torchrun_command, train_losses


def _start(args, cache, metrics, env_extra=None, launcher_args=()):
    cmd, env = torchrun_command(2, args, cache, metrics, launcher_args=launcher_args)
    env.update(env_extra or {})
    # Own process group: the test signals it as Slurm would signal a job step.
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _run(args, cache, tmp_path, name):
    """A launch that runs to its end untouched (no signal, no process read): on the suite's
    fork server (conftest.run_launch), which spares the ranks' imports; (exit code, stdout
    and stderr, metrics)."""
    metrics = tmp_path / f"{name}.jsonl"
    cmd, env = torchrun_command(2, args, cache, metrics)
    proc = run_launch(cmd, env, 600)
    return proc.returncode, proc.stdout + proc.stderr, read_metrics(metrics)


def _wait_for_iteration(metrics: pathlib.Path, proc, iteration: int) -> None:
    while not any(m.get("iteration", 0) >= iteration for m in read_metrics(metrics)):
        assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else "launcher exited"
        time.sleep(0.2)


def _workers(torchrun_pid: int) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes."""
    children = pathlib.Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split()
    out = {}
    for pid in map(int, children):
        env = dict(kv.split("=", 1) for kv in
                   pathlib.Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in kv)
        if "RANK" in env:
            out[int(env["RANK"])] = pid
    return out


def _forked_writer(rank_pid: int, timeout: float = 120) -> int:
    """Wait until the rank has a forked child running its own program (megatron's shard writer
    during a torch_dist save; the resource tracker execs another command line); its pid."""
    cmdline = pathlib.Path(f"/proc/{rank_pid}/cmdline").read_bytes()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            children = pathlib.Path(f"/proc/{rank_pid}/task/{rank_pid}/children").read_text().split()
        except FileNotFoundError:
            break
        for pid in children:
            try:
                if pathlib.Path(f"/proc/{pid}/cmdline").read_bytes() == cmdline:
                    return int(pid)
            except FileNotFoundError:
                pass
        time.sleep(0.005)
    raise AssertionError(f"rank {rank_pid} forked no checkpoint writer within {timeout}s")


def _sessions(sids: set[int]) -> list[int]:
    """Pids of the live processes in the sessions ``sids`` (torchrun starts each worker in a
    session of its own; what a worker forks stays in it, also after the worker died)."""
    pids = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[3]) in sids and fields[0] not in ("Z", "X"):  # fields: state ppid pgrp session
            pids.append(int(stat.parent.name))
    return pids


def _digests(folder: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "pretrain_gpt.py: error:" in line]


@pytest.mark.parametrize("store,stopped", [("agent", 1), ("rank 0", 0)])
def test_stopped_rank_ends_the_job_with_one_line_naming_it(store, stopped, cache_dir, tmp_path):
    """Guards against a stopped rank (SIGSTOP, a frozen node) hanging the job until the
    collectives' timeout (10 minutes by default, then a gloo traceback naming no rank as
    the root cause): the ranks' heartbeats must end the job well before that, with one
    line naming the silent rank and what to do. Both ways torchrun's ranks get their store:
    the agent hosts it (torch's default; rank 0 reports a stopped rank 1), or rank 0 does
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the launchers set), so stopping rank 0 stops
    the store too and its clients block: rank 1 must still report it. A 20 s collective
    timeout makes the heartbeat timeout 10 s here; the gloo timeout must not come first."""
    metrics = tmp_path / "hang.jsonl"
    env = {"LOCO_DISTRIBUTED_TIMEOUT_S": "20", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1" if store == "rank 0" else "0"}
    proc = _start(TINY + ["--train-iters", "100000"], cache_dir, metrics, env, launcher_args=("--shutdown-timeout=5",))
    try:
        _wait_for_iteration(metrics, proc, 2)
        victim = _workers(proc.pid)[stopped]
        os.kill(victim, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=300)  # a bound for a hang, not a measurement
    finally:
        if proc.poll() is None:  # workers run in their own sessions: kill them too
            for pid in _workers(proc.pid).values():
                os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-3000:]  # torchrun's code for a failed worker
    lines = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(lines) == 1, out[-3000:]
    other = 1 - stopped
    who = (r"rank 0, which hosts the job's store at \S+, is not responding: no answer" if store == "rank 0" else
           rf"rank {stopped} \(pid {victim} on \S+\) is not responding: no heartbeat")
    assert re.match(rf"pretrain_gpt.py: error: {who} for \d+ s \(stopped, frozen, or its node or network is down\); "
                    rf"rank {other} has finished iteration ([2-9]|\d\d+); ending the job: check that node, then "
                    rf"restart from the latest checkpoint", lines[0]), lines[0]
    root = out.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {lines[0]}" in root and "exitcode  : 3 " in root, root
    assert "Timed out waiting" not in out, out[-3000:]


RESUME_ARGS = TINY + ["--train-iters", "16", "--lr-decay-iters", "16", "--loco-bits", "4"]


@pytest.fixture(scope="module")
def uninterrupted(cache_dir, tmp_path_factory) -> dict:
    """Losses of RESUME_ARGS run start to finish, for the interrupted runs to match."""
    _, full = torchrun(2, RESUME_ARGS, cache_dir, tmp_path_factory.mktemp("full"), name="full")
    return train_losses(full)


def test_sigterm_saves_the_current_step_and_resume_is_bit_exact(cache_dir, tmp_path, uninterrupted):
    """Guards against a preemption SIGTERM losing up to --save-interval steps: SIGTERM to the
    torchrun process group makes every rank stop after the same step, save it and exit 0;
    the resumed run continues bit-exactly."""
    args = RESUME_ARGS
    ck = tmp_path / "ck"
    metrics = tmp_path / "first.jsonl"
    proc = _start(args + ["--save", str(ck), "--load", str(ck), "--save-interval", "100"], cache_dir, metrics)
    _wait_for_iteration(metrics, proc, 3)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    stopped = max(train_losses(read_metrics(metrics)))
    assert f"stop requested (SIGTERM received): saving at iteration {stopped}" in out, out[-3000:]
    assert stopped < 16
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    assert "exitcode" not in out and "ChildFailedError" not in out  # the workers exited 0

    _, resumed = torchrun(2, args + ["--load", str(ck)], cache_dir, tmp_path, name="resumed")
    b = {**train_losses(read_metrics(metrics)), **train_losses(resumed)}
    assert sorted(b) == list(range(1, 17))
    assert b == uninterrupted


def test_max_restarts_resumes_after_a_killed_worker(cache_dir, tmp_path, uninterrupted):
    """Guards against in-job restarts that cannot work: torch 2.13's shared rendezvous store
    made the restarted group fail ("Gloo connectFullMesh failed"); the launcher must restart
    the group, which resumes from the latest checkpoint and ends with the same losses. Also
    against megatron's forked shard writer outliving the rank killed mid-save: it blocked on a
    lock the dead rank held, forever, keeping the job's output open (hung CI for 10 minutes)."""
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    from compare_runs import load_run

    ck, metrics, log = tmp_path / "ck", tmp_path / "restart.jsonl", tmp_path / "restart.log"
    env = dict(os.environ, NPROC_PER_NODE="2", MAX_RESTARTS="1", OMP_NUM_THREADS="1",
               TORCH_ELASTIC_SHUTDOWN_TIMEOUT="10")
    with log.open("w") as sink:  # a file, not a pipe: a leftover holding it cannot hang the test
        proc = subprocess.Popen(["bash", "tools/launch_single_node.sh", "configs/tiny_gpt.yaml", *RESUME_ARGS,
                                 "--save", str(ck), "--load", str(ck), "--save-interval", "2",
                                 "--data-cache-path", cache_dir, "--metrics-jsonl", str(metrics)],
                                cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    _wait_for_iteration(metrics, proc, 5)
    workers = _workers(proc.pid)
    rank1 = workers[1]
    # Kill rank 1 mid-save (iteration 6) while it waits for its shard writer: freeze the
    # writer so the rank surely reaches that wait, kill the rank, let the writer go on.
    writer = _forked_writer(rank1)
    os.kill(writer, signal.SIGSTOP)
    time.sleep(1.0)
    os.kill(rank1, signal.SIGKILL)
    try:
        os.kill(writer, signal.SIGCONT)
    except ProcessLookupError:  # already gone with its rank: the fix at work
        pass
    try:
        proc.wait(timeout=600)
    finally:
        leftovers = _sessions({proc.pid, *workers.values()})  # e.g. the killed rank's shard writer
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    assert not leftovers, f"processes outlived the job: {leftovers}"
    assert out.count("resuming from") == 1, out[-3000:]  # the restarted group resumed
    losses = {r["iteration"]: r["train/lm_loss"] for r in load_run(str(metrics)).train}
    assert losses == uninterrupted


def test_plain_torchrun_max_restarts_resumes_after_a_killed_worker(cache_dir, tmp_path, uninterrupted):
    """Guards against `torchrun --max-restarts` restarts failing when started by plain
    torchrun: torch 2.13's agent keeps one TCP store, shared with its ranks, for every
    restart of the worker group, and its env:// rendezvous adds no per-attempt prefix, so
    the restarted group read the killed group's gloo addresses and died ("Gloo
    connectFullMesh failed ... Connection refused"); only the launchers, which set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, restarted. The restarted group must resume from
    the latest checkpoint and end with the uninterrupted run's losses."""
    ck, metrics = tmp_path / "ck", tmp_path / "restart.jsonl"
    args = RESUME_ARGS + ["--save", str(ck), "--load", str(ck), "--save-interval", "2"]
    proc = _start(args, cache_dir, metrics, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"},
                  launcher_args=("--max-restarts=1",))
    workers = {}
    try:
        _wait_for_iteration(metrics, proc, 3)
        workers = _workers(proc.pid)
        os.kill(workers[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        for pid in _sessions({proc.pid, *workers.values()}):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert out.count("resuming from") == 1, out[-3000:]  # the restarted group resumed
    assert train_losses(read_metrics(metrics)) == uninterrupted


def test_rendezvous_on_the_agents_shared_store_is_per_attempt():
    """Guards against a restarted worker group reading the failed group's keys from the
    store torch 2.13's torchrun agent shares with its ranks across restarts: with one agent
    each attempt rendezvous under its own prefix; with several agents (they number their
    restarts differently) a restart is refused in one line naming the environment variable
    that gives each attempt a fresh store, instead of a gloo traceback or a store timeout."""
    import datetime

    import torch.distributed as dist

    from loco_megatron.config import ConfigError
    from loco_megatron.distributed import rendezvous

    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    at = ("127.0.0.1", server.port)
    store = rendezvous("env://", at, 2, 1, 2, timeout)["store"]
    store.set("k", "attempt 2")
    assert server.get("loco_megatron/attempt_2/k") == b"attempt 2" and not server.check(["k"])
    assert rendezvous("env://", at, 0, 2, 2, timeout) == {"init_method": "env://"}  # first start: torch's own
    assert rendezvous("env://", None, 1, 1, 2, timeout) == {"init_method": "env://"}  # rank 0 hosts a fresh store
    with pytest.raises(ConfigError) as info:
        rendezvous("env://", at, 1, 2, 2, timeout)
    assert "\n" not in str(info.value) and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in str(info.value)


def test_load_without_latest_recovers_and_nothing_is_overwritten(cache_dir, tmp_path):
    """Guards against --load that finds no `latest` file starting from iteration 0 and then
    overwriting the existing iter_* checkpoints (a lost `latest`, or a mistyped --load);
    and against a bit-flipped rank file loading silently."""
    ck = tmp_path / "ck"
    args = TINY + ["--train-iters", "6", "--lr-decay-iters", "6", "--ckpt-format", "torch"]
    torchrun(2, args + ["--train-iters", "4", "--save", str(ck), "--save-interval", "2"], cache_dir, tmp_path,
             name="first")
    saved = _digests(ck)

    # A mistyped --load starts fresh: refused before set-up, since it would overwrite ck's checkpoints.
    rc, out, _ = _run(args + ["--load", str(tmp_path / "typo"), "--save", str(ck)], cache_dir, tmp_path, "typo")
    assert rc != 0 and _digests(ck) == saved
    assert "--save:" in _error_lines(out)[0] and "iter_0000004" in _error_lines(out)[0]

    # Bit rot in one rank's file: its checksum no longer matches; refused, nothing written.
    victim = ck / "iter_0000004" / "rank_00001.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    flipped = _digests(ck)
    rc, out, _ = _run(args + ["--load", str(ck), "--save", str(ck)], cache_dir, tmp_path, "flip")
    assert rc != 0 and _digests(ck) == flipped
    assert any("rank_00001.pt does not match its checksum" in line for line in _error_lines(out)), out[-3000:]
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))

    # `latest` lost: resume from the newest complete checkpoint, say so, keep the old ones.
    (ck / "latest_checkpointed_iteration.txt").unlink()
    proc, resumed = torchrun(2, args + ["--load", str(ck), "--save", str(ck)], cache_dir, tmp_path, name="resumed")
    assert f"resuming from {ck / 'iter_0000004'}" in proc.stdout and "no latest" in proc.stdout
    assert sorted(train_losses(resumed)) == [5, 6]
    now = _digests(ck)
    assert all(now[k] == v for k, v in saved.items() if k.startswith("iter_"))


def test_unwritable_save_fails_before_the_first_step(cache_dir, tmp_path):
    """Guards against a bad --save target being found only at the first save (or after the
    whole run) as a traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    rc, out, metrics = _run(TINY + ["--train-iters", "3", "--save", str(blocker / "ck")], cache_dir, tmp_path, "bad")
    assert rc != 0 and metrics == [] and "loco_megatron/" not in out  # no traceback through our code
    lines = _error_lines(out)
    assert lines and all(f"--save: cannot write to {blocker / 'ck'} (not a directory)" in line for line in lines)


def test_all_nan_run_aborts_and_keeps_the_last_good_checkpoint(cache_dir, tmp_path):
    """Guards against a diverged run (every step skipped for NaN) training on to the end,
    exiting 0, logging 'loss 0.0000' for all-skipped windows, or saving over good state;
    and against --inject-nan counting iterations differently from the console."""
    ck = tmp_path / "ck"
    args = TINY + ["--train-iters", "10", "--save", str(ck), "--save-interval", "2", "--inject-nan", "3-:1",
                   "--max-skipped-consecutive", "2"]
    rc, out, metrics = _run(args, cache_dir, tmp_path, "nan")
    assert rc != 0
    assert any("--max-skipped-consecutive: 2 consecutive steps skipped" in line for line in _error_lines(out))
    logged = {m["iteration"]: m for m in metrics if "train/skipped_iters" in m}
    assert sorted(logged) == [1, 2, 3, 4]
    assert [("train/lm_loss" in logged[i]) for i in (1, 2, 3, 4)] == [True, True, False, False]
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_compare_runs_keeps_the_latest_value_per_iteration(tmp_path):
    """Guards against a resumed run's appended jsonl (second config line, iterations logged
    twice after a crash between saves) giving compare_runs duplicated or stale points."""
    import json
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    from compare_runs import load_run

    def rec(it, loss):
        return {"iteration": it, "train/lm_loss": loss}

    lines = [{"config": {"resumed_from_iteration": 0}}, rec(1, 9.0), rec(2, 8.0), rec(3, 7.5), rec(4, 7.4),
             {"config": {"resumed_from_iteration": 2}}, rec(3, 7.0)]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = load_run(str(path))
    assert [(r["iteration"], r["train/lm_loss"]) for r in run.train] == [(1, 9.0), (2, 8.0), (3, 7.0)]


def test_save_error_is_one_line_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    """Guards against a full disk at save time ending in a torch traceback and leaving a
    partial iter_N.tmp folder behind, or touching the previous checkpoint."""
    import errno

    import torch
    import torch.distributed as dist

    from loco_megatron.checkpoint import Checkpointer
    from loco_megatron.config import ConfigError

    class Counter:
        def __init__(self):
            self.n = torch.zeros(3)

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ck = Checkpointer(str(tmp_path / "ck"), None, 0, {"world_size": 1})
        ck.save(1, {"c": Counter()})
        before = _digests(tmp_path / "ck")

        def full_disk(obj, path):
            pathlib.Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(torch, "save", full_disk)
        with pytest.raises(ConfigError) as e:
            ck.save(2, {"c": Counter()})
    finally:
        dist.destroy_process_group()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--save: writing") and "no space left on device" in msg
    assert "iter_0000001 is the latest checkpoint" in msg
    assert _digests(tmp_path / "ck") == before  # no iter_0000002.tmp, iter_1 and latest untouched


def test_save_target_refuses_to_overwrite_another_lineage(tmp_path):
    """Guards against both ways of getting --save wrong: a fresh start (or a resume from
    another folder) silently overwriting newer checkpoints, and an auto-resuming job
    (--load = --save) being refused because a crash cut the `latest` update after the
    newest folder was committed."""
    from loco_megatron.checkpoint import Checkpointer
    from loco_megatron.config import ConfigError

    root, other = tmp_path / "ck", tmp_path / "other"
    for folder in (root / "iter_0000002", root / "iter_0000004", other / "iter_0000002"):
        folder.mkdir(parents=True)
    Checkpointer(str(root), str(root), 0, {}).check_save_target(root / "iter_0000002")
    for load, resume in ((None, None), (str(other), other / "iter_0000002")):
        with pytest.raises(ConfigError, match="iter_0000004"):
            Checkpointer(str(root), load, 0, {}).check_save_target(resume)


def _job_processes(torchrun_pid: int, workers: dict[int, int]) -> list[int]:
    """Every live process of a local job: torchrun's session and each worker's (what a
    worker starts stays in its session), as Slurm signals every process of a step."""
    return _sessions({torchrun_pid, *workers.values()})


@pytest.mark.parametrize("fmt,to", [("torch_dist", "torchrun"), ("torch_dist_async", "every process"),
                                    ("torch", "torchrun")])
def test_stop_save_after_periodic_saves_survives_the_signal(fmt, to, cache_dir, tmp_path):
    """Guards against the stop save failing once a periodic save has run (issue 32): the
    rank's checkpoint helpers (megatron's writer Manager, the --async-save writer) died of
    the SIGTERM torchrun forwards to each worker's whole process group, so the stop save
    ended in "broken pipe" (torch_dist) or "not committed" plus BrokenPipeError tracebacks
    (--async-save) and the run fell back to an older checkpoint. SIGTERM to torchrun, or to
    every process of the job as Slurm sends it, now saves the stopped iteration (committed,
    no .tmp left) and the run resumes from it."""
    ck = tmp_path / "ck"
    extra = {"torch_dist": [], "torch_dist_async": ["--async-save"], "torch": ["--ckpt-format", "torch"]}[fmt]
    args = TINY + ["--train-iters", "40", "--lr-decay-iters", "40", "--save-interval", "2", "--save", str(ck),
                   "--load", str(ck), *extra]
    metrics = tmp_path / "first.jsonl"
    proc = _start(args, cache_dir, metrics)
    try:
        _wait_for_iteration(metrics, proc, 5)  # the saves of iterations 2 and 4 have run (or are in flight)
        if to == "torchrun":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            for pid in _job_processes(proc.pid, _workers(proc.pid)):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            for pid in _job_processes(proc.pid, _workers(proc.pid)):
                os.kill(pid, signal.SIGKILL)
    stopped = max(train_losses(read_metrics(metrics)))
    assert f"stop requested (SIGTERM received): saving at iteration {stopped}" in out, out[-3000:]
    assert stopped < 40
    assert "BrokenPipe" not in out and "--save:" not in out and "not committed" not in out, out[-3000:]
    # The only traceback is torchrun's own: it re-raises the signal once its workers are done.
    assert out.count("Traceback") == out.count("SignalException: Process"), out[-3000:]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped), out[-3000:]
    assert (ck / f"iter_{stopped:07d}").is_dir() and not list(ck.glob("*.tmp")), sorted(p.name for p in ck.iterdir())

    resume = [*args[:args.index("--train-iters") + 1], str(stopped + 1), *args[args.index("--train-iters") + 2:]]
    proc, resumed = torchrun(2, resume, cache_dir, tmp_path, name="resumed")
    assert f"resuming from {ck / f'iter_{stopped:07d}'}" in proc.stdout, proc.stdout[-3000:]
    assert sorted(train_losses(resumed)) == [stopped + 1]
    if fmt == "torch":  # the finished run again: it says so (exit 0) and re-saves nothing (issue 32)
        saved = _digests(ck)
        proc, again = torchrun(2, resume, cache_dir, tmp_path, name="again")
        assert f"nothing to train: resumed at iteration {stopped + 1}, which is --train-iters" in proc.stdout
        assert train_losses(again) == {} and _digests(ck) == saved


def test_ranks_stop_when_the_agent_dies(cache_dir, tmp_path):
    """Guards against ranks training on unsupervised after ``kill -9`` of the torchrun
    agent (issue 32): reparented to init they trained to --train-iters and wrote
    checkpoints nobody would collect. Now every rank notices at the next step (one flag in
    the per-step stop all-reduce), they save that step, say why once and exit non-zero."""
    ck = tmp_path / "ck"
    metrics = tmp_path / "orphan.jsonl"
    log = tmp_path / "orphan.log"
    args = TINY + ["--train-iters", "100000", "--save", str(ck)]
    cmd, env = torchrun_command(2, args, cache_dir, metrics)
    with log.open("w") as sink:  # a file: the ranks keep writing to it after the agent is gone
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_for_iteration(metrics, proc, 3)
        workers = _workers(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 240  # a bound for a hang, not a measurement
        while any(_alive(pid) for pid in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [pid for pid in workers.values() if _alive(pid)]
    finally:
        for pid in _sessions({proc.pid, *workers.values()}):
            os.kill(pid, signal.SIGKILL)
    out = log.read_text()
    assert not left, f"ranks still training after the agent died:\n{out[-3000:]}"
    stopped = max(train_losses(read_metrics(metrics)))
    lines = [line for line in out.splitlines() if "pretrain_gpt.py: error:" in line]
    assert len(lines) == 1 and f"the torchrun agent (pid {proc.pid}) exited" in lines[0], out[-3000:]
    assert f"at iteration {stopped}" in lines[0], lines
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped), out[-3000:]


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


DILOCO_ARGS = TINY + ["--train-iters", "24", "--lr-decay-iters", "24", "--diloco-replicas", "2",
                      "--diloco-inner-steps", "4", "--diloco-outer-bits", "4"]


def test_sigterm_to_one_replica_stops_every_replica_at_one_step(cache_dir, tmp_path):
    """Guards against a stop that reaches one site only: SIGTERM to replica 1's rank alone
    (replica 0 never sees it) must end both replicas at the same step, where the replicas'
    flags meet: one step after an outer step (outer steps at 4, 8, ...; the flags they
    carry are read a step later); that step is saved (with replica 1's own model), every
    rank exits 0, and the resumed run continues bit-exactly as one that never stopped.
    (With the stop agreed only inside each replica, replica 1 would stop alone and
    replica 0 would hang in the next outer exchange.)"""
    _, full = torchrun(2, DILOCO_ARGS, cache_dir, tmp_path, name="full")
    uninterrupted = train_losses(full)
    ck = tmp_path / "ck"
    metrics = tmp_path / "first.jsonl"
    proc = _start(DILOCO_ARGS + ["--save", str(ck), "--load", str(ck), "--save-interval", "100"], cache_dir, metrics)
    try:
        _wait_for_iteration(metrics, proc, 5)
        os.kill(_workers(proc.pid)[1], signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = max(train_losses(read_metrics(metrics)))
    assert f"stop requested (SIGTERM received on replica 1): saving at iteration {stopped}" in out, out[-3000:]
    assert stopped < 24 and stopped % 4 == 1, stopped
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    assert proc.returncode == 0 and "ChildFailedError" not in out, out[-3000:]

    _, resumed = torchrun(2, DILOCO_ARGS + ["--load", str(ck)], cache_dir, tmp_path, name="resumed")
    b = {**train_losses(read_metrics(metrics)), **train_losses(resumed)}
    assert sorted(b) == list(range(1, 25))
    assert b == uninterrupted
