"""Paired-seed comparison of DiLoCo variants, each at its own tuned outer learning rate.

Pure functions over final eval losses; ``quality.py`` feeds them its runs and writes the
tables. ``finals[(variant, lr)][seed]`` is the final eval loss of one run, where
``variant`` names everything but the outer LR (``dl2c-h32``) and ``lr`` is a string
(``"0.55"``).

* A variant's *tuned* LR is the one with the lowest mean final loss over the *sweep
  seeds* (the seeds every LR of that variant ran), so the choice never sees a seed that
  only some LRs ran.
* A gap is reported as the mean of the *paired* relative differences, seed by seed on
  the seeds both sides ran, ``100 * (loss_v(s) - loss_ref(s)) / loss_ref(s)``, with the
  standard deviation of those differences: the seed-to-seed noise of the gap itself,
  which is smaller than that of either loss (both runs of a seed share its data order
  and initialisation). A gap whose magnitude is at most that spread is a tie.
"""

from __future__ import annotations

import statistics


def lrs_of(finals: dict, variant: str) -> list[str]:
    """The outer LRs ``variant`` ran, ascending."""
    return sorted((lr for v, lr in finals if v == variant), key=float)


def tuned_lr(finals: dict, variant: str) -> tuple[str, list[int]]:
    """(the LR with the lowest mean over the sweep seeds, the sweep seeds)."""
    lrs = lrs_of(finals, variant)
    common = set.intersection(*(set(finals[variant, lr]) for lr in lrs))
    if not common:
        raise ValueError(f"{variant}: no seed ran at every outer LR ({', '.join(lrs)})")
    seeds = sorted(common)
    best = min(lrs, key=lambda lr: (statistics.fmean(finals[variant, lr][s] for s in seeds), float(lr)))
    return best, seeds


def paired(a: dict[int, float], b: dict[int, float]) -> tuple[float, float | None, int]:
    """(mean, standard deviation or None for one seed, seeds) of ``100 (a - b) / b`` over
    the seeds both ran."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("no seed in common")
    d = [100.0 * (a[s] - b[s]) / b[s] for s in seeds]
    return statistics.fmean(d), (statistics.stdev(d) if len(d) > 1 else None), len(d)


def verdict(mean: float, sd: float | None) -> str:
    """'tie (inside the spread)' when ``|mean| <= sd``; else 'beyond the spread'."""
    if sd is None:
        return "one seed: no spread"
    return "tie (inside the spread)" if abs(mean) <= sd else "beyond the spread"


def fmt_gap(mean: float, sd: float | None, n: int) -> str:
    return f"{mean:+.2f}% ± {sd:.2f} (n={n})" if sd is not None else f"{mean:+.2f}% (n=1)"


def lr_table(finals: dict, variants: list[str], labels: dict[str, str]) -> list[str]:
    """Markdown: per variant, the mean final loss over its sweep seeds at every LR, the
    tuned LR marked."""
    lrs = sorted({lr for v in variants for lr in lrs_of(finals, v)}, key=float)
    out = ["| variant | " + " | ".join(f"lr {lr}" for lr in lrs) + " | tuned lr (sweep seeds) |",
           "|---|" + "---|" * len(lrs) + "---|"]
    for v in variants:
        best, seeds = tuned_lr(finals, v)
        cells = []
        for lr in lrs:
            if (v, lr) not in finals:
                cells.append("")
                continue
            mean = statistics.fmean(finals[v, lr][s] for s in seeds)
            cells.append(f"**{mean:.4f}**" if lr == best else f"{mean:.4f}")
        out.append(f"| {labels.get(v, v)} | " + " | ".join(cells) + f" | {best} ({', '.join(map(str, seeds))}) |")
    return out


def gap_table(finals: dict, variants: list[str], reference: str, labels: dict[str, str],
              baseline: dict[int, float] | None = None, baseline_label: str = "") -> list[str]:
    """Markdown: each variant at its tuned LR against ``reference`` at its tuned LR (paired
    over every seed both ran at those LRs), with the verdict; ``baseline`` (seed -> loss,
    e.g. data-parallel every step) adds the reference's own gap to it."""
    ref_lr, _ = tuned_lr(finals, reference)
    ref = finals[reference, ref_lr]
    out = [f"| variant (tuned lr) | final eval loss (mean ± sd) | vs {labels.get(reference, reference)} "
           f"(lr {ref_lr}), paired | verdict |", "|---|---|---|---|"]
    for v in variants:
        lr, _ = tuned_lr(finals, v)
        runs = finals[v, lr]
        vals = list(runs.values())
        loss = f"{statistics.fmean(vals):.4f}" + (f" ± {statistics.stdev(vals):.4f}" if len(vals) > 1 else "")
        if v == reference:
            out.append(f"| {labels.get(v, v)} ({lr}) | {loss} | reference | |")
            continue
        mean, sd, n = paired(runs, ref)
        out.append(f"| {labels.get(v, v)} ({lr}) | {loss} | {fmt_gap(mean, sd, n)} | {verdict(mean, sd)} |")
    if baseline:
        mean, sd, n = paired(ref, baseline)
        out.append(f"| {labels.get(reference, reference)} ({ref_lr}) vs {baseline_label} | | "
                   f"{fmt_gap(mean, sd, n)} | {verdict(mean, sd)} |")
    return out


def pair_line(finals: dict, a: str, b: str, labels: dict[str, str]) -> str:
    """One sentence: ``a`` at its tuned LR against ``b`` at its tuned LR, paired."""
    la, _ = tuned_lr(finals, a)
    lb, _ = tuned_lr(finals, b)
    mean, sd, n = paired(finals[a, la], finals[b, lb])
    return (f"{labels.get(a, a)} (lr {la}) against {labels.get(b, b)} (lr {lb}): {fmt_gap(mean, sd, n)}, "
            f"{verdict(mean, sd)}")
