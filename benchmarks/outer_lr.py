#!/usr/bin/env python3
"""DiLoCo's outer learning rate across the inner interval H and the replica count R: the
study behind ``--diloco-outer-lr``'s default.

Every cell (R replicas of one rank, H inner steps) trains the same model on the same data
(``quality.py --model small``: global batch 8, the built-in corpus, ``--iters`` steps) at
every outer LR of ``--lrs`` on every seed of ``--seeds``, so all comparisons are paired by
seed. Per variant (``quality.py``'s names without ``-hH``: ``dl4`` the default 4-bit outer
exchange, ``dl0`` fp32 outer, ``dl2gc`` the 2-bit form with gain-corrected scales and classic
error feedback) ``outer_lr.md`` holds

* the final eval loss of every cell at every LR (mean ± sd over the seeds), its best LR in bold;
* every LR against its cell's best LR, as paired relative differences (mean ± sd over the
  seeds; a gap no larger than its spread is a tie);
* the LR a default should take: per LR, its mean and worst gap to the best LR over all
  cells and the cells where it ties the best. The default is the LR with the lowest mean
  gap; a cell whose best LR is the grid's edge is named, since a wider grid may do better.

    python benchmarks/outer_lr.py --out results/outer_lr --replicas 2,4 --inner-steps 16,32,64 \\
        --lrs 0.2,0.3,0.4 --seeds 1234,1235,1236 --variants dl4
    python benchmarks/outer_lr.py --out results/outer_lr ... --report-only   # tables from the runs done so far
    python benchmarks/outer_lr.py --smoke --out /tmp/olr    # seconds-scale check of the plumbing
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import paired  # noqa: E402  (benchmarks/)
import quality  # noqa: E402  (benchmarks/)


def _floats(text: str, flag: str) -> list[str]:
    try:
        return [f"{float(x):g}" for x in text.split(",") if x]
    except ValueError:
        sys.exit(f"error: {flag}: '{text}' is not a comma-separated list of numbers")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        sys.exit(f"error: {flag}: '{text}' is not a comma-separated list of positive integers")
    return values


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def _finished(path: pathlib.Path, iters: int) -> float | None:
    """The final eval loss of a run that reached ``iters`` (None: missing or cut short)."""
    import compare_runs

    try:
        run = compare_runs.load_run(str(path)) if path.exists() else None
    except (SystemExit, ValueError):
        return None
    if run is None or not run.evals or run.evals[-1]["iteration"] != iters:
        return None
    return run.evals[-1]["eval/lm_loss"]


def best_lr(cell: dict[str, dict[int, float]]) -> str:
    """The LR of ``cell`` (lr -> seed -> final loss) with the lowest mean over the seeds
    every LR ran (ties: the lower LR)."""
    seeds = set.intersection(*(set(v) for v in cell.values()))
    return min(cell, key=lambda lr: (statistics.fmean(cell[lr][s] for s in seeds), float(lr)))


def default_rows(cells: dict[tuple[int, int], dict[str, dict[int, float]]]) -> list[tuple]:
    """Per LR that every cell ran: (lr, mean gap to each cell's best LR over the cells,
    worst gap, [(cell, paired mean, sd, n)] per cell), sorted by the mean gap (the first row
    is the default a study of these cells supports)."""
    lrs = set.intersection(*(set(c) for c in cells.values()))
    rows = []
    for lr in lrs:
        per_cell = []
        for key, cell in sorted(cells.items()):
            mean, sd, n = paired.paired(cell[lr], cell[best_lr(cell)])
            per_cell.append((key, mean, sd, n))
        gaps = [m for _, m, _, _ in per_cell]
        rows.append((lr, statistics.fmean(gaps), max(gaps), per_cell))
    return sorted(rows, key=lambda r: (r[1], float(r[0])))


def report(variant: str, cells: dict[tuple[int, int], dict[str, dict[int, float]]], iters: int) -> list[str]:
    """``outer_lr.md``'s lines for ``variant``: see the module docstring."""
    lrs = sorted({lr for c in cells.values() for lr in c}, key=float)
    label = quality.VARIANTS[f"{variant}-h{next(iter(cells))[1]}"][0].split(", ", 1)[1]
    lines = [f"## {label}: final eval loss after {iters} steps (mean ± sd over the seeds; bold: the cell's best LR)",
             "", "| replicas | H | " + " | ".join(f"lr {lr}" for lr in lrs) + " | seeds |",
             "|---|---|" + "---|" * len(lrs) + "---|"]
    for (r, h), cell in sorted(cells.items()):
        best = best_lr(cell)
        row = [(f"**{_spread(list(cell[lr].values()))}**" if lr == best else _spread(list(cell[lr].values())))
               if lr in cell else "" for lr in lrs]
        seeds = sorted(set.union(*(set(v) for v in cell.values())))
        lines.append(f"| {r} | {h} | " + " | ".join(row) + f" | {', '.join(map(str, seeds))} |")
    lines += ["", f"## {label}: each LR against its cell's best LR, paired by seed (mean ± sd of the relative "
              "differences)", "", "| replicas | H | " + " | ".join(f"lr {lr}" for lr in lrs) + " |",
              "|---|---|" + "---|" * len(lrs)]
    for (r, h), cell in sorted(cells.items()):
        best = best_lr(cell)
        row = []
        for lr in lrs:
            if lr not in cell:
                row.append("")
            elif lr == best:
                row.append("best")
            else:
                mean, sd, n = paired.paired(cell[lr], cell[best])
                row.append(f"{paired.fmt_gap(mean, sd, n)}{' (tie)' if sd is not None and abs(mean) <= sd else ''}")
        lines.append(f"| {r} | {h} | " + " | ".join(row) + " |")
    rows = default_rows(cells)
    lines += ["", f"## {label}: one LR for every cell (gap to each cell's best LR, paired by seed)", "",
              "| lr | mean gap over the cells | worst gap | cells where it is the best or a tie |", "|---|---|---|---|"]
    for lr, mean, worst, per_cell in rows:
        ties = [f"R={r} H={h}" for (r, h), m, sd, _ in per_cell if m == 0.0 or (sd is not None and abs(m) <= sd)]
        lines.append(f"| {lr} | {mean:+.2f}% | {worst:+.2f}% | {len(ties)} of {len(per_cell)}"
                     f"{': ' + ', '.join(ties) if ties else ''} |")
    edges = [f"R={r} H={h} ({best_lr(c)})" for (r, h), c in sorted(cells.items())
             if best_lr(c) in (min(c, key=float), max(c, key=float)) and len(c) > 1]
    lines += ["", f"- default supported by these cells: **{rows[0][0]}** (the lowest mean gap)"]
    if edges:
        lines.append(f"- best LR at the edge of the grid: {', '.join(edges)}")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--replicas", default="2,4", help="replica counts (one rank each)")
    ap.add_argument("--inner-steps", default="16,32,64", help="H values (each must have quality.py variants)")
    ap.add_argument("--lrs", default="0.2,0.3,0.4", help="outer learning rates")
    ap.add_argument("--seeds", default="1234,1235,1236")
    ap.add_argument("--variants", default="dl4", help="quality.py DiLoCo variants without -hH (dl4, dl0, dl2gc, ...)")
    ap.add_argument("--iters", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 32 steps, one cell, two LRs, two seeds")
    ap.add_argument("--report-only", action="store_true",
                    help="no runs: the tables from the finished runs in --out (a seed counts in a cell where it "
                         "finished at every LR the cell ran)")
    args = ap.parse_args()
    model = ["--eval-interval", str(max(args.iters // 4, 1)), "--eval-iters", "4", "--log-interval", "10",
             *quality.SMALL_MODEL]
    if args.smoke:
        args.iters, args.replicas, args.inner_steps, args.lrs, args.seeds = 32, "2", "16", "0.3,0.4", "1234,1235"
        model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "1",
                 "--eval-interval", "32", "--eval-iters", "1", "--log-interval", "8"]
    replicas, hs = _ints(args.replicas, "--replicas"), _ints(args.inner_steps, "--inner-steps")
    lrs, seeds = _floats(args.lrs, "--lrs"), _ints(args.seeds, "--seeds")
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        for h in hs:
            if f"{v}-h{h}" not in quality.VARIANTS:
                sys.exit(f"error: --variants/--inner-steps: quality.py has no variant {v}-h{h}")
    out = pathlib.Path(args.out)
    for sub in ("runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    finals: dict[str, dict[tuple[int, int], dict[str, dict[int, float]]]] = {v: {} for v in variants}
    # Seeds outermost: after the first seed every cell has a point at every LR.
    for seed in seeds:
        for r in replicas:
            for h in hs:
                for v in variants:
                    for lr in lrs:
                        name = f"{v}-h{h}-r{r}-lr{lr}_seed{seed}"
                        if args.report_only:
                            final = _finished(out / "runs" / f"{name}.jsonl", args.iters)
                            if final is not None:
                                finals[v].setdefault((r, h), {}).setdefault(lr, {})[seed] = final
                            continue
                        print(f"[{time.time() - t0:6.0f}s] {name}", flush=True)
                        flags = [f.format(ranks=r) for f in quality.VARIANTS[f"{v}-h{h}"][1]]
                        run = quality.run(out, name, [*model, *flags, "--diloco-outer-lr", lr, "--train-iters",
                                                      str(args.iters), "--seed", str(seed)], args.timeout, r,
                                          reuse=True)
                        finals[v].setdefault((r, h), {}).setdefault(lr, {})[seed] = run.evals[-1]["eval/lm_loss"]
    if args.report_only:  # (a seed counts in a cell only where it finished at every LR of the cell)
        for cells in finals.values():
            for key, cell in list(cells.items()):
                common = set.intersection(*(set(per_seed) for per_seed in cell.values()))
                cells[key] = {lr: {s: x for s, x in per_seed.items() if s in common} for lr, per_seed in cell.items()}
                if not common or len(cell) < 2:  # (a cell needs two LRs to compare)
                    del cells[key]
        if not any(finals.values()):
            sys.exit(f"error: --report-only: no cell of {out / 'runs'} finished at every LR")
    lines = [f"# DiLoCo outer learning rate across H and replicas: {args.iters} steps, replicas of one rank, "
             f"seeds {', '.join(map(str, seeds))}", ""]
    for v in variants:
        lines += report(v, finals[v], args.iters)
    (out / "outer_lr.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(out / "outer_lr.md")


if __name__ == "__main__":
    main()
