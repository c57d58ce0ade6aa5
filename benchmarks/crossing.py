#!/usr/bin/env python3
"""Collectives that cross between DiLoCo replicas, per step, and what a round trip between
two sites would cost a step.

    python benchmarks/crossing.py --out results/crossing

Each variant trains the tiny model on 2 local ranks (gloo) as 2 replicas of one rank (the
data-parallel row: 2 ranks of one data-parallel group), with every torch.distributed
collective recorded (``benchmarks/collective_log.py``: megatron-core's, the checkpointer's
and ours). Per training step, over the whole run (the set-up before the first step and the
end of the run, which are paid once, left out): the collectives whose group spans both
replicas, and of them the *blocking* ones, waited for in the step that issued them (a
collective waited ``lag`` steps later, as DiLoCo's stop flags and Streaming's phases are,
hides its round trip behind those steps of training). A step that waits on a blocking
collective waits at least one round trip between the sites, and up to one per blocking
collective when they run one after another (DiLoCo's two phases do: the second needs
the first's sums); so at a round-trip time ``r`` a step waits, on average, between
``(steps that wait / steps) x r`` and ``blocking x r`` (plus the bandwidth the bytes
take). These machines' kernel has no netem, so the delay itself cannot be simulated
here: the figures are computed from the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "2", "--eval-interval", "16",
        "--eval-iters", "1", "--log-interval", "1", "--loco-kernels", "torch"]
_DILOCO = ["--loco-bits", "0", "--diloco-replicas", "2", "--diloco-inner-steps", "32"]
VARIANTS = {
    "dp": ("data-parallel every step (bf16 reduce-scatter)", ["--loco-bits", "0", "--bf16",
                                                                "--grad-reduce-in-bf16"]),
    "dl4": ("DiLoCo H=32, LoCo 4-bit outer", [*_DILOCO, "--diloco-outer-bits", "4"]),
    "dls4": ("Streaming DiLoCo H=32 F=2 tau=2, LoCo 4-bit outer",
             [*_DILOCO, "--diloco-outer-bits", "4", "--diloco-fragments", "2", "--diloco-sync-delay", "2"]),
    "dlnone": ("DiLoCo replicas, no outer exchange", [*_DILOCO[:-1], "1000000", "--diloco-outer-bits", "4"]),
}
RTTS_MS = (50, 100)


def counts(log: list, steps: int) -> dict:
    """Per-step means over steps 1..``steps`` of the crossing collectives (group spanning
    ranks 0 and 1), the blocking ones (waited in their own step) and the hidden ones."""
    crossing = [e for e in log if isinstance(e[0], int) and 1 <= e[0] <= steps and 0 in e[1] and 1 in e[1]]
    blocking = [e for e in crossing if e[3] == e[0]]
    return {"crossing": len(crossing) / steps, "blocking": len(blocking) / steps,
            "hidden": (len(crossing) - len(blocking)) / steps,
            "waiting_steps": len({e[0] for e in blocking}) / steps}


def run(out: pathlib.Path, name: str, flags: list[str], iters: int, timeout: float) -> dict:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "benchmarks" / "collective_log.py"), *TINY, *flags, "--train-iters", str(iters)]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", LOCO_COLLECTIVE_LOG_DIR=str(folder))
    with open(folder / "log.txt", "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"error: {name} failed with exit code {proc.returncode} (log: {folder / 'log.txt'})")
    return counts(json.loads((folder / "all_rank0.json").read_text()), iters)


def table(rows: dict) -> str:
    head = ("| run | collectives crossing between the replicas / step | of them waited in their own step "
            "(blocking) | waited steps later (hidden) | steps that wait on the link | "
            + " | ".join(f"wait per step at RTT {r} ms" for r in RTTS_MS) + " |")
    out = [head, "|---|---|---|---|---|" + "---|" * len(RTTS_MS)]
    for name, c in rows.items():
        # At least one round trip in a step that waits; up to one per blocking collective
        # when they run one after another.
        waits = " | ".join(f"{c['waiting_steps'] * r:.1f} - {c['blocking'] * r:.1f} ms" for r in RTTS_MS)
        out.append(f"| {VARIANTS[name][0]} | {c['crossing']:.3f} | {c['blocking']:.3f} | {c['hidden']:.3f} "
                   f"| {c['waiting_steps']:.3f} | {waits} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=64, help="training steps per run (default 64: two outer intervals)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        sys.exit(f"error: --variants: unknown {unknown[0]!r} (choose from {', '.join(VARIANTS)})")
    out = pathlib.Path(args.out)
    rows = {name: run(out, name, VARIANTS[name][1], args.iters, args.timeout) for name in names}
    md = (f"# Collectives crossing between 2 replicas: {args.iters} steps, 2 ranks (gloo), per step\n\n"
          + table(rows))
    (out / "crossing.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
