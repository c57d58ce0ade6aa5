"""Launch scripts: shell lint, Slurm command rendering run on localhost, requeue and resume, the
c10d store's end-of-run barrier (tools/torchrun.py)."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY, program, read_metrics

sys.path.insert(0, str(REPO / "tools"))
import launch  # noqa: E402

SCRIPTS = sorted([*REPO.glob("tools/**/*.sh"), *REPO.glob("tools/**/*.sbatch"), *REPO.glob("benchmarks/*.sh"),
                  REPO / ".ci" / "run"])


def test_every_script_passes_bash_n_and_shellcheck():
    """Guards against a syntax error or a quoting bug in a launch script that only shows
    up on the cluster."""
    assert len(SCRIPTS) >= 4
    shellcheck = program("shellcheck")
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(script)], check=True)
        proc = subprocess.run([shellcheck, "-x", str(script.relative_to(REPO))], cwd=REPO,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def test_hostlist_expansion_asks_slurm(tmp_path):
    """Guards against mis-reading Slurm's compressed node lists (the first host is the
    rendezvous endpoint): a hand-written parser broke on ``r[1-2]n[01-02]``; the list now
    goes to ``scontrol show hostnames`` (shimmed: it answers for that list only), a plain
    list needs no Slurm, and a failing or missing scontrol is one error."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(
        "#!/usr/bin/env bash\necho \"$@\" >> " + str(log) + "\n"
        "[[ $* == 'show hostnames r[1-2]n[01-02]' ]] || { echo 'scontrol: error: Invalid hostlist' >&2; exit 1; }\n"
        "printf '%s\\n' r1n01 r1n02 r2n01 r2n02\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="r[1-2]n[01-02]",
               SLURM_NNODES="4", SLURM_JOB_ID="7")
    assert launch.expand_hostlist("r[1-2]n[01-02]", env) == ["r1n01", "r1n02", "r2n01", "r2n02"]
    assert log.read_text().splitlines() == ["show hostnames r[1-2]n[01-02]"]
    cmd = launch.node_command(3, env, "configs/tiny_gpt.yaml", "runs/x", [])
    assert "--rdzv-endpoint=r1n01:29407" in cmd and "--nnodes=4" in cmd
    assert launch.expand_hostlist("a1,b2", {"PATH": ""}) == ["a1", "b2"]  # no Slurm needed
    with pytest.raises(ValueError, match="Invalid hostlist"):
        launch.expand_hostlist("n[3-1]", env)
    with pytest.raises(ValueError, match="needs Slurm's scontrol"):
        launch.expand_hostlist("n[1-2]", {"PATH": str(tmp_path / "empty")})


def test_template_checks_data_runs_setup_on_every_node_and_passes_cpus(tmp_path):
    """Guards against three ways a Slurm job goes wrong after waiting in the queue: a
    large config submitted without DATA_PATH/TOKENIZER (it trained a 1.3B model on the
    built-in corpus) must stop at once with one line; SETUP (environment activation) must
    run on every node before python starts; srun must get --cpus-per-task (Slurm 22.05+
    does not pass it down) and --label; DILOCO_REPLICAS must reach every node as
    --diloco-replicas, and a count that does not divide the nodes must stop at once."""
    bin_dir = _shims(tmp_path)
    srun_log, py_log = tmp_path / "srun.log", tmp_path / "python.log"
    # srun shim: log the flags it was given, then run the command once per fake node.
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\nflags=()\nwhile [[ $1 == --* ]]; do flags+=(\"$1\"); shift; done\n"
        f"echo \"${{flags[*]}}\" >> {srun_log}\n"
        "for ((i=0; i<SLURM_NNODES; i++)); do SLURM_NODEID=$i \"$@\" || exit $?; done\n")
    fake = tmp_path / "venv"  # what SETUP activates: a python that only records its call
    fake.mkdir()
    (fake / "python").write_text(f"#!/usr/bin/env bash\necho \"node $SLURM_NODEID: $*\" >> {py_log}\n")
    (fake / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SCONTROL_LOG=str(tmp_path / "sc.log"),
               SLURM_JOB_NODELIST="127.0.0.1", SLURM_NNODES="2", SLURM_JOB_ID="5", SLURM_CPUS_PER_TASK="16",
               CONFIG="configs/gpt_1.3b.yaml", RUN_DIR=str(tmp_path / "run"))
    env.pop("DATA_PATH", None), env.pop("TOKENIZER", None)
    no_data = subprocess.run(["bash", "tools/slurm/pretrain_gpt.sbatch"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=60)
    assert no_data.returncode == 2 and not srun_log.exists() and not (tmp_path / "run").exists()
    assert no_data.stderr.strip().splitlines() == [
        "error: configs/gpt_1.3b.yaml needs real data: set DATA_PATH (indexed dataset prefix) and TOKENIZER "
        "(its tokenizer model)"]

    env.update(DATA_PATH="data/corpus", TOKENIZER="data/tok.model", SETUP=f'export PATH="{fake}:$PATH"')
    job = subprocess.run(["bash", "tools/slurm/pretrain_gpt.sbatch"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert job.returncode == 0, job.stdout + job.stderr
    assert srun_log.read_text().split() == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", "--label",
                                            "--cpus-per-task=16"]
    calls = py_log.read_text().splitlines()
    assert sorted(c.split(":")[0] for c in calls) == ["node 0", "node 1"]  # srun starts nodes in parallel
    assert all("tools/launch.py exec --config configs/gpt_1.3b.yaml" in c
               and "-- --data-path data/corpus --tokenizer-model data/tok.model --loco-bits 4" in c for c in calls)

    py_log.unlink()
    bad = subprocess.run(["bash", "tools/slurm/pretrain_gpt.sbatch"], cwd=REPO, env=dict(env, DILOCO_REPLICAS="3"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and not py_log.exists()
    assert bad.stderr.strip().splitlines() == [
        "error: DILOCO_REPLICAS=3 does not divide the job's 2 nodes (replicas are whole nodes)"]
    job = subprocess.run(["bash", "tools/slurm/pretrain_gpt.sbatch"], cwd=REPO, env=dict(env, DILOCO_REPLICAS="2"),
                         capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stdout + job.stderr
    calls = py_log.read_text().splitlines()
    assert len(calls) == 2 and all("-- --diloco-replicas 2 --data-path data/corpus" in c for c in calls), calls


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
    # the store's host waited for the other agent (tools/torchrun.py): no failed close or keep-alive
    assert not [line for o in outputs for line in o.splitlines() if "recvVector failed" in line
                or "has failed to shutdown the rendezvous" in line or "keep-alive" in line]
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
    from that checkpoint and finishes, continuing the same wandb run."""
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
    # wandb (offline here) follows the requeue: both starts log to the one run id kept
    # next to the checkpoints, in WANDB_DIR = RUN_DIR (every requeue was a new run).
    run_id = (run_dir / "checkpoints" / "wandb_run_id").read_text().strip()
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(d.name.endswith(f"-{run_id}") for d in wandb_runs), wandb_runs


def test_elastic_templates_start_the_lighthouse_and_one_job_per_replica(tmp_path):
    """Guards against the elastic DiLoCo templates of docs/diloco.md going wrong only on a
    cluster: the lighthouse job must write the address the replica jobs read and start
    torchft_lighthouse with a bind and a heartbeat timeout; each replica job must pass
    --diloco-lighthouse/--diloco-replica-id/--diloco-replicas to every node, keep its own
    RUN_DIR (RUN_ROOT/replica<ID>: a resubmitted replica resumes its own checkpoints), and
    refuse a missing or out-of-range REPLICA_ID, or DILOCO_REPLICAS (the one-job mode),
    with one line before anything starts."""
    bin_dir = _shims(tmp_path)
    lh_log, py_log = tmp_path / "lighthouse.log", tmp_path / "python.log"
    (bin_dir / "torchft_lighthouse").write_text(f"#!/usr/bin/env bash\necho \"$*\" > {lh_log}\n")
    (bin_dir / "hostname").write_text("#!/usr/bin/env bash\necho node7.site-a\n")
    fake = tmp_path / "venv"
    fake.mkdir()
    (fake / "python").write_text(f"#!/usr/bin/env bash\necho \"node $SLURM_NODEID: $*\" >> {py_log}\n")
    for f in [*bin_dir.iterdir(), fake / "python"]:
        f.chmod(0o755)
    root = tmp_path / "run"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RUN_ROOT=str(root), LIGHTHOUSE_PORT="29555")
    lh = subprocess.run(["bash", "tools/slurm/lighthouse.sbatch"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=60)
    assert lh.returncode == 0, lh.stdout + lh.stderr
    assert (root / "lighthouse.url").read_text().strip() == "http://node7.site-a:29555"
    assert lh_log.read_text().split()[:2] == ["--bind", "[::]:29555"] and "--heartbeat_timeout_ms" in lh_log.read_text()

    env.update(SLURM_JOB_NODELIST="127.0.0.1", SLURM_NNODES="2", SLURM_JOB_ID="6", SCONTROL_LOG=str(tmp_path / "sc"),
               CONFIG="configs/tiny_gpt.yaml", REPLICAS="3", SETUP=f'export PATH="{fake}:$PATH"')
    env.pop("DILOCO_REPLICAS", None)
    for bad, line in (({"REPLICA_ID": "3"}, "error: set REPLICA_ID to this replica's id, 0 to 2"),
                      ({"REPLICA_ID": "1", "DILOCO_REPLICAS": "2"},
                       "error: DILOCO_REPLICAS splits one job into replicas; here each replica is a job (set REPLICAS)")):
        proc = subprocess.run(["bash", "tools/slurm/diloco_replica.sbatch"], cwd=REPO, env=dict(env, **bad),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line] and not py_log.exists()
    job = subprocess.run(["bash", "tools/slurm/diloco_replica.sbatch"], cwd=REPO, env=dict(env, REPLICA_ID="1"),
                         capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stdout + job.stderr
    calls = py_log.read_text().splitlines()
    assert sorted(c.split(":")[0] for c in calls) == ["node 0", "node 1"]  # srun starts nodes in parallel
    assert all(f"--run-dir {root}/replica1" in c and "-- --diloco-lighthouse http://node7.site-a:29555 "
               "--diloco-replica-id 1 --diloco-replicas 3 --loco-bits 4" in c for c in calls), calls


def test_the_store_host_waits_for_the_other_nodes_agents():
    """Guards against the end-of-run noise of a multi-node torchrun (a C++ "recvVector failed"
    stack trace, failed keep-alives, "failed to shutdown the rendezvous" on the other nodes):
    the first node's agent took the c10d store with it as soon as its own workers were done.
    tools/torchrun.py's host keeps the store's server (the agent's backend shares it:
    multi_tenant) until every other node's agent has closed the rendezvous."""
    import threading

    from torch.distributed import TCPStore
    from torch.distributed.run import parse_args

    import torchrun

    port = _free_port()
    argv = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=t", "x.py"]
    host = torchrun.StoreKeeper(parse_args([*argv[:4], "--rdzv-conf=is_host=true", argv[4]]))
    other = torchrun.StoreKeeper(parse_args([*argv[:4], "--rdzv-conf=is_host=false", argv[4]]))
    assert host.active and other.active and not torchrun.StoreKeeper(parse_args(argv)).active
    agent = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    agent.set("rendezvous", "closed")
    del agent  # the host's agent is done; its store's server stays up
    done = threading.Event()
    waiting = threading.Thread(target=lambda: (host.at_end(), done.set()), daemon=True)
    waiting.start()
    assert not done.wait(1)  # the host waits for the other node ...
    other.at_end()  # ... whose agent, done later, still reaches the store
    assert done.wait(60) and host.store.get("rendezvous") == b"closed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

