"""Launch scripts: shell lint, Slurm command rendering run on localhost, the c10d store's end-of-run
barrier (tools/torchrun.py). The templates under a real Slurm: tests/test_slurm.py."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

from conftest import REPO, TINY, free_port, program, read_metrics

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


def test_template_gives_srun_the_cpus_per_task_and_label(tmp_path):
    """Guards against srun pinning each node's torchrun (all its ranks) to one core: Slurm
    22.05+ no longer hands sbatch's --cpus-per-task down to srun, so the template must pass
    it, with --label (which node printed a line). A stand-in srun records its flags: with
    this machine's local cluster (task/none, no cgroups) a real srun shows no binding; the
    rest of the template runs under a real Slurm in tests/test_slurm.py."""
    bin_dir = _shims(tmp_path)
    srun_log = tmp_path / "srun.log"
    (bin_dir / "srun").write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {srun_log}\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SCONTROL_LOG=str(tmp_path / "sc.log"),
               SLURM_JOB_NODELIST="127.0.0.1", SLURM_NNODES="2", SLURM_JOB_ID="5", SLURM_CPUS_PER_TASK="16",
               CONFIG="configs/tiny_gpt.yaml", RUN_DIR=str(tmp_path / "run"))
    for key in ("DATA_PATH", "TOKENIZER", "DILOCO_REPLICAS", "SETUP"):
        env.pop(key, None)
    job = subprocess.run(["bash", "tools/slurm/pretrain_gpt.sbatch"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert job.returncode == 0, job.stdout + job.stderr
    assert srun_log.read_text().split()[:4] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", "--label",
                                                "--cpus-per-task=16"]


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

    port = free_port()
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


