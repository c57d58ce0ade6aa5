#!/usr/bin/env python3
"""Loss parity of LoCo vs full-precision gradient sync, on the built-in corpus, on CPU.

Every variant trains the same model on the same data with the same token budget and
the same seeds, on 2 local ranks (gloo); only the gradient sync (and, for the last
two, the parameter all-gather) differs:

    fp32          megatron's fp32 reduce-scatter (the reference)
    loco4, loco2  LoCo (moving-average error feedback, beta 0.8)
    ef4, ef2      classic error feedback (--loco-beta 0)
    noef4, noef2  plain low-bit quantisation (--no-loco-error-feedback)
    loco4p8       LoCo 4-bit + 8-bit parameter differences (--param-gather-bits 8)
    loco4p4       LoCo 4-bit + 4-bit parameter differences (--param-gather-bits 4)
    loco2p2       LoCo 2-bit + 2-bit parameter differences (--param-gather-bits 2, with the
                  gradients' 2-bit options; not in the default set: --variants loco2p2)
    fsdp, fsdp4   Megatron-FSDP as HSDP over two one-rank nodes, full precision / LoCo 4-bit
                  on the cross-node reduction (not in the default set: --variants fsdp,fsdp4)

The DiLoCo section (``--variants diloco``, with ``--ranks R``: R replicas of one rank each)
compares DiLoCo's outer exchanges against ``fp32`` (every step, the DDP reference):
``dl0-hH`` fp32 outer all-reduce every H inner steps; ``dl4F-hH`` / ``dl2F-hH`` LoCo 4-/2-bit
outer gradients in the form ``F`` (:data:`OUTER_FORMS`): none = error feedback with beta
0.8 (int8 errors), ``c`` classic error feedback (beta 0), ``n`` none, ``g`` gain-corrected
scales without error feedback, ``gc`` gain-corrected with classic error feedback; for
H = 16, 32 and 64 (outer Nesterov momentum 0.9, the default outer lr unless swept; the ``diloco`` section
runs H = 16 and 32; ``outer_lr.py`` sweeps the outer LR across H and the replica count). ``--outer-lrs`` runs
every DiLoCo variant at each of several outer LRs and writes ``outer_lr.md``: the sweep,
and each variant at its own tuned LR against fp32 outer at its tuned LR, as paired
differences by seed (:mod:`paired`); ``--final-seeds`` adds seeds at the tuned LRs only.
``--model small`` (2 micro batches of 2 per rank at 2 ranks, global batch 8) makes the
1,000-step runs this study needs affordable on a 2-core CPU.

The 2-bit section (``--variants 2bit``) runs the quantiser options one at a time and
combined, with LoCo error feedback (``loco2-*``) and without (``noef2-*``); the suffix
letters are u = --loco-quantizer uniform, m = --loco-scale mse, h = --loco-rotation
hadamard, s = --loco-rounding stochastic (absent: symmetric, absmax, none, nearest).
``loco2``, ``ef2``, ``noef2`` are the original 2-bit scheme (every option given
explicitly) and ``loco2d`` is whatever ``--loco-bits 2`` alone gives.

Writes ``quality.md`` (final and best eval loss per variant, mean and spread over
seeds, gap to fp32) and ``loss_vs_tokens.png`` (mean eval loss over seeds) to --out.

    python benchmarks/quality.py --out results/quality --seeds 1234,1235
    python benchmarks/quality.py --out results/quality2bit --variants 2bit --seeds 1234,1235
    python benchmarks/quality.py --out results/quality2bit_long --iters 400 --variants fp32,loco2d,loco2
    python benchmarks/quality.py --out results/quality_diloco_r2 --ranks 2 --iters 1024 --model small \
        --variants diloco --seeds 1234,1235
    python benchmarks/quality.py --out results/quality_outer_lr_r2 --ranks 2 --iters 1024 --model small \
        --variants fp32,dl0-h32,dl4-h32,dl4c-h32,dl4n-h32,dl2-h32,dl2c-h32,dl2n-h32,dl2g-h32,dl2gc-h32 \
        --outer-lrs 0.4,0.55,0.7,0.85,1.0 --seeds 1234,1235 --final-seeds 1236,1237
    python benchmarks/quality.py --smoke --out /tmp/q    # seconds-scale check
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import compare_runs  # noqa: E402
import paired  # noqa: E402  (benchmarks/, this script's folder)

_OPTION_LETTERS = {"u": ("quantizer", "uniform"), "m": ("scale", "mse"), "h": ("rotation", "hadamard"),
                   "s": ("rounding", "stochastic")}
_FSDP = ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2", "--loco-ranks-per-node", "1",
         "--ckpt-format", "torch"]
_ORIGINAL = {"quantizer": "symmetric", "scale": "absmax", "rotation": "none", "rounding": "nearest"}


def _options(letters: str) -> tuple[str, list[str]]:
    """(label suffix, flags) of the 2-bit quantiser options named by ``letters``; every
    option is given explicitly, so the variant does not depend on the 2-bit default."""
    chosen = dict(_ORIGINAL, **dict(_OPTION_LETTERS[c] for c in letters))
    flags = [x for name, value in chosen.items() for x in (f"--loco-{name}", value)]
    label = " + ".join(_OPTION_LETTERS[c][1] for c in letters)
    return (f" ({label})" if label else ""), flags


TWO_BIT_OPTIONS = ("u", "m", "h", "s", "uh", "umh")
"""The 2-bit section's option sets with error feedback (see the module docstring)."""
TWO_BIT_NOEF_OPTIONS = ("u", "m", "h", "s", "umh")
"""... and without."""

VARIANTS = {
    "fp32": ("full precision (fp32 reduce-scatter)", ["--loco-bits", "0"]),
    "loco4": ("LoCo 4-bit", ["--loco-bits", "4"]),
    "loco2": ("LoCo 2-bit", ["--loco-bits", "2", *_options("")[1]]),
    "loco2d": ("LoCo 2-bit (default options)", ["--loco-bits", "2"]),
    "ef4": ("error feedback 4-bit (beta 0)", ["--loco-bits", "4", "--loco-beta", "0"]),
    "ef2": ("error feedback 2-bit (beta 0)", ["--loco-bits", "2", "--loco-beta", "0", *_options("")[1]]),
    "noef4": ("4-bit, no error feedback", ["--loco-bits", "4", "--no-loco-error-feedback"]),
    "noef2": ("2-bit, no error feedback", ["--loco-bits", "2", "--no-loco-error-feedback", *_options("")[1]]),
    "loco4p8": ("LoCo 4-bit + params 8-bit", ["--loco-bits", "4", "--param-gather-bits", "8"]),
    "loco4p4": ("LoCo 4-bit + params 4-bit", ["--loco-bits", "4", "--param-gather-bits", "4"]),
    # Both at 2 bits: the parameter gather shares the gradients' (default 2-bit) options.
    "loco2p2": ("LoCo 2-bit + params 2-bit", ["--loco-bits", "2", "--param-gather-bits", "2"]),
    # Megatron-FSDP as HSDP over two one-rank "nodes" (each replica shards over one rank):
    # LoCo compresses the cross-node replica reduction, as on a cluster (docs/fsdp.md).
    "fsdp": ("Megatron-FSDP (HSDP 2x1), full precision", [*_FSDP, "--loco-bits", "0"]),
    "fsdp4": ("Megatron-FSDP (HSDP 2x1) + LoCo 4-bit", [*_FSDP, "--loco-bits", "4"]),
}
for _letters in sorted(set(TWO_BIT_OPTIONS) | set(TWO_BIT_NOEF_OPTIONS), key=lambda x: (len(x), x)):
    _suffix, _flags = _options(_letters)
    VARIANTS[f"loco2-{_letters}"] = (f"LoCo 2-bit{_suffix}", ["--loco-bits", "2", *_flags])
    VARIANTS[f"noef2-{_letters}"] = (f"2-bit, no error feedback{_suffix}",
                                     ["--loco-bits", "2", "--no-loco-error-feedback", *_flags])
_NO_GAIN = "--no-diloco-outer-gain-correction"
OUTER_FORMS = {
    "": ("error feedback beta 0.8", ["--diloco-outer-beta", "0.8", _NO_GAIN]),
    "c": ("classic error feedback (beta 0)", ["--diloco-outer-beta", "0", _NO_GAIN]),
    "n": ("no error feedback", ["--no-diloco-outer-error-feedback", _NO_GAIN]),
    "g": ("gain-corrected, no error feedback", ["--no-diloco-outer-error-feedback", "--diloco-outer-gain-correction"]),
    "gc": ("gain-corrected, classic error feedback", ["--diloco-outer-beta", "0", "--diloco-outer-gain-correction"]),
}
"""DiLoCo's compressed outer exchange: variant suffix -> (label, flags). Every form is given
explicitly, so a variant does not depend on the width's default form (at 2 bits ``gc``)."""
for _h in (16, 32, 64):
    # --diloco-replicas {ranks}: one replica per rank, filled in per run (see main()).
    _base = ["--loco-bits", "0", "--diloco-replicas", "{ranks}", "--diloco-inner-steps", str(_h)]
    VARIANTS[f"dl0-h{_h}"] = (f"DiLoCo H={_h}, fp32 outer", [*_base, "--diloco-outer-bits", "0"])
    for _bits in (4, 2):
        for _form, (_label, _flags) in OUTER_FORMS.items():
            VARIANTS[f"dl{_bits}{_form}-h{_h}"] = (f"DiLoCo H={_h}, LoCo {_bits}-bit outer, {_label}",
                                                   [*_base, "--diloco-outer-bits", str(_bits), *_flags])
    # SparseLoCo (--diloco-outer-topk): top 64 of 4096 at 2 bits, its reference settings (SGD
    # at LR 1, beta 0.95); "sl" divides each entry by every replica, "slc" by those that sent it
    VARIANTS[f"sl-h{_h}"] = (f"DiLoCo H={_h}, SparseLoCo top 64/4096 2-bit outer",
                             [*_base, "--diloco-outer-topk", "64", "--diloco-outer-bits", "2",
                              "--diloco-outer-topk-mean", "all"])
    VARIANTS[f"slc-h{_h}"] = (f"DiLoCo H={_h}, SparseLoCo top 64/4096 2-bit outer, mean over choosers",
                              [*_base, "--diloco-outer-topk", "64", "--diloco-outer-bits", "2",
                               "--diloco-outer-topk-mean", "chosen"])
# Muon (--optimizer muon): data parallel, with LoCo, and as DiLoCo's inner optimizer (MuLoCo:
# every DiLoCo variant with an "m" in front); benchmarks/muon.py tunes and compares them.
VARIANTS["muon"] = ("Muon, full precision", ["--loco-bits", "0", "--optimizer", "muon"])
VARIANTS["muon-loco4"] = ("Muon, LoCo 4-bit", ["--loco-bits", "4", "--optimizer", "muon"])
for _name in [v for v in VARIANTS if v.startswith("dl")]:
    VARIANTS[f"m{_name}"] = (f"MuLoCo: {VARIANTS[_name][0]}", [*VARIANTS[_name][1], "--optimizer", "muon"])
SECTIONS = {"2bit": ["fp32", "loco2", *(f"loco2-{x}" for x in TWO_BIT_OPTIONS),
                     "noef2", *(f"noef2-{x}" for x in TWO_BIT_NOEF_OPTIONS)],
            "diloco": ["fp32", *(v for v in VARIANTS if v.startswith("dl") and not v.endswith("-h64"))]}
"""Names ``--variants`` expands (each a list of variants)."""
MAIN = [v for v in VARIANTS if v not in ("loco2d", "loco2p2", "fsdp", "fsdp4", "muon") and "-" not in v]
SMALL_MODEL = ["--micro-batch-size", "2", "--global-batch-size", "8"]
"""``--model small``: half the default's tokens per step (4 layers, hidden 128, sequence 128)."""
"""The variants run when ``--variants`` is not given (the original study)."""


def run(out: pathlib.Path, name: str, args: list[str], timeout: float, ranks: int = 2,
        reuse: bool = False) -> compare_runs.Run:
    metrics = out / "runs" / f"{name}.jsonl"
    if reuse and metrics.exists():  # a finished run of the same name: its last eval is at --train-iters
        try:
            done = compare_runs.load_run(str(metrics))
        except (SystemExit, ValueError):  # cut short mid-line: run it again
            done = None
        iters = int(args[args.index("--train-iters") + 1])
        if done and done.evals and done.evals[-1]["iteration"] == iters:
            print(f"         (reusing {metrics})", flush=True)
            return done
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(REPO / "pretrain_gpt.py"), *args, "--metrics-jsonl", str(metrics)]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    log = out / "logs" / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"error: {name} failed with exit code {proc.returncode} (log: {log})")
    return compare_runs.load_run(str(metrics))


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.4f}"
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}"


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s]
    except ValueError:
        sys.exit(f"error: {flag}: '{text}' is not a comma-separated list of integers")


def _write_outer_lr(out: pathlib.Path, finals: dict, swept: list[str], ddp: list | None, args,
                    seeds: list[int]) -> None:
    """``outer_lr.md``: per H, the LR sweep and each variant at its tuned LR against fp32
    outer at its tuned LR, paired by seed (:mod:`paired`), and the 2-bit forms against each other."""
    labels = {v: VARIANTS[v][0].split(", ", 1)[1] for v in swept}
    # (results["fp32"] holds its runs in the order of ``seeds``)
    baseline = {s: r.evals[-1]["eval/lm_loss"] for r, s in zip(ddp, seeds)} if ddp else None
    lines = [f"# Outer learning rate: {args.iters} steps, {args.ranks} replicas of one rank, final eval loss\n"]
    for h in sorted({v.rsplit("-h", 1)[1] for v in swept}, key=int):
        group = [v for v in swept if v.endswith(f"-h{h}")]
        ref = f"dl0-h{h}"
        lines += [f"## H={h}: mean over the sweep seeds at each outer LR (bold: the tuned LR)", "",
                  *paired.lr_table(finals, group, labels), ""]
        if ref in group:
            lines += [f"## H={h}: each at its tuned LR, paired by seed against fp32 outer at its tuned LR", "",
                      *paired.gap_table(finals, group, ref, labels, baseline, "data-parallel every step"), ""]
        for a, b in ((f"dl2-h{h}", f"dl2n-h{h}"), (f"dl2c-h{h}", f"dl2n-h{h}"), (f"dl2g-h{h}", f"dl2n-h{h}"),
                     (f"dl2gc-h{h}", f"dl2g-h{h}")):
            if a in group and b in group:
                lines.append(f"- {paired.pair_line(finals, a, b, labels)}")
        lines.append("")
    (out / "outer_lr.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=200, help="training steps (same token budget for all)")
    ap.add_argument("--seeds", default="1234,1235")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated variants ({', '.join(VARIANTS)}) or sections ({', '.join(SECTIONS)}); "
                         f"default: {','.join(MAIN)}")
    ap.add_argument("--data-cache-path", default=None, help="passed to pretrain_gpt.py (built-in corpus cache)")
    ap.add_argument("--ranks", type=int, default=2, help="local ranks per run (DiLoCo: one replica per rank)")
    ap.add_argument("--model", choices=("default", "small"), default="default",
                    help="pretrain_gpt.py's default model, or 'small': global batch 8 in micro batches of 2")
    ap.add_argument("--eval-interval", type=int, default=None, help="default: a quarter of --iters")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the runs already finished in --out (same names, same --iters) instead of rerunning")
    ap.add_argument("--outer-lrs", default=None,
                    help="DiLoCo variants: run each at every one of these outer LRs (comma-separated) and write "
                         "outer_lr.md: each variant at its tuned LR against fp32 outer, paired by seed")
    ap.add_argument("--variant-lrs", default="",
                    help="with --outer-lrs: another LR grid for some variants, 'VARIANT=LR,LR;VARIANT=LR,...' "
                         "(a grid cut where the sweep seeds already show the trend, to fit a CPU budget; the "
                         "table leaves the LRs a variant did not run empty)")
    ap.add_argument("--final-seeds", default="",
                    help="with --outer-lrs: after the sweep over --seeds, run these seeds too, at each DiLoCo "
                         "variant's tuned LR only (the tuned LR is chosen on --seeds alone)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, 4 steps, one seed (fp32 vs LoCo 4-bit unless --variants)")
    args = ap.parse_args()
    if args.ranks < 1:
        sys.exit(f"error: --ranks: {args.ranks} must be at least 1")
    model = ["--eval-interval", str(args.eval_interval or max(args.iters // 4, 1)), "--eval-iters", "4",
             "--log-interval", "10", *(SMALL_MODEL if args.model == "small" else [])]
    if args.smoke:
        args.iters, args.seeds = 4, "1234"
        args.variants = args.variants or "fp32,loco4"
        model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "1",
                 "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1"]
    if args.data_cache_path:
        model += ["--data-cache-path", args.data_cache_path]
    variants = [x for v in (args.variants or ",".join(MAIN)).split(",") if v for x in SECTIONS.get(v, [v])]
    for v in variants:
        if v not in VARIANTS:
            sys.exit(f"error: --variants: unknown {v!r} (choose from {', '.join(VARIANTS)})")
    seeds, final_seeds = _ints(args.seeds, "--seeds"), _ints(args.final_seeds, "--final-seeds")
    try:
        lrs = [f"{float(x):g}" for x in args.outer_lrs.split(",") if x] if args.outer_lrs else []
    except ValueError:
        sys.exit(f"error: --outer-lrs: '{args.outer_lrs}' is not a comma-separated list of numbers")
    if final_seeds and not lrs:
        sys.exit("error: --final-seeds needs --outer-lrs (they run at each variant's tuned outer LR)")
    grids = {}
    for item in filter(None, args.variant_lrs.split(";")):
        v, _, grid = item.partition("=")
        try:
            grids[v] = [f"{float(x):g}" for x in grid.split(",") if x]
        except ValueError:
            grids[v] = []
        if v not in variants or not v.startswith("dl") or not grids[v] or not lrs:
            sys.exit(f"error: --variant-lrs: '{item}' is not VARIANT=LR,LR for a DiLoCo variant of --variants "
                     f"(with --outer-lrs)")
    out = pathlib.Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)

    t0 = time.time()

    def one(v: str, seed: int, lr: str | None) -> compare_runs.Run:
        name = f"{v}-lr{lr}_seed{seed}" if lr else f"{v}_seed{seed}"
        print(f"[{time.time() - t0:6.0f}s] {name}", flush=True)
        flags = [f.format(ranks=args.ranks) for f in VARIANTS[v][1]] + (["--diloco-outer-lr", lr] if lr else [])
        return run(out, name, [*model, *flags, "--train-iters", str(args.iters), "--seed", str(seed)], args.timeout,
                   args.ranks, args.reuse)

    swept = [v for v in variants if v.startswith("dl")] if lrs else []
    results: dict[str, list[compare_runs.Run]] = {v: [] for v in variants if v not in swept}
    finals: dict[tuple[str, str], dict[int, float]] = {}
    for seed in seeds:
        for v in variants:
            for lr in (grids.get(v, lrs) if v in swept else [None]):
                r = one(v, seed, lr)
                if lr:
                    finals.setdefault((v, lr), {})[seed] = r.evals[-1]["eval/lm_loss"]
                    results.setdefault(f"{v}-lr{lr}", []).append(r)
                else:
                    results[v].append(r)
    for seed in final_seeds:
        for v in variants:
            lr = paired.tuned_lr(finals, v)[0] if v in swept else None
            r = one(v, seed, lr)
            if lr:
                finals[v, lr][seed] = r.evals[-1]["eval/lm_loss"]
                results[f"{v}-lr{lr}"].append(r)
            else:
                results[v].append(r)
    if swept:
        _write_outer_lr(out, finals, swept, results.get("fp32"), args, seeds + final_seeds)
    labels = {**{v: VARIANTS[v][0] for v in VARIANTS},
              **{f"{v}-lr{lr}": f"{VARIANTS[v][0]}, outer lr {lr}" for v, lr in finals}}
    variants = list(results)

    def evals(r):
        return [e["eval/lm_loss"] for e in r.evals]

    ref = statistics.fmean(evals(r)[-1] for r in results[variants[0]])
    lines = [f"# Loss parity: {args.iters} steps, seeds {', '.join(map(str, seeds + final_seeds))}, {args.ranks} ranks, "
             f"{results[variants[0]][0].train[-1]['train/tokens_seen']:,} tokens per run\n",
             f"| variant | final eval loss | best eval loss | gap to {variants[0]} (final) |", "|---|---|---|---|"]
    for v in variants:
        final = [evals(r)[-1] for r in results[v]]
        best = [min(evals(r)) for r in results[v]]
        gap = (statistics.fmean(final) - ref) / ref * 100
        lines.append(f"| {labels[v]} | {_spread(final)} | {_spread(best)} | {gap:+.2f}% |")
    md = "\n".join(lines) + "\n"
    (out / "quality.md").write_text(md)
    print(md)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in variants:
        runs = results[v]
        tokens = {e["iteration"]: t["train/tokens_seen"] for t in runs[0].train for e in runs[0].evals
                  if t["iteration"] == e["iteration"]}
        its = [e["iteration"] for e in runs[0].evals if e["iteration"] in tokens]
        mean = [statistics.fmean(next(e["eval/lm_loss"] for e in r.evals if e["iteration"] == it) for r in runs)
                for it in its]
        ax.plot([tokens[it] for it in its], mean, "o-", label=labels[v])
    ax.set(xlabel="tokens", ylabel=f"eval LM loss (mean of {len(seeds)} seeds)", title="Loss vs tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss_vs_tokens.png", dpi=110)
    print(out / "quality.md")
    print(out / "loss_vs_tokens.png")


if __name__ == "__main__":
    main()
