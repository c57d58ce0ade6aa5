#!/usr/bin/env python3
"""Elastic DiLoCo: what a replica's failure costs the survivors, and how fast it rejoins.

    python benchmarks/elastic.py --out results/elastic

For 2 and 3 replicas (each its own torchrun job of one rank, gloo, 4-bit outer gradients)
and a ``torchft_lighthouse``, all local processes: the last replica is SIGKILLed (its
agent and its rank) in the middle of an outer interval, the others train on, and once
they are two intervals further the killed replica is restarted from its own last
checkpoint; once it has taken an outer step with them every job is stopped. Printed side by side, per replica count:

* **time lost per failure** by each survivor: the sum, over its outer steps from the
  kill to the restart, of what each took beyond the median outer step before the kill.
  It is mostly the wait at the first sync point after the kill, until the lighthouse
  stops counting the dead replica as healthy (``--heartbeat_timeout_ms``). (The steps
  between outer steps are left out: here the replicas share 2 cores, and once the
  killed one's CPU is free they run faster, which would hide the loss.) Target: at
  most one outer interval (H x the median step time), which is printed next to it.
* **rejoin**: seconds from the restarted job's launch to its line "healed from replica"
  (start-up, checkpoint load, the wait for the live replicas' next sync point, the heal
  over torchft's transport). Target: under 60 s.
* **whole-job restart**, what the single-world mode (one torchrun for every replica) does
  instead: the seconds from the launch of the same replicas as one job with ``--load`` to
  its first step, measured, during which *every* replica stands; plus the steps redone
  since the last checkpoint (half a save interval on average, at the median step time).

The model is pretrain_gpt.py's default with micro batch 2 and two micro batches per
replica; times are this machine's (2 cores shared by every replica), so compare the
columns of one run, not runs on different machines.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from check_install import find_program  # noqa: E402  (tools/)

LIGHTHOUSE = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
              "--heartbeat_timeout_ms", "5000"]
"""The lighthouse of docs/diloco.md's "Survive a site"."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def _iteration(path: pathlib.Path) -> int:
    return max((m.get("iteration", 0) for m in _metrics(path)), default=0)


class Jobs:
    """Processes of one measurement (each in a session of its own), killed at the end."""

    def __init__(self, folder: pathlib.Path, timeout: float):
        self.folder, self.timeout, self.procs = folder, timeout, {}
        folder.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: list[str]) -> float:
        env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
        log = open(self.folder / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return time.monotonic()

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def wait_for(self, name: str, done, what: str) -> float:
        deadline = time.monotonic() + self.timeout
        while not done():
            if self.procs[name].poll() is not None:
                sys.exit(f"error: {name} ended before {what} (log: {self.folder / name}.log)")
            if time.monotonic() > deadline:
                sys.exit(f"error: {name}: no {what} within {self.timeout:.0f} s (log: {self.folder / name}.log)")
            time.sleep(0.1)
        return time.monotonic()

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        children = pathlib.Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        pids = [proc.pid, *(int(p) for p in children.read_text().split())] if children.exists() else [proc.pid]
        for pid in pids:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=60)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=60)


def _model(replicas: int) -> list[str]:
    return ["--micro-batch-size", "2", "--global-batch-size", str(4 * replicas), "--eval-interval", "0",
            "--log-interval", "1", "--loco-kernels", "torch"]


def _torchrun(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "pretrain_gpt.py"), *args]


def elastic(out: pathlib.Path, replicas: int, h: int, iters: int, timeout: float) -> dict:
    """One failure and one rejoin among ``replicas`` replica jobs (see the module docstring)."""
    folder = out / f"elastic_r{replicas}"
    jobs = Jobs(folder, timeout)
    port = _free_port()
    address = f"http://localhost:{port}"
    try:
        jobs.start("lighthouse", [find_program("torchft_lighthouse"), "--bind", f"[::]:{port}", *LIGHTHOUSE])

        def args(r: int, *more: str) -> list[str]:
            return [*_model(replicas), "--train-iters", str(iters), "--diloco-replicas", str(replicas),
                    "--diloco-inner-steps", str(h), "--diloco-outer-bits", "4", "--diloco-lighthouse", address,
                    "--diloco-replica-id", str(r), "--save", str(folder / f"ck{r}"), "--save-interval", str(h),
                    "--metrics-jsonl", str(folder / f"r{r}.jsonl"), *more]

        victim = replicas - 1
        for r in range(replicas):
            (folder / f"r{r}.jsonl").unlink(missing_ok=True)
            jobs.start(f"r{r}", _torchrun(1, args(r)))
        kill_at = 4 * h + h // 2  # mid-interval, after four outer steps (a checkpoint at 4H)
        jobs.wait_for(f"r{victim}", lambda: _iteration(folder / f"r{victim}.jsonl") >= kill_at, f"iteration {kill_at}")
        killed = _iteration(folder / f"r{victim}.jsonl")
        jobs.kill(f"r{victim}")
        restart_at = killed + 2 * h
        jobs.wait_for("r0", lambda: _iteration(folder / "r0.jsonl") >= restart_at, f"iteration {restart_at}")
        restarted = _iteration(folder / "r0.jsonl")
        (folder / f"r{victim}.jsonl").rename(folder / f"r{victim}_killed.jsonl")
        t0 = jobs.start("rejoin", _torchrun(1, args(victim, "--load", str(folder / f"ck{victim}"),
                                                     "--metrics-jsonl", str(folder / "rejoin.jsonl"))))
        t1 = jobs.wait_for("rejoin", lambda: "DiLoCo: healed from replica" in jobs.log("rejoin"), "heal")
        healed_at = _iteration(folder / "r0.jsonl")
        # one outer step together after the heal, then the measurement is complete
        jobs.wait_for("rejoin", lambda: _iteration(folder / "rejoin.jsonl") > healed_at + h, "an outer step after the heal")
        for name in [f"r{r}" for r in range(replicas) if r != victim]:
            if jobs.procs[name].poll() is not None:
                sys.exit(f"error: {name} ended during the measurement (log: {folder / name}.log)")
    finally:
        jobs.close()
    measure = {"killed_at": killed, "restarted_at": restarted, "rejoin_s": t1 - t0}
    (folder / "measure.json").write_text(json.dumps(measure))
    return measure


def lost_time(folder: pathlib.Path, replicas: int, h: int, measure: dict) -> dict:
    """Per survivor, the time its outer steps between the kill and the restart took beyond
    the median outer step before the kill (the wait for the quorum to drop the dead
    replica, a discarded exchange); the other steps are left out: on a machine whose cores
    the replicas share they run faster once the killed replica's CPU is free, which would
    hide the loss. The median step and outer interval before the kill."""
    lost, medians = [], []
    for r in range(replicas - 1):
        steps = {m["iteration"]: m["train/step_s"] for m in _metrics(folder / f"r{r}.jsonl") if "train/step_s" in m}
        before = [i for i in steps if 2 < i <= measure["killed_at"]]  # (the first steps warm up)
        # (the first outer step also waits for the replicas' start-up skew: left out)
        outer = statistics.median(steps[i] for i in before if i % h == 0 and i > h)
        lost.append(sum(max(0.0, steps[i] - outer) for i in steps
                        if measure["killed_at"] < i <= measure["restarted_at"] and i % h == 0))
        medians.append(statistics.median(steps[i] for i in before))
    step = statistics.median(medians)
    return {"lost_s": lost, "interval_s": h * step, "step_s": step}


def whole_job_restart(out: pathlib.Path, replicas: int, h: int, timeout: float) -> float:
    """Seconds from a one-world launch of ``replicas`` replicas with --load to its first
    step (the checkpoint written by a first run of 2H steps)."""
    folder = out / f"restart_r{replicas}"
    jobs = Jobs(folder, timeout)
    common = [*_model(replicas), "--diloco-replicas", str(replicas), "--diloco-inner-steps", str(h),
              "--diloco-outer-bits", "4", "--save", str(folder / "ck"), "--save-interval", str(h)]
    try:
        jobs.start("first", _torchrun(replicas, [*common, "--train-iters", str(2 * h)]))
        jobs.procs["first"].wait(timeout=timeout)
        if jobs.procs["first"].returncode != 0:
            sys.exit(f"error: the one-world run failed (log: {folder}/first.log)")
        metrics = folder / "restart.jsonl"
        metrics.unlink(missing_ok=True)
        t0 = jobs.start("restart", _torchrun(replicas, [*common, "--train-iters", str(2 * h + 2), "--load",
                                                        str(folder / "ck"), "--metrics-jsonl", str(metrics)]))
        t1 = jobs.wait_for("restart", lambda: _iteration(metrics) > 2 * h, "first step")
        jobs.procs["restart"].wait(timeout=timeout)
    finally:
        jobs.close()
    return t1 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--replicas", default="2,3", help="replica counts to measure (default 2,3)")
    ap.add_argument("--inner-steps", type=int, default=32, help="H, the outer interval in steps (default 32)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds any one wait may take")
    args = ap.parse_args()
    counts = [int(x) for x in args.replicas.split(",") if x]
    if not counts or min(counts) < 2:
        sys.exit("error: --replicas: each count must be 2 or more (a failure needs a survivor)")
    h = args.inner_steps
    if h < 2:
        sys.exit("error: --inner-steps must be 2 or more")
    out = pathlib.Path(args.out)
    rows = []
    for r in counts:
        # (the replicas are stopped once the rejoined one has taken an outer step with them)
        measure = elastic(out, r, h, iters=1000 * h, timeout=args.timeout)
        e = {**measure, **lost_time(out / f"elastic_r{r}", r, h, measure)}
        restart = whole_job_restart(out, r, h, args.timeout)
        redo = h / 2 * e["step_s"]  # a save every H steps: half an interval redone on average
        lost = ", ".join(f"{x:.1f}" for x in e["lost_s"])
        rows.append(f"| {r} | {e['step_s']:.3f} | {e['interval_s']:.1f} | {lost} | "
                    f"{max(e['lost_s']) / e['interval_s']:.2f} | {e['rejoin_s']:.1f} | {restart:.1f} + {redo:.1f} |")
    md = (f"# Elastic DiLoCo: one replica killed mid-interval and restarted, H={h}, 4-bit outer, 1 rank per "
          f"replica (gloo)\n\nlighthouse: torchft_lighthouse {' '.join(LIGHTHOUSE)}\n\n"
          "| replicas | median step (s) | outer interval (s) | time lost per survivor (s) | "
          "worst lost / interval (target <= 1) | rejoin: launch to healed (s, target < 60) | "
          "whole-job restart instead: launch to first step + steps redone (s, every replica) |\n"
          "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    (out / "elastic.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
