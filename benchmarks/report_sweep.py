"""The tuned-defaults section of ``docs/benchmarks.md`` and its rows in the headline table, from
``RESULTS/sweep/sweep.md`` (the output of :data:`COMMANDS`, ``benchmarks/sweep.py``).

    python benchmarks/report.py --results results --sections sweep
"""

from __future__ import annotations

import pathlib
import re

import figures

HEADING = "## 13. Tuned defaults: the default model's learning rates (`sweep.py`)"
HEADLINE = "| section 13: "
"""The prefix of this section's rows in the page's headline table (replaced on each update)."""
COMMANDS = [
    'python benchmarks/heldout_corpus.py   # apt-get install the six packages its docstring names first',
    'S="nice -n 10 python benchmarks/sweep.py --out results/sweep --iters 200"',
    '# 1. every cell on seed 1234 of the built-in corpus (grids widened where the best cell was at an edge)',
    '$S --corpus builtin --seeds 1234 --grid adamw:lr=1e-3,2e-3,3e-3,4e-3,8e-3 \\',
    '    --grid muon:lr=1e-3:x=0.5 --grid muon:lr=2e-3,4e-3,8e-3:x=0.2,0.5 --grid muon:lr=1.6e-2:x=0.1,0.2 \\',
    '    --grid muon:lr=3.2e-2:x=0.025,0.05,0.1 --grid muon:lr=6.4e-2:x=0.025 --grid moe:lr=1e-3,2e-3,3e-3,4e-3',
    '$S --corpus builtin --seeds 1234 --grid dl-adamw:lr=1e-3,2e-3:olr=0.4,0.55,0.7 \\',
    '    --grid dl-adamw:lr=4e-3:olr=0.4,0.55,0.7,0.85 --grid dl-adamw:lr=5e-4:olr=0.55,0.85',
    '$S --corpus builtin --seeds 1234 --grid dl-muon:lr=1e-3:x=0.5:olr=0.4,0.55,0.7 \\',
    '    --grid dl-muon:lr=3.2e-2:x=0.05:olr=0.25,0.4,0.55',
    '# 2. the finalists (near the top on seed 1234, and the previous defaults) on seed 1235',
    '$S --corpus builtin --seeds 1235 --grid adamw:lr=1e-3,2e-3,3e-3,4e-3 --grid muon:lr=1e-3:x=0.5 \\',
    '    --grid muon:lr=3.2e-2:x=0.05 --grid muon:lr=6.4e-2:x=0.025 --grid moe:lr=1e-3,2e-3 \\',
    '    --grid dl-adamw:lr=1e-3:olr=0.55,0.7 --grid dl-muon:lr=1e-3:x=0.5:olr=0.55',
    '# 3. the check: previous default, tuned cell and neighbours on the held-out corpus, both seeds',
    '$S --corpus heldout --seeds 1234,1235 --grid adamw:lr=1e-3,2e-3,3e-3,4e-3 --grid muon:lr=1e-3:x=0.5 \\',
    '    --grid muon:lr=3.2e-2:x=0.05 --grid muon:lr=6.4e-2:x=0.025 --grid moe:lr=1e-3,2e-3 \\',
    '    --grid dl-adamw:lr=1e-3:olr=0.4,0.55,0.7 --grid dl-muon:lr=1e-3:x=0.5:olr=0.4,0.55,0.7',
    '# 4. 4x the steps: the data-parallel finalists on the held-out corpus',
    'nice -n 10 python benchmarks/sweep.py --out results/sweep --iters 800 --corpus heldout --seeds 1234,1235 \\',
    '    --grid adamw:lr=1e-3,3e-3 --grid muon:lr=1e-3:x=0.5 --grid muon:lr=6.4e-2:x=0.025',
]
"""What ran, in order (each ``sweep.py`` command adds runs to ``results/sweep`` and rewrites ``sweep.md``)."""
INTRO = (
    "The default model (`configs/tiny_gpt.yaml`, which `pretrain_gpt.py` reads without `--config`: 4 layers, "
    "hidden 128, global batch 16, warmup a tenth of the steps, cosine decay; 2 CPU ranks, fp32 gradient sync) "
    "at the README's 200 steps, swept on the built-in corpus (the standard library's source) and checked on a "
    "held-out corpus that chooses nothing: Debian's manuals in English (the Debian Administrator's Handbook, "
    "Debian Reference, the Developer's Reference, the New Maintainers' Guide, the Policy Manual and the "
    "Securing Debian Manual; GPL-2+ or CC-BY-SA-3.0), prose, with a sentencepiece tokenizer of its own "
    "(`benchmarks/heldout_corpus.py`: HTML -> jsonl -> `tools/train_tokenizer.py` -> "
    "`tools/preprocess_data.py`). Every cell runs seed 1234; the finalists (the previous default and the "
    "cells near the top) seed 1235 too. A group's tuned cell is, of the built-in corpus's finalists that tie "
    "its best one (a paired gap inside its spread), the one nearest the previous default; a default changes "
    "only where the tuned cell beats the previous default beyond the spread on both corpora. The last "
    "column of the headline is what the code ships now against the best cell each corpus and step count "
    "ran (the check of the defaults: within 0.5%). The groups' rules for another model size: "
    "[training.md](training.md), \"Learning rates\".")


def _rows(md: str) -> list[list[str]]:
    """The headline table's rows of ``sweep.md`` as cells."""
    part = md.split("## Headline", 1)[-1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in part.splitlines()
            if line.startswith("| ") and not line.startswith("| setting")]


def headlines(res: pathlib.Path) -> list[str]:
    """Per group and corpus/steps: the shipped default against the best cell there (target: within 0.5%)."""
    path = res / "sweep" / "sweep.md"
    if not path.is_file():
        return []
    out = []
    for setting, where, _previous, _tuned, _gap, _verdict, shipped in _rows(path.read_text()):
        found = re.match(r"(.*?): (the best cell|([-+][\d.]+% ± [\d.]+ \(n=\d+\)) against (.*?)) \(", shipped)
        if found:
            figure = (f"{setting}: the shipped default ({found.group(1)}) vs the best cell"
                      + (f" ({found.group(4)})" if found.group(4) else ""))
            out.append(figures.row(f"section 13: default model, {where} steps", figure,
                                   found.group(3) or "best cell", "within 0.5%"))
    return out


def section(res: pathlib.Path) -> list[str]:
    """The section's lines, or [] when ``RESULTS/sweep/sweep.md`` does not exist."""
    path = res / "sweep" / "sweep.md"
    if not path.is_file():
        return []
    text = path.read_text().strip().splitlines()[1:]  # (the section's heading replaces the title)
    return [HEADING, "", INTRO, "", "```bash", *COMMANDS, "python benchmarks/report.py --results results --sections sweep",
            "```", "", *[re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + 1) + " ", ln) for ln in text], ""]
