#!/usr/bin/env python3
"""Muon against AdamW, with LoCo and inside DiLoCo (MuLoCo), on paired seeds, each variant at
its own tuned learning rate.

Every run trains ``quality.py --model small`` (the default 4-layer model, global batch 8 on 2
ranks, the built-in corpus) for ``--iters`` steps; runs of one seed share data order and
initial weights, so every comparison is paired by seed (:mod:`paired`). In this order:

1. data parallel, 2 ranks: AdamW (``fp32``) at every LR of ``--adamw-lrs`` and Muon (``muon``)
   at every LR of ``--muon-lrs`` (``--lr``: Muon's and its AdamW part's), on the sweep seeds
   ``--seeds``; each optimizer's tuned LR is its lowest mean final eval loss there;
2. Muon with LoCo 4-bit gradients (``muon-loco4``) at Muon's tuned LR;
3. DiLoCo, ``--replicas`` replicas of one rank, H = ``--inner-steps``: AdamW-DiLoCo with fp32 outer
   gradients (``dl0-hH``) at AdamW's tuned LR, MuLoCo with fp32, 4-bit and 2-bit outer gradients
   (``mdl0-hH``, ``mdl4-hH``: error feedback beta 0.8; ``mdl2gc-hH``: the 2-bit default form,
   gain-corrected scales with classic error feedback) at Muon's tuned LR, each at every outer LR
   of ``--outer-lrs``, its tuned outer LR chosen the same way;
4. ``--final-seeds``: every variant once more per seed at its tuned LR(s).

``muon.md`` holds the LR grids and the paired gaps (mean ± sd of ``100 (a - b) / b`` over the
seeds; a gap whose magnitude is at most its spread is a tie), for the questions of the study:
Muon vs AdamW; AdamW-DiLoCo and MuLoCo each against data-parallel AdamW (and MuLoCo against
data-parallel Muon); MuLoCo 4-/2-bit against MuLoCo fp32; Muon + LoCo 4-bit against Muon.

    nice -n 10 python benchmarks/muon.py --out results/muon --iters 512 --seeds 1234 --final-seeds 1235,1236 \
        --adamw-lrs 2e-3,4e-3,8e-3 --muon-lrs 2e-3,4e-3,8e-3 --outer-lrs 0.15,0.25,0.4,0.55,0.7
    python benchmarks/muon.py --out results/muon ... --report-only   # the tables from the finished runs
    python benchmarks/muon.py --smoke --out /tmp/muon                 # seconds-scale check of the plumbing
    nice -n 10 python benchmarks/muon.py --out results/muon --speed 3   # the step-time ratio (speed.md)
    nice -n 10 python benchmarks/muon.py --out results/muon_scales --iters 512 --seeds 1234 --scales 0.2,0.5,1

``--scales 0.2,0.5,1``: Muon at each extra scale factor and AdamW at each LR of ``--scale-lrs``
on one seed (``scales.md``): the measurement behind --muon-extra-scale-factor's default.
``--speed PAIRS``: Muon's step time against AdamW's at the default model (configs/tiny_gpt.yaml
on 2 ranks), alternating runs so a change in the machine's load hits both, and the share of
Muon's step spent in Newton-Schulz (``--profile``'s ``muon/newton_schulz`` ranges).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import paired  # noqa: E402  (benchmarks/)
import quality  # noqa: E402  (benchmarks/)


def _floats(text: str, flag: str) -> list[str]:
    try:
        values = [f"{float(x):g}" for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values:
        sys.exit(f"error: {flag}: '{text}' is not a comma-separated list of numbers")
    return values


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        sys.exit(f"error: {flag}: '{text}' is not a comma-separated list of integers")


def gap_line(finals: dict, a: str, b: str, labels: dict) -> str:
    """``a`` at its tuned LR against ``b`` at its tuned LR, paired (:func:`paired.pair_line`)."""
    return paired.pair_line(finals, a, b, labels)


def report(finals: dict, h: int, replicas: int, iters: int, seeds: list[int], factor: str = "") -> list[str]:
    """``muon.md``'s lines (see the module docstring) from ``finals[(variant, lr)][seed]``."""
    dl, mdl = f"dl0-h{h}", f"mdl0-h{h}"
    labels = {"fp32": "AdamW", "muon": "Muon", "muon-loco4": "Muon + LoCo 4-bit",
              dl: "AdamW-DiLoCo (fp32 outer)", mdl: "MuLoCo (fp32 outer)", f"mdl4-h{h}": "MuLoCo (4-bit outer)",
              f"mdl2gc-h{h}": "MuLoCo (2-bit outer)"}
    have = [v for v in labels if any(k[0] == v for k in finals)]
    muon = f"Muon (--muon-extra-scale-factor {factor})" if factor else "Muon"
    lines = [f"# {muon} vs AdamW, LoCo and DiLoCo (H={h}, {replicas} replicas): {iters} steps, final eval loss, "
             f"seeds {', '.join(map(str, seeds))}", ""]
    dp = [v for v in ("fp32", "muon") if v in have]
    if dp:
        lines += ["## Data parallel: mean over the sweep seeds at each learning rate (bold: the tuned LR)", "",
                  *paired.lr_table(finals, dp, labels), ""]
    outer = [v for v in (dl, mdl, f"mdl4-h{h}", f"mdl2gc-h{h}") if v in have]
    if outer:
        lines += ["## DiLoCo: mean over the sweep seeds at each outer learning rate (inner LR: the data-parallel "
                  "tuned one of its optimizer)", "", *paired.lr_table(finals, outer, labels), ""]
    lines += ["## Paired gaps, each side at its tuned LR", ""]
    pairs = [("muon", "fp32"), (dl, "fp32"), (mdl, "fp32"), (mdl, "muon"), (mdl, dl),
             (f"mdl4-h{h}", mdl), (f"mdl2gc-h{h}", mdl), ("muon-loco4", "muon")]
    for a, b in pairs:
        if a in have and b in have:
            lines.append(f"- {gap_line(finals, a, b, labels)}")
    if dl in have and mdl in have and "fp32" in have:
        adam_gap = paired.paired(finals[dl, paired.tuned_lr(finals, dl)[0]], finals["fp32", paired.tuned_lr(finals, "fp32")[0]])
        muon_gap = paired.paired(finals[mdl, paired.tuned_lr(finals, mdl)[0]], finals["fp32", paired.tuned_lr(finals, "fp32")[0]])
        half = adam_gap[0] / 2
        met = muon_gap[0] <= half and (muon_gap[1] is None or abs(muon_gap[0] - half) > muon_gap[1])
        lines += ["", f"- target (MuLoCo's gap to data-parallel AdamW at most half of AdamW-DiLoCo's): AdamW-DiLoCo "
                  f"{paired.fmt_gap(*adam_gap)}, half of it {half:+.2f}%; MuLoCo {paired.fmt_gap(*muon_gap)}: "
                  + ("met, beyond the spread" if met else "not met beyond the spread of MuLoCo's gap")]
    for a, b in [(f"mdl4-h{h}", mdl), (f"mdl2gc-h{h}", mdl), ("muon-loco4", "muon")]:
        if a in have and b in have:
            mean, sd, n = paired.paired(finals[a, paired.tuned_lr(finals, a)[0]], finals[b, paired.tuned_lr(finals, b)[0]])
            worst = abs(mean) + (sd or 0.0)
            if sd is None:
                verdict = "one seed: no spread"
            elif worst <= 0.5:
                verdict = f"mean and spread together {worst:.2f}%: met, spread included"
            elif abs(mean) <= 0.5:
                verdict = (f"mean and spread together {worst:.2f}%: the mean is within 0.5%, the spread does not rule "
                           f"out more")
            else:
                verdict = "not met"
            lines.append(f"- target ({labels[a]} within 0.5% of {labels[b]}): mean {mean:+.2f}%, {verdict}")
    return lines + [""]


def _trace_ms(path: pathlib.Path, name: str) -> float:
    """Milliseconds spent in the profiler range ``name`` (every event of it) in a Chrome trace."""
    import json

    events = json.loads(path.read_text()).get("traceEvents", [])
    return sum(e.get("dur", 0) for e in events if e.get("name") == name and e.get("ph") == "X") / 1e3


def speed(out: pathlib.Path, pairs: int, iters: int, timeout: float, extra: list[str] = ()) -> list[str]:
    """Muon's step time against AdamW's at the default model (configs/tiny_gpt.yaml, 2 ranks,
    no LoCo), ``pairs`` times each, alternating so a change in the machine's load hits both;
    per run the median ``train/step_s`` of steps 11..``iters`` outside the profiled window,
    and for Muon the Newton-Schulz share: the ``muon/newton_schulz`` ranges of rank 0's
    profile (steps 6-10) per step, against that run's median step time."""
    import statistics

    rows, ratios, shares, optim = [], [], [], []
    for i in range(pairs):
        step = {}
        for opt in ("adam", "muon"):
            name = f"speed-{opt}-{i}"
            prof = out / "profiles" / name
            flags = ["--optimizer", opt, "--train-iters", str(iters), "--eval-interval", "0", "--log-interval", "1",
                     "--profile", "--profile-step-start", "6", "--profile-step-end", "10", "--profile-dir", str(prof),
                     *extra]
            print(f"speed: {name}", flush=True)
            run = quality.run(out, name, flags, timeout, 2)
            times = [t["train/step_s"] for t in run.train if 11 <= t["iteration"] <= iters]
            step[opt] = statistics.median(times)
            if opt == "muon":
                ns = _trace_ms(prof / "trace_rank0.json", "muon/newton_schulz") / 5 / 1e3
                shares.append(ns / step[opt])
            optim.append((opt, _trace_ms(prof / "trace_rank0.json", "optimizer_step") / 5 / 1e3 / step[opt]))
        ratios.append(step["muon"] / step["adam"])
        rows.append(f"| {i + 1} | {step['adam'] * 1e3:.1f} | {step['muon'] * 1e3:.1f} | {ratios[-1]:.3f} | "
                    f"{shares[-1] * 100:.1f}% |")
    opt_share = {o: statistics.median(x for k, x in optim if k == o) for o in ("adam", "muon")}
    return [f"# Step time: Muon / AdamW at the default model (configs/tiny_gpt.yaml, 2 ranks, {iters} steps, "
            f"{pairs} pairs)", "", "| pair | AdamW step (ms, median) | Muon step (ms, median) | Muon / AdamW | "
            "Newton-Schulz share of Muon's step |", "|---|---|---|---|---|", *rows, "",
            f"- median ratio Muon / AdamW: **{statistics.median(ratios):.3f}** (range {min(ratios):.3f}-"
            f"{max(ratios):.3f}); Newton-Schulz: **{statistics.median(shares) * 100:.1f}%** of Muon's step "
            f"(median); the optimizer step: {opt_share['adam'] * 100:.1f}% of AdamW's step, "
            f"{opt_share['muon'] * 100:.1f}% of Muon's (profiled steps 6-10, rank 0)", ""]


def scales_table(finals: dict, scales: list[str], lrs: list[str], seed: int, iters: int) -> list[str]:
    """``scales.md``: AdamW and Muon at each --muon-extra-scale-factor, at each --lr (one seed):
    which factor makes adding --optimizer muon to an AdamW command at the same --lr no worse."""
    head = ["| --lr | AdamW | " + " | ".join(f"Muon, factor {x}" for x in scales) + " |", "|---|---|" + "---|" * len(scales)]
    rows, wins = [], {x: [] for x in scales}
    for lr in lrs:
        adam = finals.get(("fp32", lr), {}).get(seed)
        cells = []
        for x in scales:
            m = finals.get((f"muon-x{x}", lr), {}).get(seed)
            if m is None:
                cells.append("")
                continue
            if adam is not None:
                wins[x].append(m <= adam)
            cells.append(f"{m:.4f}" + (f" ({100 * (m - adam) / adam:+.2f}%)" if adam is not None else ""))
        rows.append(f"| {lr} | {'' if adam is None else f'{adam:.4f}'} | " + " | ".join(cells) + " |")
    verdict = [f"factor {x}: no worse than AdamW at {sum(w)} of the {len(w)} LRs both ran" for x, w in wins.items() if w]
    return [f"# Muon's extra scale factor: final eval loss after {iters} steps, seed {seed} (in brackets: against "
            "AdamW at the same --lr)", "", *head, *rows, "", *(f"- {v}" for v in verdict), ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=512)
    ap.add_argument("--seeds", default="1234,1235", help="sweep seeds: every LR of every grid runs on each")
    ap.add_argument("--final-seeds", default="", help="more seeds, at each variant's tuned LR(s) only")
    ap.add_argument("--adamw-lrs", default="1e-3,2e-3,4e-3")
    ap.add_argument("--muon-lrs", default="1e-3,2e-3,4e-3")
    ap.add_argument("--outer-lrs", default="0.4,0.55,0.7")
    ap.add_argument("--inner-steps", type=int, default=32)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--stages", default="dp,loco,diloco", help="which of dp, loco, diloco to run (dp first)")
    ap.add_argument("--muon-factor", default="",
                    help="--muon-extra-scale-factor of every Muon run (default: the flag's default)")
    ap.add_argument("--outer-variants", default="dl0,mdl0,mdl4,mdl2gc",
                    help="which DiLoCo variants the diloco stage runs (their H: --inner-steps)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--data-cache-path", default=None, help="passed to pretrain_gpt.py (built-in corpus cache)")
    ap.add_argument("--report-only", action="store_true", help="no runs: the tables from the finished runs")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 16 steps, one seed, one LR per grid (plumbing)")
    ap.add_argument("--scales", default="",
                    help="instead of the study: Muon at each of these --muon-extra-scale-factor values and AdamW, at "
                         "each LR of --scale-lrs, on the first of --seeds (scales.md)")
    ap.add_argument("--scale-lrs", default="1e-3,2e-3,4e-3,8e-3")
    ap.add_argument("--speed", type=int, default=0, metavar="PAIRS",
                    help="instead of the study: the step-time ratio, PAIRS alternating AdamW/Muon runs (speed.md)")
    ap.add_argument("--speed-iters", type=int, default=40)
    args = ap.parse_args()
    cache = ["--data-cache-path", args.data_cache_path] if args.data_cache_path else []
    if args.speed:
        out = pathlib.Path(args.out)
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "runs").mkdir(parents=True, exist_ok=True)
        lines = speed(out, args.speed, args.speed_iters, args.timeout, cache)
        (out / "speed.md").write_text("\n".join(lines))
        print("\n".join(lines))
        return
    model = ["--eval-interval", str(max(args.iters // 4, 1)), "--eval-iters", "4", "--log-interval", "10",
             *quality.SMALL_MODEL]
    if args.smoke:
        args.iters, args.seeds, args.final_seeds, args.inner_steps = 16, "1234", "", 16
        args.adamw_lrs = args.muon_lrs = "1e-3"
        args.outer_lrs = "0.55"
        model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "1",
                 "--eval-interval", "16", "--eval-iters", "1", "--log-interval", "8"]
    model += cache
    if args.scales:
        return run_scales(args, model)
    h = args.inner_steps
    if f"dl0-h{h}" not in quality.VARIANTS:
        sys.exit(f"error: --inner-steps: quality.py has no DiLoCo variants for H={h}")
    seeds, final_seeds = _ints(args.seeds, "--seeds"), _ints(args.final_seeds, "--final-seeds")
    grids = {"fp32": _floats(args.adamw_lrs, "--adamw-lrs"), "muon": _floats(args.muon_lrs, "--muon-lrs")}
    outer_lrs = _floats(args.outer_lrs, "--outer-lrs")
    stages = set(args.stages.split(","))
    out = pathlib.Path(args.out)
    for sub in ("runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    finals: dict[tuple[str, str], dict[int, float]] = {}

    def one(variant: str, seed: int, lr: str, outer: str | None = None) -> None:
        name = f"{variant}-lr{lr}" + (f"-olr{outer}" if outer else "") + f"_seed{seed}"
        ranks = args.replicas if outer else 2
        key = (variant, outer or lr)
        if args.report_only:
            import outer_lr

            final = outer_lr._finished(out / "runs" / f"{name}.jsonl", args.iters)
            if final is not None:
                finals.setdefault(key, {})[seed] = final
            return
        print(f"[{time.time() - t0:6.0f}s] {name}", flush=True)
        flags = [f.format(ranks=ranks) for f in quality.VARIANTS[variant][1]]
        if args.muon_factor and "muon" in flags:
            flags += ["--muon-extra-scale-factor", args.muon_factor]
        flags += ["--lr", lr] + (["--diloco-outer-lr", outer] if outer else [])
        run = quality.run(out, name, [*model, *flags, "--train-iters", str(args.iters), "--seed", str(seed)],
                          args.timeout, ranks, reuse=True)
        finals.setdefault(key, {})[seed] = run.evals[-1]["eval/lm_loss"]

    def tuned(variant: str) -> str | None:
        try:
            return paired.tuned_lr(finals, variant)[0]
        except (ValueError, TypeError):
            return None

    outer_variants = {f"dl0-h{h}": "fp32", f"mdl0-h{h}": "muon", f"mdl4-h{h}": "muon", f"mdl2gc-h{h}": "muon"}
    chosen = {f"{v}-h{h}" for v in args.outer_variants.split(",") if v}
    if chosen - set(outer_variants):
        sys.exit(f"error: --outer-variants: {', '.join(sorted(chosen - set(outer_variants)))}: not one of "
                 f"{', '.join(v.rsplit('-', 1)[0] for v in outer_variants)}")
    outer_variants = {v: inner for v, inner in outer_variants.items() if v in chosen}
    for seed in seeds:  # seeds outermost: after the first one every grid has a point at every LR
        for v, grid in grids.items():
            for lr in grid if "dp" in stages else ():
                one(v, seed, lr)
    for seed in seeds + final_seeds:
        for v in grids:
            if seed in final_seeds and "dp" in stages and tuned(v):
                one(v, seed, tuned(v))
        if "loco" in stages and tuned("muon"):
            one("muon-loco4", seed, tuned("muon"))
        for v, inner in outer_variants.items():
            if "diloco" in stages and tuned(inner):
                for olr in (outer_lrs if seed in seeds else [tuned(v)] if tuned(v) else []):
                    one(v, seed, tuned(inner), olr)
    # (muon-loco4 runs at one LR: its "tuned" LR is Muon's)
    lines = report(finals, h, args.replicas, args.iters, seeds + final_seeds, args.muon_factor)
    (out / "muon.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(out / "muon.md")


def run_scales(args, model: list) -> None:
    """The ``--scales`` stage (see :func:`scales_table`); ``--report-only``: from the finished runs."""
    import outer_lr

    scales, lrs = _floats(args.scales, "--scales"), _floats(args.scale_lrs, "--scale-lrs")
    seed = _ints(args.seeds, "--seeds")[0]
    out = pathlib.Path(args.out)
    for sub in ("runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    finals: dict = {}
    for lr in lrs:
        for variant, flags in [("fp32", quality.VARIANTS["fp32"][1])] + [
                (f"muon-x{x}", [*quality.VARIANTS["muon"][1], "--muon-extra-scale-factor", x]) for x in scales]:
            name = f"{variant}-lr{lr}_seed{seed}"
            if args.report_only:
                final = outer_lr._finished(out / "runs" / f"{name}.jsonl", args.iters)
            else:
                print(f"scales: {name}", flush=True)
                final = quality.run(out, name, [*model, *flags, "--lr", lr, "--train-iters", str(args.iters), "--seed",
                                                str(seed)], args.timeout, 2, reuse=True).evals[-1]["eval/lm_loss"]
            if final is not None:
                finals.setdefault((variant, lr), {})[seed] = final
    lines = scales_table(finals, scales, lrs, seed, args.iters)
    (out / "scales.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
