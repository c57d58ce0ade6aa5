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
    "python benchmarks/heldout_corpus.py   # the held-out corpus (apt-get install the packages it names first)",
]
"""What ran, in order (each ``sweep.py`` command adds runs to ``results/sweep`` and rewrites ``sweep.md``)."""
INTRO = (
    "The default model (`pretrain_gpt.py` without a config: 4 layers, hidden 128, global batch 16 on 2 CPU "
    "ranks, fp32 gradient sync) at the README's 200 steps, swept on the built-in corpus (the standard "
    "library's source) and checked on a held-out corpus the sweep never chose on: Debian's manuals in "
    "English (the Debian Administrator's Handbook, Debian Reference, the Developer's Reference, the New "
    "Maintainers' Guide, the Policy Manual and the Securing Debian Manual; GPL-2+ or CC-BY-SA-3.0), prose, "
    "with a sentencepiece tokenizer of its own (`benchmarks/heldout_corpus.py`: HTML -> jsonl -> "
    "`tools/train_tokenizer.py` -> `tools/preprocess_data.py`). Each "
    "group's tuned cell is its best on the built-in corpus; a default changed only where the tuned cell "
    "beats the previous default beyond the spread of the paired gap on both corpora. The last column is "
    "what the code ships now against the best cell each corpus ran (the check of the defaults: within "
    "0.5%).")


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
