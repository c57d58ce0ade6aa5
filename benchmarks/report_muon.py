"""The Muon section of ``docs/benchmarks.md`` and its rows in the headline table, from the
outputs of :data:`COMMANDS` (``benchmarks/muon.py``): the paired quality study
(``RESULTS/muon/muon.md``), the step-time ratio (``RESULTS/muon/speed.md``) and the extra
scale factor's table (``RESULTS/muon_scales/scales.md``). Each part is shown when its output
exists; the figures with targets are read from the scripts' own lines.

    python benchmarks/report.py --results results --sections muon
"""

from __future__ import annotations

import pathlib
import re

import figures

HEADING = "## 12. Muon and MuLoCo: loss and step time (`muon.py`)"
HEADLINE = "| section 12: "
"""The prefix of this section's rows in the page's headline table (replaced on each update)."""
COMMANDS = [
    "nice -n 10 python benchmarks/muon.py --out results/muon --iters 512 --seeds 1234 --final-seeds 1235,1236 \\",
    "    --adamw-lrs 2e-3,4e-3,8e-3 --muon-lrs 2e-3,4e-3,8e-3 --outer-lrs 0.15,0.25,0.4,0.55,0.7",
    "nice -n 10 python benchmarks/muon.py --out results/muon --speed 3 --speed-iters 40",
    "nice -n 10 python benchmarks/muon.py --out results/muon_scales --iters 512 --seeds 1234 --scales 0.2,0.5,1 \\",
    "    --scale-lrs 1e-3,2e-3,4e-3,8e-3,1.6e-2",
    "nice -n 10 python benchmarks/muon.py --out results/muon_x02 --iters 512 --seeds 1234 --final-seeds 1235,1236 \\",
    "    --adamw-lrs 4e-3 --muon-lrs 8e-3 --muon-factor 0.2 --outer-lrs 0.15,0.25,0.4,0.55 --stages dp,diloco \\",
    "    --outer-variants dl0,mdl0   # (AdamW's runs copied from results/muon/runs: the same runs)",
    "python benchmarks/report.py --results results --sections muon",
]
X02 = ("Muon at `--muon-extra-scale-factor 0.2` and `--lr` 8e-3 (the best cell of the scale table "
       "below, one seed), data parallel and as MuLoCo's inner optimizer (fp32 outer, its outer LR tuned), against "
       "the same AdamW runs:")
"""The introduction of the second study (``RESULTS/muon_x02/muon.md``)."""
PAIRS = {  # the study's sentence prefix -> (headline figure, target)
    "Muon (": ("Muon (the default factor 0.5) vs AdamW, data parallel, each at its tuned LR: final eval loss",
               "below 0"),
    "MuLoCo (fp32 outer) (lr": ("MuLoCo (fp32 outer; Muon at the default factor 0.5) vs data-parallel AdamW",
                                "at most half of AdamW-DiLoCo's"),
    "AdamW-DiLoCo (fp32 outer) (lr": ("AdamW-DiLoCo (fp32 outer) vs data-parallel AdamW", ""),
    "MuLoCo (4-bit outer)": ("MuLoCo 4-bit outer vs MuLoCo fp32 outer", "within 0.5%"),
    "MuLoCo (2-bit outer)": ("MuLoCo 2-bit outer vs MuLoCo fp32 outer", "within 0.5%"),
    "Muon + LoCo 4-bit": ("Muon + LoCo 4-bit vs Muon full precision", "within 0.5%"),
}


def _pair_lines(md: str) -> dict[str, str]:
    """The study's paired sentences (``- A (lr x) against B (lr y): +g% ± s (n=N), verdict``) by prefix."""
    return {line[2:]: line for line in md.splitlines() if line.startswith("- ") and " against " in line}


def headlines(res: pathlib.Path) -> list[str]:
    """The headline rows: each paired gap with its target, and the step-time ratio."""
    out = []
    study = res / "muon" / "muon.md"
    if study.is_file():
        for sentence in _pair_lines(study.read_text()):
            first, _, rest = sentence.partition(" against ")
            for prefix, (figure, target) in PAIRS.items():
                wanted = "AdamW (lr" if prefix.startswith(("Muon (", "MuLoCo (fp32", "AdamW-DiLoCo")) else ""
                if first.startswith(prefix) and (not wanted or rest.startswith(wanted)):
                    gap = rest.split(": ", 1)[1]
                    out.append(figures.row("section 12: 512 steps, 3 seeds", figure, gap, target))
    x02 = res / "muon_x02" / "muon.md"
    if x02.is_file():
        for sentence in _pair_lines(x02.read_text()):
            first, _, rest = sentence.partition(" against ")
            figure = {"Muon (": ("Muon (factor 0.2, tuned with the LR) vs AdamW, data parallel", "below 0"),
                      "MuLoCo (fp32 outer) (lr": ("MuLoCo (fp32 outer; Muon factor 0.2, tuned with the LR) vs "
                                                  "data-parallel AdamW", "at most half of AdamW-DiLoCo's")}
            for prefix, (name, target) in figure.items():
                if first.startswith(prefix) and rest.startswith("AdamW (lr"):
                    out.append(figures.row("section 12: 512 steps, 3 seeds", name, rest.split(": ", 1)[1], target))
    speed = res / "muon" / "speed.md"
    if speed.is_file():
        found = re.search(r"median ratio Muon / AdamW: \*\*([\d.]+)\*\*.*?Newton-Schulz: \*\*([\d.]+%)\*\*",
                          speed.read_text(), re.S)
        if found:
            out.append(figures.row("section 12: default model, 2 CPU ranks", "Muon step / AdamW step (median of pairs); "
                                   "Newton-Schulz share of Muon's step", f"{found.group(1)}x; {found.group(2)}"))
    return out


def section(res: pathlib.Path) -> list[str]:
    """The section's lines, or [] when none of the outputs exists."""
    parts = [res / "muon" / "muon.md", res / "muon_x02" / "muon.md", res / "muon" / "speed.md",
             res / "muon_scales" / "scales.md"]
    if not any(p.is_file() for p in parts):
        return []
    lines = [HEADING, "",
             "`--optimizer muon` against AdamW on the small model (`quality.py --model small`: global batch 8 "
             "on 2 CPU ranks, 512 steps, the built-in corpus), each variant at its own tuned learning rate: "
             "the inner LR of each optimizer tuned data-parallel on seed 1234, each DiLoCo variant's outer LR "
             "tuned at its optimizer's inner LR (2 replicas of one rank, H = 32: 16 outer steps), every "
             "comparison paired by seed over seeds 1234-1236 (a gap within the spread of its paired "
             "differences is a tie). First Muon at the default `--muon-extra-scale-factor` (what `--optimizer muon` "
             "gives), its LR tuned; then Muon tuned in the LR and the factor together (the best cell of the scale "
             "table at the end), data parallel and inside DiLoCo. Then the step time of Muon against AdamW at the default model and the "
             "share of Newton-Schulz in it, on this shared CPU machine (alternating runs; ratios only), and the "
             "measurement behind `--muon-extra-scale-factor`'s default.", "",
             "```bash", *COMMANDS, "```", ""]
    for path in parts:
        if path.is_file():
            text = path.read_text().strip().splitlines()
            if path.parent.name == "muon_x02":
                lines += [X02, ""]
            lines += [re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", ln) for ln in text] + [""]
    return lines
