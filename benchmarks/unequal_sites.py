#!/usr/bin/env python3
"""Unequal sites: two elastic DiLoCo replica jobs, one with half the compute of the other.

    sudo python benchmarks/unequal_sites.py --out results/unequal_sites
    python benchmarks/unequal_sites.py --smoke --out /tmp/us     # the plumbing, seconds-scale

Two replica jobs of one rank each and a ``torchft_lighthouse``, all local processes: the
*fast* site is pinned to CPU 0, the *slow* site to CPU 1 and held to half of it by a
cgroup (v1 ``cpu.cfs_quota_us`` = half of ``cpu.cfs_period_us``; needs root, and the
cgroup is removed at the end). Three variants train the same model for the same steps at
the same global batch (so the same token budget), on every seed of ``--seeds``:

* ``equal``: both sites at full speed, ``--diloco-batch-split fixed`` (the reference);
* ``lockstep``: the slow site at half speed, ``fixed`` (today's behaviour: the fast site
  waits for the slow one at every outer step);
* ``throughput``: the slow site at half speed, ``--diloco-batch-split throughput`` (each
  site's share of the global batch follows its measured samples per second).

Printed side by side, per variant (mean over the seeds): the fast site's share of its
training time spent at outer steps (``diloco/outer_wait_s`` over the wall time of its
steps; the whole run, and from the second outer interval on, after the first measurement
of the throughput split), the slow site's, the run's tokens per second (the global
batches of every step over the slower site's training time), the batch split in use at
the end, and the final eval loss with its paired difference to ``equal`` by seed (mean ±
sd of the relative differences; a gap no larger than its spread is a tie). The machine
should be otherwise idle: the sites' times are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import paired  # noqa: E402  (benchmarks/)
from elastic import LIGHTHOUSE, Jobs, _free_port, _metrics, _torchrun  # noqa: E402  (benchmarks/)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))
from check_install import find_program  # noqa: E402  (tools/)

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup/cpu")
VARIANTS = {"equal": (False, "fixed"), "lockstep": (True, "fixed"), "throughput": (True, "throughput")}
"""name -> (the slow site at half speed, --diloco-batch-split)."""


class HalfCore:
    """A cgroup v1 CPU group capped at half of one core; its processes' children stay in it."""

    def __init__(self, name: str):
        self.path = CGROUP_ROOT / name
        if not (CGROUP_ROOT / "cpu.cfs_quota_us").exists():
            sys.exit(f"error: {CGROUP_ROOT} is not a cgroup v1 cpu hierarchy: the slow site cannot be throttled")
        try:
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text("100000")
            (self.path / "cpu.cfs_quota_us").write_text("50000")
        except PermissionError:
            sys.exit(f"error: creating {self.path} needs root (the slow site's half core is a cgroup)")

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the group (the shell joins it, then becomes ``cmd``)."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "half-core", *cmd]

    def remove(self) -> None:
        if not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():  # (normally none: the jobs ended)
            try:
                (CGROUP_ROOT / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        try:
            self.path.rmdir()
        except OSError as e:
            print(f"warning: {self.path} not removed ({e})", file=sys.stderr)


def one_run(out: pathlib.Path, variant: str, seed: int, model: list[str], iters: int, h: int, timeout: float,
            half: HalfCore) -> dict:
    """Both sites of one variant and seed to the end; their metrics."""
    slow_half, split = VARIANTS[variant]
    folder = out / f"{variant}_seed{seed}"
    done = folder / "done.json"
    if done.exists():  # (a finished run is reused: the script can be re-run after an interruption)
        return json.loads(done.read_text())
    jobs = Jobs(folder, timeout)
    port = _free_port()
    address = f"http://localhost:{port}"
    try:
        jobs.start("lighthouse", [find_program("torchft_lighthouse"), "--bind", f"[::]:{port}", *LIGHTHOUSE])
        for r, site in enumerate(("fast", "slow")):
            (folder / f"{site}.jsonl").unlink(missing_ok=True)
            args = [*model, "--train-iters", str(iters), "--lr-decay-iters", str(iters), "--seed", str(seed),
                    "--diloco-replicas", "2", "--diloco-inner-steps", str(h), "--diloco-lighthouse", address,
                    "--diloco-replica-id", str(r), "--diloco-batch-split", split,
                    "--metrics-jsonl", str(folder / f"{site}.jsonl")]
            cmd = ["taskset", "-c", str(r), *_torchrun(1, args)]
            jobs.start(site, half.wrap(cmd) if site == "slow" and slow_half else cmd)
        deadline = time.monotonic() + timeout
        for site in ("fast", "slow"):
            code = jobs.procs[site].wait(timeout=max(deadline - time.monotonic(), 1))
            if code != 0:
                sys.exit(f"error: {variant} seed {seed}: the {site} site exited {code} (log: {folder / site}.log)")
    except subprocess.TimeoutExpired:
        sys.exit(f"error: {variant} seed {seed}: not finished within {timeout:.0f} s (logs: {folder})")
    finally:
        jobs.close()
    result = {site: _metrics(folder / f"{site}.jsonl") for site in ("fast", "slow")}
    result["split"] = [ln.split("DiLoCo: ", 1)[1] for ln in jobs.log("fast").splitlines() if "DiLoCo: batch split" in ln]
    done.write_text(json.dumps(result))
    return result


def site_figures(metrics: list[dict], h: int) -> dict:
    """From one site's per-step metrics (--log-interval 1): its training time, its time at
    outer steps, both over the whole run and from iteration H + 1 on."""
    steps = [m for m in metrics if "train/step_s" in m and "diloco/outer_wait_s" in m]
    later = [m for m in steps if m["iteration"] > h]
    final = [m["eval/lm_loss"] for m in metrics if "eval/lm_loss" in m]
    return {"train_s": sum(m["train/step_s"] for m in steps),
            "wait_share": sum(m["diloco/outer_wait_s"] for m in steps) / sum(m["train/step_s"] for m in steps),
            "wait_share_later": sum(m["diloco/outer_wait_s"] for m in later) / sum(m["train/step_s"] for m in later),
            "final_loss": final[-1] if final else float("nan")}


def _mean(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.fmean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="1234,1235")
    ap.add_argument("--iters", type=int, default=96)
    ap.add_argument("--inner-steps", type=int, default=16, help="H")
    ap.add_argument("--global-batch-size", type=int, default=48,
                    help="samples per step; a share moves in whole micro batches (2), 1/24 of it here")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 8 steps, H 4, one seed")
    args = ap.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        sys.exit(f"error: --seeds: '{args.seeds}' is not a comma-separated list of integers")
    if os.cpu_count() is None or os.cpu_count() < 2:
        sys.exit("error: the two sites need two CPUs (one each)")
    iters, h = args.iters, args.inner_steps
    model = ["--micro-batch-size", "2", "--global-batch-size", str(args.global_batch_size), "--log-interval", "1",
             "--loco-kernels", "torch", "--diloco-quorum-timeout-s", "600", "--eval-iters", "8"]
    if args.smoke:
        iters, h, seeds = 8, 4, seeds[:1]
        model += ["--eval-iters", "1", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--seq-length", "64"]
    model += ["--eval-interval", str(iters)]
    if iters < 2 * h:
        sys.exit(f"error: --iters {iters} must be at least 2 x --inner-steps ({2 * h})")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    half = HalfCore(f"loco_unequal_sites_{os.getpid()}")
    figures: dict[str, dict[int, dict]] = {}
    try:
        for seed in seeds:  # (seeds outermost: every variant has a point for the first seed first)
            for variant in VARIANTS:
                print(f"{variant} seed {seed}", flush=True)
                result = one_run(out, variant, seed, model, iters, h, args.timeout, half)
                fast, slow = site_figures(result["fast"], h), site_figures(result["slow"], h)
                tokens = args.global_batch_size * iters
                figures.setdefault(variant, {})[seed] = {
                    "fast": fast, "slow": slow, "samples_per_s": tokens / max(fast["train_s"], slow["train_s"]),
                    "split": result["split"][-1] if result["split"] else "half each: the fixed split"}
    finally:
        half.remove()
    ref = {s: f["fast"]["final_loss"] for s, f in figures["equal"].items()}
    lines = [f"# Unequal sites: 2 elastic DiLoCo replicas of one rank, the slow one held to half a core; {iters} "
             f"steps, H={h}, global batch {args.global_batch_size}, seeds {', '.join(map(str, seeds))}", "",
             "| variant | fast site at outer steps: whole run | from interval 2 | slow site at outer steps | "
             "run samples/s | vs equal sites | split at the end (fast site's line) | final eval loss | "
             "vs equal sites, paired |", "|---|---|---|---|---|---|---|---|---|"]
    base_speed = statistics.fmean(f["samples_per_s"] for f in figures["equal"].values())
    for variant, per_seed in figures.items():
        fs = list(per_seed.values())
        loss = {s: f["fast"]["final_loss"] for s, f in per_seed.items()}
        gap = "reference" if variant == "equal" else paired.fmt_gap(*paired.paired(loss, ref))
        if variant != "equal":
            mean, sd, _ = paired.paired(loss, ref)
            gap += f" ({paired.verdict(mean, sd)})"
        speed = statistics.fmean(f["samples_per_s"] for f in fs)
        lines.append(f"| {variant} | {_mean([100 * f['fast']['wait_share'] for f in fs], '.1f')}% | "
                     f"{_mean([100 * f['fast']['wait_share_later'] for f in fs], '.1f')}% | "
                     f"{_mean([100 * f['slow']['wait_share'] for f in fs], '.1f')}% | {_mean([f['samples_per_s'] for f in fs], '.1f')} | "
                     f"{speed / base_speed:.2f}x | {fs[-1]['split']} | {_mean(list(loss.values()), '.4f')} | {gap} |")
    md = "\n".join(lines) + "\n"
    (out / "unequal_sites.md").write_text(md)
    print(md)
    print(out / "unequal_sites.md")


if __name__ == "__main__":
    main()
