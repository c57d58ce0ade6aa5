#!/usr/bin/env python3
"""A real Slurm cluster of 3 nodes on this machine, in the background, to try the sbatch
templates before a real cluster (how it is built: ``tools/slurm/local_slurm.py``).

    apt-get install -y slurm-wlm munge              # Debian/Ubuntu; run everything as root
    python tools/slurm/local_cluster.py start       # nodes n[1-3]; prints the SLURM_CONF to export
    export SLURM_CONF=/run/loco-slurm/local/slurm.conf
    sbatch ... tools/slurm/pretrain_gpt.sbatch; squeue; scontrol show job N
    python tools/slurm/local_cluster.py stop

``start`` leaves a process that owns the cluster; the cluster stops with everything it
started at ``stop``, when that process gets SIGTERM or SIGINT, when a daemon dies, or after
``--hours``. Where it cannot run (not root, no Slurm) ``start`` says why in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from local_slurm import STATE_ROOT, ClusterError, LocalSlurm, SimClusterError, clean_leftovers, start_time, \
    unavailable  # noqa: E402

CLI_NAME = "local"
"""The folder (under STATE_ROOT) of the cluster that ``start`` runs in the background."""


# -- command line ------------------------------------------------------------------------
def _fail(line: str) -> None:
    """One line on stderr, exit 2."""
    print(line if line.startswith("error:") else f"error: {line}", file=sys.stderr, flush=True)
    sys.exit(2)


def _serve(args) -> None:
    """The background owner of the ``start``ed cluster: holds it until SIGTERM/SIGINT,
    ``--hours``, or a daemon's death, then stops it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    cluster = LocalSlurm(args.nodes, cpus=args.cpus, rate=args.rate, delay=args.delay, name=CLI_NAME)
    try:
        cluster.start()
        deadline = time.monotonic() + args.hours * 3600
        while time.monotonic() < deadline:
            dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
            if dead:
                print(f"error: {dead[0]} exited ({cluster.log_tail(dead[0])}); stopping the cluster", flush=True)
                return
            time.sleep(1)
        print(f"the cluster's {args.hours} h are over; stopping it", flush=True)
    except (ClusterError, SimClusterError) as e:
        print(f"error: {e}", flush=True)
    finally:
        cluster.close()


def _start(args) -> None:
    reason = unavailable()
    if reason:
        _fail(f"local Slurm cluster {reason}")
    clean_leftovers()
    folder = STATE_ROOT / CLI_NAME
    if folder.exists():
        _fail(f"a local cluster is already running ({folder}); stop it with: python tools/slurm/local_cluster.py stop")
    log = pathlib.Path(f"{folder}.log")
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, __file__, "serve", "--nodes", str(args.nodes), "--cpus",
                                   str(args.cpus), "--hours", str(args.hours),
                                   *(["--rate", args.rate] if args.rate else []),
                                   *(["--delay", args.delay] if args.delay else [])],
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    deadline = time.monotonic() + 180
    while not (folder / "ready").exists():
        if server.poll() is not None or time.monotonic() > deadline:
            if server.poll() is None:
                server.terminate()
                server.wait(60)
            lines = log.read_text().strip().splitlines() or ["the cluster did not start"]
            log.unlink()
            _fail(lines[-1])
        time.sleep(0.2)
    nodes = f"n[1-{args.nodes}]" if args.nodes > 1 else "n1"
    shaped = f", links {args.rate or ''}{' ' if args.rate and args.delay else ''}{args.delay or ''}" \
        if args.rate or args.delay else ""
    print(f"local Slurm cluster up: {args.nodes} nodes {nodes} ({args.cpus} CPUs each{shaped}), partition cpu; "
          f"stops at `python tools/slurm/local_cluster.py stop` or after {args.hours:g} h")
    print(f"export SLURM_CONF={folder / 'slurm.conf'}")


def _stop(args) -> None:
    folder = STATE_ROOT / CLI_NAME
    try:
        state = json.loads((folder / "cluster.json").read_text())
    except (OSError, ValueError):
        clean_leftovers()
        _fail("no local cluster is running")
    if start_time(state["owner"]) == state["owner_start"]:
        os.kill(state["owner"], signal.SIGTERM)
        deadline = time.monotonic() + 60
        while start_time(state["owner"]) == state["owner_start"] and time.monotonic() < deadline:
            time.sleep(0.2)
        if start_time(state["owner"]) == state["owner_start"]:
            os.kill(state["owner"], signal.SIGKILL)
            time.sleep(0.5)
    clean_leftovers()
    pathlib.Path(f"{folder}.log").unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        STATE_ROOT.rmdir()  # when no other cluster runs
    print("local Slurm cluster stopped")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("start", "serve"):
        p = sub.add_parser(name, help="start a cluster in the background" if name == "start" else argparse.SUPPRESS)
        p.add_argument("--nodes", type=int, default=3, help="nodes n1..nN (default 3)")
        p.add_argument("--cpus", type=int, default=8, help="CPUs each node offers Slurm (default 8)")
        p.add_argument("--rate", default=None, help="tc rate of every node's link, e.g. 1gbit (default: unshaped)")
        p.add_argument("--delay", default=None, help="netem delay of every node's link, e.g. 1ms")
        p.add_argument("--hours", type=float, default=8, help="stop by itself after this long (default 8)")
    sub.add_parser("stop", help="stop the cluster: end its jobs and daemons, remove its namespaces")
    args = ap.parse_args()
    if args.command != "stop" and not 1 <= args.nodes <= 50:
        ap.error("--nodes must be in [1, 50]")
    {"start": _start, "serve": _serve, "stop": _stop}[args.command](args)


if __name__ == "__main__":
    main()
