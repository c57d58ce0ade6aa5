#!/usr/bin/env python3
"""Per-node torchrun commands for a Slurm allocation (used by ``tools/slurm/*.sbatch``).

    # what every node would run, for the current (or a faked) SLURM_* environment, after
    # pretrain_gpt.py --dry-run for nodes x GPUs per node ranks (its one line, exit 2, if impossible):
    python tools/launch.py render --config configs/gpt_1.3b.yaml --run-dir runs/gpt -- --loco-bits 4
    # on one node (one Slurm task per node): exec its torchrun
    srun --ntasks-per-node=1 python tools/launch.py exec --config ... --run-dir ... -- OVERRIDES

The command trains ``pretrain_gpt.py --config CONFIG OVERRIDES`` with ``--save`` and
``--load`` in ``RUN_DIR/checkpoints`` (so a requeued job resumes from its latest
checkpoint), metrics in ``RUN_DIR/metrics.jsonl`` and ``--stop-file RUN_DIR/STOP``
(the sbatch signal handler creates it; training then saves and exits 0). Rendezvous
is torchrun's c10d on the first node of ``SLURM_JOB_NODELIST``.

Read from the environment: ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``),
``SLURM_NNODES``, ``SLURM_NODEID`` (exec only), ``SLURM_JOB_ID``, and the GPUs per node
from ``--nproc-per-node``, else ``SLURM_GPUS_ON_NODE``, else 1.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
RDZV_PORT_BASE = 29400
# torch 2.13: with the rendezvous' TCP store shared with the workers, a group restarted by
# --max-restarts fails in "Gloo connectFullMesh"; a store per rendezvous round restarts.
RESTART_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def expand_hostlist(spec: str, env: dict | None = None) -> list[str]:
    """Slurm's compressed host list -> host names, by Slurm itself (``scontrol show
    hostnames``): its grammar has more forms than a hand-written parser keeps up with
    (``r[1-2]n[01-02]``, nested brackets, zero padding). A plain comma-separated list
    (no brackets) needs no Slurm, so ``render`` also works off the cluster."""
    spec = spec.strip()
    if not spec:
        raise ValueError("empty host list")
    if "[" not in spec:
        return [h for h in spec.split(",") if h]
    scontrol = shutil.which("scontrol", path=(env or os.environ).get("PATH"))
    if scontrol is None:
        raise ValueError(f"expanding the host list '{spec}' needs Slurm's scontrol, which is not on PATH")
    proc = subprocess.run([scontrol, "show", "hostnames", spec], capture_output=True, text=True, env=env)
    hosts = proc.stdout.split()
    if proc.returncode != 0 or not hosts:
        why = (proc.stderr.strip().splitlines() or ["no host names"])[-1]
        raise ValueError(f"scontrol show hostnames '{spec}' failed: {why}")
    return hosts


def gpus_per_node(env: dict, nproc_per_node: int | None = None) -> int:
    """--nproc-per-node, else SLURM_GPUS_ON_NODE (e.g. '8' or '8(IDX:0-7)'), else 1."""
    return nproc_per_node or int(str(env.get("SLURM_GPUS_ON_NODE", "1")).split("(")[0] or 1)


def dry_run(python: str, config: str, overrides: list[str], world_size: int) -> tuple[int, str]:
    """``pretrain_gpt.py --dry-run`` for the job: (exit code, its report or its one error line).
    The same config and layout checks a real start makes, without starting anything."""
    proc = subprocess.run([python, str(REPO / "pretrain_gpt.py"), "--config", config, *overrides, "--dry-run",
                           "--world-size", str(world_size)], capture_output=True, text=True)
    if proc.returncode:
        lines = proc.stderr.strip().splitlines() or [f"the dry run failed with exit code {proc.returncode}"]
        return proc.returncode, lines[-1]
    return 0, proc.stdout.strip()


def node_command(node_rank: int, env: dict, config: str, run_dir: str, overrides: list[str],
                 nproc_per_node: int | None = None, python: str = "python", max_restarts: int = 0) -> list[str]:
    """The torchrun command for node ``node_rank`` of the allocation described by ``env``."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("SLURM_JOB_NODELIST is not set (run inside a Slurm allocation or fake it)")
    hosts = expand_hostlist(nodelist, env)
    nnodes = int(env.get("SLURM_NNODES", len(hosts)))
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is outside the {nnodes}-node allocation")
    job = env.get("SLURM_JOB_ID", "0")
    nproc = gpus_per_node(env, nproc_per_node)
    port = RDZV_PORT_BASE + int(job) % 1000 if job.isdigit() else RDZV_PORT_BASE
    ckpt = f"{run_dir}/checkpoints"
    return [python, "tools/torchrun.py", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0]}:{port}", f"--rdzv-id=loco-{job}",
            # the first node hosts the store (tools/torchrun.py keeps it until the others are done)
            f"--rdzv-conf=is_host={str(node_rank == 0).lower()}",
            f"--max-restarts={max_restarts}", "pretrain_gpt.py", "--config", config, "--save", ckpt, "--load", ckpt,
            "--metrics-jsonl", f"{run_dir}/metrics.jsonl", "--stop-file", f"{run_dir}/STOP", *overrides]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s {render,exec} --config C --run-dir D [options] -- [pretrain_gpt.py flags]")
    ap.add_argument("mode", choices=("render", "exec"), help="render: print every node's command; "
                    "exec: run this node's (SLURM_NODEID)")
    ap.add_argument("--config", required=True, help="configs/*.yaml")
    ap.add_argument("--run-dir", required=True, help="checkpoints, metrics and the stop file go here")
    ap.add_argument("--nproc-per-node", type=int, default=None)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--max-restarts", type=int, default=0,
                    help="torchrun restarts of the whole worker group after a worker fails; each "
                         "restart resumes from the latest checkpoint (set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    overrides = argv[cut + 1:]  # everything after -- goes to pretrain_gpt.py untouched
    if not os.path.isfile(args.config):
        sys.exit(f"error: --config: {args.config} does not exist")
    env = dict(os.environ)
    try:
        if args.mode == "render":
            nnodes = int(env.get("SLURM_NNODES") or len(expand_hostlist(env.get("SLURM_JOB_NODELIST", ""), env)))
            world = nnodes * gpus_per_node(env, args.nproc_per_node)
            rc, report = dry_run(args.python, args.config, overrides, world)
            if rc:
                print(report, file=sys.stderr)
                sys.exit(rc)
            print("\n".join(f"# {line}" for line in report.splitlines()))
            for i in range(nnodes):
                cmd = node_command(i, env, args.config, args.run_dir, overrides, args.nproc_per_node, args.python,
                               args.max_restarts)
                print(f"# node {i}\n{RESTART_ENV}=1 {shlex.join(cmd)}")
            return
        node = int(env.get("SLURM_NODEID", "-1"))
        cmd = node_command(node, env, args.config, args.run_dir, overrides, args.nproc_per_node, args.python,
                               args.max_restarts)
    except ValueError as e:
        sys.exit(f"error: {e}")
    os.makedirs(args.run_dir, exist_ok=True)
    os.environ.setdefault(RESTART_ENV, "1")
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
