#!/usr/bin/env python3
"""Tuned defaults: the default model's learning rates swept on one corpus and checked on another.

Every run trains ``pretrain_gpt.py``'s default model (``configs/tiny_gpt.yaml``, which it reads
without ``--config``: 4 layers, hidden 128, global batch 16, warmup a tenth of the steps, cosine
decay) on 2 ranks with fp32 gradient sync for ``--iters`` steps, or for the ``moe`` group
``configs/tiny_moe.yaml``. A *group* is one setting whose defaults the sweep tunes; a *cell* is
one point of its grid, named by its knobs (``lr`` = ``--lr``, ``x`` =
``--muon-extra-scale-factor``, ``olr`` = ``--diloco-outer-lr``), every knob of the group given
explicitly so that a run never depends on the defaults it is tuning:

    adamw      AdamW, data parallel                                     knobs lr
    muon       Muon (--optimizer muon), data parallel                   knobs lr, x
    dl-adamw   AdamW-DiLoCo: 2 replicas of one rank, H = --inner-steps,  knobs lr, olr
               fp32 outer gradients
    dl-muon    MuLoCo: the same with Muon inside                        knobs lr, x, olr
    moe        configs/tiny_moe.yaml (AdamW), data parallel             knobs lr

``--corpus builtin`` trains on the built-in corpus (the standard library's source), on which the
sweep tunes, at the README's 200 steps: every cell on a first seed, the *finalists* on more
(:func:`best_cell`); a group's *tuned* cell is, of the finalists that tie the best one, the one
nearest the previous default (:func:`tuned_cell`). ``--corpus heldout`` trains on the corpus of
``benchmarks/heldout_corpus.py`` (Debian's manuals, prose, its own tokenizer), which never
chooses a setting: it checks. Runs of one seed share initial weights and data order, so every
comparison is paired by seed (:mod:`paired`: mean ± sd of ``100 (a - b) / b``; a gap whose
magnitude is at most its spread is a tie).

``sweep.md`` (in ``--out``, rewritten after every invocation from every finished run there,
``--report-only`` without running) holds the headline and one table per corpus, steps and group:

* per group and corpus/steps: the previous default (the values before this study) against the
  tuned cell, paired, with the verdict; a default changes only where the tuned cell wins beyond
  the spread on both corpora at 200 steps (``adopt``), else it stays (``keep``);
* the *shipped* default (what the code gives now, read from ``loco_megatron.config``) against
  the best cell of each corpus/steps: within 0.5% or not.

    nice -n 10 python benchmarks/sweep.py --out results/sweep --corpus builtin --iters 200 --seeds 1234,1235 \\
        --grid adamw:lr=1e-3,2e-3,4e-3,8e-3 --grid muon:lr=2e-3,4e-3,8e-3:x=0.2,0.5 --grid muon:lr=1e-3:x=0.5
    python benchmarks/sweep.py --out results/sweep --report-only
    python benchmarks/sweep.py --smoke --out /tmp/sweep    # seconds-scale check of the plumbing
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import outer_lr  # noqa: E402  (benchmarks/: _finished)
import paired  # noqa: E402  (benchmarks/)
import quality  # noqa: E402  (benchmarks/)

KNOBS = {"lr": ("--lr", "lr"), "x": ("--muon-extra-scale-factor", "factor"), "olr": ("--diloco-outer-lr", "outer lr")}
"""knob -> (the flag it sets, its label in the tables); a cell's name lists its knobs in this order."""
TUNE_CORPUS = "builtin"
"""The corpus whose best cell (at ``--tune-iters`` steps, the README's 200) is the tuned one."""
WITHIN = 0.5
"""A shipped default is good when its paired gap to the best cell is at most this (%)."""


@dataclasses.dataclass(frozen=True)
class Group:
    label: str
    flags: tuple[str, ...]
    knobs: tuple[str, ...]

    def previous(self, h: int) -> str:
        """The cell of the defaults before this study: --lr 1e-3 (every config), factor 0.5, outer LR 0.4
        at H <= 16 and 0.55 above, for both inner optimizers."""
        values = {"lr": "0.001", "x": "0.5", "olr": "0.4" if h <= 16 else "0.55"}
        return cell_name({k: values[k] for k in self.knobs})


_DILOCO = ("--loco-bits", "0", "--diloco-replicas", "2", "--diloco-inner-steps", "{h}", "--diloco-outer-bits", "0")
GROUPS = {
    "adamw": Group("AdamW, data parallel", ("--loco-bits", "0"), ("lr",)),
    "muon": Group("Muon, data parallel", ("--loco-bits", "0", "--optimizer", "muon"), ("lr", "x")),
    "dl-adamw": Group("AdamW-DiLoCo (H={h}, fp32 outer, 2 replicas)", _DILOCO, ("lr", "olr")),
    "dl-muon": Group("MuLoCo (H={h}, fp32 outer, 2 replicas)", (*_DILOCO, "--optimizer", "muon"), ("lr", "x", "olr")),
    "moe": Group("configs/tiny_moe.yaml (AdamW), data parallel", ("--config", "configs/tiny_moe.yaml", "--loco-bits", "0"),
                 ("lr",)),
}
CORPORA = {"builtin": "built-in corpus (tuning)", "heldout": "held-out corpus (check)"}


def cell_name(values: dict[str, str]) -> str:
    """``{"lr": "0.004", "x": "0.2"}`` -> ``lr0.004-x0.2`` (knobs in :data:`KNOBS` order)."""
    return "-".join(f"{k}{values[k]}" for k in KNOBS if k in values)


def cell_values(name: str) -> dict[str, str]:
    """The inverse of :func:`cell_name`."""
    out = {}
    for part in name.split("-"):
        knob = next(k for k in sorted(KNOBS, key=len, reverse=True) if part.startswith(k))
        out[knob] = part[len(knob):]
    return out


def cell_label(name: str) -> str:
    return ", ".join(f"{KNOBS[k][1]} {v}" for k, v in cell_values(name).items())


def parse_grid(spec: str) -> tuple[str, list[str]]:
    """``GROUP:KNOB=V,V[:KNOB=V,V...]`` -> (group, its cells: the product of the knobs' values)."""
    group, *parts = spec.split(":")
    if group not in GROUPS:
        sys.exit(f"error: --grid: unknown group {group!r} in '{spec}' (choose from {', '.join(GROUPS)})")
    values = {}
    for part in parts:
        knob, _, text = part.partition("=")
        try:
            values[knob] = [f"{float(v):g}" for v in text.split(",") if v]
        except ValueError:
            values[knob] = []
        if knob not in KNOBS or not values[knob]:
            sys.exit(f"error: --grid: '{part}' in '{spec}' is not KNOB=NUMBER,NUMBER with KNOB one of {', '.join(KNOBS)}")
    if set(values) != set(GROUPS[group].knobs):
        sys.exit(f"error: --grid: '{spec}' must give exactly the knobs of {group}: {', '.join(GROUPS[group].knobs)}")
    knobs = [k for k in KNOBS if k in values]
    return group, [cell_name(dict(zip(knobs, combo))) for combo in itertools.product(*(values[k] for k in knobs))]


def shipped(group: str, h: int) -> str:
    """The cell the program's defaults give the group now: its flags without the knobs, resolved
    as pretrain_gpt.py resolves them (the --config file, then the defaults)."""
    from loco_megatron.cli import parse_config

    config = parse_config([f.format(h=h) for f in GROUPS[group].flags], note=lambda line: None)
    values = {"lr": config.optimizer.lr, "x": config.optimizer.muon_extra_scale_factor,
              "olr": config.diloco.diloco_outer_lr}
    return cell_name({k: f"{values[k]:g}" for k in GROUPS[group].knobs})


def load(out: pathlib.Path) -> dict[tuple[str, str, str], dict[int, float]]:
    """Every finished run under ``out``: ``finals[(folder, group, cell)][seed]`` = final eval loss.
    A folder is ``CORPUS-ITERS``; a run ``GROUP-CELL_seedS.jsonl`` that reached ITERS."""
    finals: dict = {}
    for path in sorted(out.glob("*-*/runs/*_seed*.jsonl")):
        folder = path.parent.parent.name
        stem, _, seed = path.stem.rpartition("_seed")
        group, _, cell = stem.partition("-lr")
        final = outer_lr._finished(path, int(folder.rsplit("-", 1)[1]))
        if group in GROUPS and final is not None:
            finals.setdefault((folder, group, "lr" + cell), {})[int(seed)] = final
    return finals


def best_cell(finals: dict, folder: str, group: str) -> tuple[str, list[int]] | None:
    """(the best cell of the group there, the seeds it was chosen on). A grid runs in two stages: every
    cell on the first seed, then the *finalists* (the cells the first seed put near the top, and the
    previous default) on more; the best cell is the finalist with the lowest mean over the seeds every
    finalist ran (with one stage: every cell is a finalist)."""
    cells = {c: s for (f, g, c), s in finals.items() if f == folder and g == group}
    if not cells:
        return None
    most = max(len(s) for s in cells.values())
    finalists = {c: s for c, s in cells.items() if len(s) == most}
    seeds = sorted(set.intersection(*(set(s) for s in finalists.values())))
    if not seeds:
        return None
    return min(finalists, key=lambda c: (statistics.fmean(finalists[c][s] for s in seeds), c)), seeds


def tuned_cell(finals: dict, folder: str, group: str, h: int) -> str | None:
    """The tuned cell: of the finalists that tie the best one (their paired gap to it inside its
    spread, :func:`paired.verdict`), the one nearest the previous default (the smallest sum of
    |log ratio| over the knobs); the best cell itself where nothing ties it. The brief's rule
    for a tie (keep the value nearest the current one) and the one-standard-error rule of model
    selection: a move the seeds cannot tell from the best buys nothing for its risk."""
    found = best_cell(finals, folder, group)
    if found is None:
        return None
    best, seeds = found
    previous = cell_values(GROUPS[group].previous(h))

    def distance(cell: str) -> float:
        return sum(abs(math.log(float(v) / float(previous[k]))) for k, v in cell_values(cell).items())

    ties = [best]
    for (f, g, c), runs in finals.items():
        if f == folder and g == group and c != best and set(seeds) <= set(runs):
            mean, sd, _ = paired.paired({s: runs[s] for s in seeds}, finals[folder, group, best])
            if sd is not None and abs(mean) <= sd:
                ties.append(c)
    return min(ties, key=lambda c: (distance(c), c))


def group_table(finals: dict, folder: str, group: str, h: int) -> list[str]:
    """One folder's grid of one group: every cell's final loss and its paired gap to the best cell."""
    found = best_cell(finals, folder, group)
    if found is None:
        return []
    best, seeds = found
    cells = sorted((c for f, g, c in finals if f == folder and g == group),
                   key=lambda c: [float(v) for v in cell_values(c).values()])
    marks = [(best, "best"), (tuned_cell(finals, folder, group, h), "nearest tie" if folder.startswith(TUNE_CORPUS)
                                 else ""),
             (GROUPS[group].previous(h), "previous default"), (shipped(group, h), "shipped default")]
    lines = ["| cell | final eval loss (mean ± sd) | seeds | vs the best cell, paired | |", "|---|---|---|---|---|"]
    for c in cells:
        runs = finals[folder, group, c]
        vals = list(runs.values())
        loss = f"{statistics.fmean(vals):.4f}" + (f" ± {statistics.stdev(vals):.4f}" if len(vals) > 1 else "")
        gap = "" if c == best else paired.fmt_gap(*paired.paired(runs, finals[folder, group, best]))
        tags = ", ".join(t for k, t in marks if k == c and t and not (t == "nearest tie" and c == best))
        lines.append(f"| {cell_label(c)} | {'**' + loss + '**' if c == best else loss} | {len(vals)} | {gap} | {tags} |")
    finalists = sum(len(finals[folder, group, c]) == len(seeds) for c in cells)
    how = ("every cell ran them" if finalists == len(cells) else
           f"the {finalists} finalists of the {len(cells)} cells ran them; the others ran the first seed only")
    return [f"Best cell on seeds {', '.join(map(str, seeds))} ({how}).", "", *lines, ""]


def verdict(finals: dict, group: str, h: int, tune_iters: int = 200) -> tuple[str, str, dict[str, tuple]]:
    """(tuned cell, decision line, per folder: the tuned cell against the previous default as
    (mean, sd, n) or None). ``adopt`` only where the tuned cell wins beyond the spread on both corpora
    at the tuning steps."""
    tuned = tuned_cell(finals, f"{TUNE_CORPUS}-{tune_iters}", group, h)
    if tuned is None:
        return "", "", {}
    previous = GROUPS[group].previous(h)
    gaps = {}
    for folder in sorted({f for f, g, c in finals if g == group}):
        a, b = finals.get((folder, group, tuned)), finals.get((folder, group, previous))
        gaps[folder] = paired.paired(a, b) if a and b and set(a) & set(b) else None
    checks = [gaps.get(f"{corpus}-{tune_iters}") for corpus in CORPORA]
    if tuned == previous:
        return tuned, f"keep {cell_label(previous)}: it is the tuned cell", gaps
    wins = [g is not None and g[1] is not None and g[0] < 0 and abs(g[0]) > g[1] for g in checks]
    if all(wins):
        return tuned, f"adopt {cell_label(tuned)}: it wins beyond the spread on both corpora", gaps
    why = ", ".join(f"{c}: {'not run' if g is None else paired.verdict(*g[:2])}" for c, g in zip(CORPORA, checks))
    return tuned, f"keep {cell_label(previous)} ({why})", gaps


def report(finals: dict, h: int, tune_iters: int = 200) -> list[str]:
    """``sweep.md``'s lines (see the module docstring)."""
    folders = sorted({f for f, _, _ in finals}, key=lambda f: (int(f.rsplit("-", 1)[1]), f.split("-")[0] != TUNE_CORPUS))
    lines = ["# Tuned defaults: the default model swept on the built-in corpus, checked on a held-out corpus", "",
             "## Headline: previous default vs tuned, paired by seed", "",
             f"| setting | corpus, steps | previous default | tuned (built-in, {tune_iters} steps) | tuned vs previous | verdict | "
             "shipped default vs the best cell there |", "|---|---|---|---|---|---|---|"]
    decisions = []
    for group, spec in GROUPS.items():
        tuned, decision, gaps = verdict(finals, group, h, tune_iters)
        if not tuned:
            continue
        decisions.append(f"- {spec.label.format(h=h)}: {decision}")
        ship = shipped(group, h)
        for folder in folders:
            if folder not in gaps:
                continue
            corpus, iters = folder.rsplit("-", 1)
            gap = gaps[folder]
            best = best_cell(finals, folder, group)
            ship_gap = ""
            if best and (folder, group, ship) in finals and not set(best[1]) <= set(finals[folder, group, ship]):
                ship_gap = f"{cell_label(ship)}: not a finalist here (it ran fewer seeds)"
            elif best and (folder, group, ship) in finals:
                m, sd, n = (0.0, 0.0, len(best[1])) if ship == best[0] else paired.paired(
                    finals[folder, group, ship], finals[folder, group, best[0]])
                ship_gap = (f"{cell_label(ship)}: " + ("the best cell" if ship == best[0] else
                            f"{paired.fmt_gap(m, sd, n)} against {cell_label(best[0])}") +
                            f" ({'within' if m <= WITHIN else 'over'} {WITHIN}%)")
            elif best:
                ship_gap = f"{cell_label(ship)}: not run here"
            lines.append(f"| {spec.label.format(h=h)} | {CORPORA[corpus]}, {iters} | {cell_label(spec.previous(h))} | "
                         f"{cell_label(tuned)} | {paired.fmt_gap(*gap) if gap else 'not run'} | "
                         f"{paired.verdict(*gap[:2]) if gap else ''} | {ship_gap} |")
    lines += ["", "## Decisions (a default changes only where the tuned cell wins beyond the spread on both corpora at "
              f"{tune_iters} steps)", "", *decisions, ""]
    for folder in folders:
        corpus, iters = folder.rsplit("-", 1)
        for group, spec in GROUPS.items():
            table = group_table(finals, folder, group, h)
            if table:
                lines += [f"## {spec.label.format(h=h)}: {CORPORA[corpus]}, {iters} steps", "", *table]
    return lines


def _data_flags(corpus: str, args) -> list[str]:
    """pretrain_gpt.py's data flags for ``corpus``; the held-out corpus must have been built."""
    if corpus == "builtin":
        return ["--data-cache-path", args.data_cache_path] if args.data_cache_path else []
    folder = pathlib.Path(args.heldout or pathlib.Path.home() / ".cache" / "loco_megatron" / "debian-docs-v4096")
    prefix, tokenizer = folder / "corpus_text_document", folder / "tokenizer.model"
    if not (pathlib.Path(f"{prefix}.idx").is_file() and tokenizer.is_file()):
        sys.exit(f"error: --heldout: no corpus in {folder} (python benchmarks/heldout_corpus.py --out {folder})")
    return ["--data-path", str(prefix), "--tokenizer-model", str(tokenizer)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--corpus", default="builtin", help="builtin, heldout or both (comma-separated): where to run")
    ap.add_argument("--heldout", default=None,
                    help="the held-out corpus's folder (benchmarks/heldout_corpus.py --out; default its default)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--tune-iters", type=int, default=200, help="the steps at which the tuned cell is chosen")
    ap.add_argument("--seeds", default="1234,1235")
    ap.add_argument("--grid", action="append", default=[],
                    help="GROUP:KNOB=V,V[:KNOB=V,V]: run the product of the values (repeat to add cells)")
    ap.add_argument("--inner-steps", type=int, default=32, help="H of the DiLoCo groups")
    ap.add_argument("--data-cache-path", default=None, help="passed to pretrain_gpt.py (built-in corpus cache)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--report-only", action="store_true", help="no runs: sweep.md from the finished runs in --out")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, 4 steps, H=2, both corpora (without --heldout the built-in corpus's files stand "
                         "in for the held-out one), two seeds, three cells (AdamW at the previous and the shipped "
                         "--lr, one MuLoCo cell): the plumbing")
    args = ap.parse_args()
    model = ["--eval-interval", str(max(args.iters // 4, 1))]
    if args.smoke:
        args.iters = args.tune_iters = 4
        args.inner_steps, args.corpus, args.seeds = 2, "builtin,heldout", "1234,1235"
        model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "1",
                 "--eval-interval", "4", "--eval-iters", "1", "--log-interval", "2"]
        ship = cell_values(shipped("adamw", args.inner_steps))["lr"]  # (the previous default and the shipped one)
        args.grid = args.grid or [f"adamw:lr=1e-3,{ship}", "dl-muon:lr=2e-3:x=0.2:olr=0.7"]
        if args.heldout is None:
            from loco_megatron.data.corpus import ensure_default_corpus

            cache = args.data_cache_path or str(pathlib.Path.home() / ".cache" / "loco_megatron")
            args.heldout = str(pathlib.Path(ensure_default_corpus(cache, 4096)[0]).parent)
    corpora = [c for c in args.corpus.split(",") if c]
    if not corpora or set(corpora) - set(CORPORA):
        sys.exit(f"error: --corpus: '{args.corpus}' is not a comma-separated list of {', '.join(CORPORA)}")
    h = args.inner_steps
    seeds = outer_lr._ints(args.seeds, "--seeds")
    plan = [parse_grid(spec) for spec in args.grid]
    data = {corpus: _data_flags(corpus, args) for corpus in corpora} if plan and not args.report_only else {}
    out = pathlib.Path(args.out)
    t0 = time.time()
    for corpus in data:
        runs = out / f"{corpus}-{args.iters}"
        for sub in ("runs", "logs"):
            (runs / sub).mkdir(parents=True, exist_ok=True)
        for seed in seeds:  # seeds outermost: one seed covers every cell first
            for group, cells in plan:
                for cell in cells:
                    name = f"{group}-{cell}_seed{seed}"
                    print(f"[{time.time() - t0:6.0f}s] {runs.name}/{name}", flush=True)
                    flags = [f.format(h=h) for f in GROUPS[group].flags]
                    flags += [x for k, v in cell_values(cell).items() for x in (KNOBS[k][0], v)]
                    quality.run(runs, name, [*flags, *model, *data[corpus], "--train-iters", str(args.iters), "--seed",
                                             str(seed)], args.timeout, 2, reuse=True)
    lines = report(load(out), h, args.tune_iters)
    (out / "sweep.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(out / "sweep.md")


if __name__ == "__main__":
    main()
