"""The DiLoCo section of ``docs/benchmarks.md`` and the measured part of ``docs/diloco.md``,
from the outputs of :data:`COMMANDS`. Each part is shown when its output exists; the
targets of the DiLoCo issues are one table of figures (setting | figure | measured |
target), computed from the scripts' own tables.
"""

from __future__ import annotations

import pathlib
import re

HEADING = "## 11. DiLoCo: bytes, step time, loss and failures (`speed.py`, `crossing.py`, `quality.py`, `elastic.py`)"
MARK_BEGIN = "<!-- measured: python benchmarks/report.py --results results --sections diloco -->"
MARK_END = "<!-- end measured -->"
COMMANDS = [
    "sudo python benchmarks/speed.py --out results/speed_diloco --iters 64 --topologies 2x1 \\",
    "    --links 100mbit --variants dl0,dl4,dls4,dl2,dlnone",
    "sudo python benchmarks/speed.py --out results/speed_diloco_2x2 --iters 64 --topologies 2x2 \\",
    "    --links 100mbit --variants dl0,dl4,dlnone",
    "python benchmarks/crossing.py --out results/crossing",
    "python benchmarks/quality.py --out results/quality_outer_lr_r2 --ranks 2 --iters 1024 --model small \\",
    "    --variants fp32,dl0-h32,dl4-h32,dl2g-h32,dl2gc-h32,dl0-h16,dl4-h16,dl2gc-h16 \\",
    "    --outer-lrs 0.4,0.55,0.7,0.85,1.0 --seeds 1234 --final-seeds 1235,1236,1237 --reuse \\",
    "    --variant-lrs 'dl2g-h32=0.4,0.55,0.7;dl2gc-h32=0.4,0.55,0.7;dl0-h16=0.4,0.55,0.7;dl4-h16=0.4,0.55,0.7;dl2gc-h16=0.4,0.55,0.7'",
    "python benchmarks/elastic.py --out results/elastic",
    "python benchmarks/report.py --results results --sections diloco",
]
SPEEDS = ("speed_diloco", "speed_diloco_2x2")
OUTER_LR = "quality_outer_lr_r2/outer_lr.md"
CROSSING = "crossing/crossing.md"
ELASTIC = "elastic/elastic.md"


def _table(md: str, first_cell: str) -> dict[str, list[str]]:
    """label -> cells of the markdown table whose header row starts with ``| first_cell``."""
    rows, inside = {}, False
    for line in md.splitlines():
        if line.startswith(f"| {first_cell}"):
            inside = True
        elif inside and line.startswith("|---"):
            continue
        elif inside and line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
        elif inside:
            inside = False
    return rows


def _groups(speed_md: str) -> list[tuple[str, str]]:
    """(heading, DiLoCo table) per topology and link of a ``speed.py`` output."""
    out = []
    for part in re.split(r"^### ", speed_md, flags=re.M)[1:]:
        heading = part.splitlines()[0].strip()
        table = [ln for ln in part.splitlines() if ln.startswith("|")]
        dl = [ln for i, ln in enumerate(table) if i >= next((j for j, x in enumerate(table)
                                                            if x.startswith("| DiLoCo run")), len(table))]
        if dl:
            out.append((heading, "\n".join(dl)))
    return out


def speed_rows(speed_md: str) -> list[tuple[str, str, str, str]]:
    """Targets of the 4-bit outer exchange at H=32 on each topology: its wire bytes between
    the replicas against a bf16 ring all-reduce every step (<= 0.01x), its mean step against
    the no-exchange run's on a 100 Mbit/s link (<= 1.2x); the no-exchange run's wire bytes and
    the rendezvous store's share of them (what remains without outer exchanges)."""
    out = []
    for heading, table in _groups(speed_md):
        rows = _table(table, "DiLoCo run")
        where = heading.split(" (")[0]
        dl4 = rows.get("DiLoCo H=32, LoCo 4-bit outer")
        if dl4:
            out.append((f"{where}, DiLoCo H=32, 4-bit outer", "wire bytes between the replicas vs a bf16 ring "
                        "all-reduce every step", f"{dl4[5]}x", "<= 0.01x"))
            if "100mbit" in heading:
                out.append((f"{where} at 100 Mbit/s, DiLoCo H=32, 4-bit outer", "mean step vs no outer exchange",
                            f"{dl4[6]}x", "<= 1.2x"))
        none = rows.get("DiLoCo replicas, no outer exchange")
        if none:
            out.append((f"{where}, DiLoCo replicas without outer exchanges", "wire bytes to other nodes / rank / "
                        "step, of them the rendezvous store's", f"{none[3]}, {none[4]}", "the store's only"))
    return out


def _gap(cell: str) -> tuple[float, float | None]:
    """(mean, sd or None) of a paired gap cell ``+0.12% ± 0.30 (n=4)``."""
    m = re.match(r"([+-][\d.]+)%(?: ± ([\d.]+))?", cell)
    return float(m.group(1)), (float(m.group(2)) if m.group(2) else None)


def quality_rows(outer_lr_md: str) -> list[tuple[str, str, str, str]]:
    """Targets at each variant's tuned outer LR, paired by seed against fp32 outer at its
    tuned LR: the best 4-bit form within 0.25%, the best 2-bit form within 0.5%."""
    out = []
    for part in re.split(r"^## ", outer_lr_md, flags=re.M)[1:]:
        if "paired by seed" not in part.splitlines()[0]:
            continue
        h = part.split(":", 1)[0]
        rows = _table(part, "variant (tuned lr)")
        for bits, target in ((4, 0.25), (2, 0.5)):
            forms = {label: cells for label, cells in rows.items() if label.startswith(f"LoCo {bits}-bit")}
            if not forms:
                continue
            label, cells = min(forms.items(), key=lambda kv: _gap(kv[1][1])[0])
            out.append((f"2 replicas, {h}, best {bits}-bit form: {label}", "final eval loss vs fp32 outer, "
                        "each at its tuned LR, paired by seed (mean ± sd)", f"{cells[1]}; {cells[2]}",
                        f"within {target}%"))
    return out


def elastic_rows(elastic_md: str) -> list[tuple[str, str, str, str]]:
    """Targets of the elastic mode: the survivors lose at most one outer interval to a
    failure; a restarted replica is back (healed) within 60 s of its launch."""
    out = []
    for r, cells in _table(elastic_md, "replicas").items():
        out.append((f"elastic, {r} replica jobs, one killed", "worst time lost by a survivor / outer interval",
                    f"{cells[3]}", "<= 1"))
        out.append((f"elastic, {r} replica jobs, one restarted", "launch to healed (s)", cells[4], "< 60"))
    return out


def targets_table(res: pathlib.Path) -> list[str]:
    rows = []
    for name in SPEEDS:
        path = res / name / "speed.md"
        if path.is_file():
            rows += speed_rows(path.read_text())
    if (res / OUTER_LR).is_file():
        rows += quality_rows((res / OUTER_LR).read_text())
    if (res / ELASTIC).is_file():
        rows += elastic_rows((res / ELASTIC).read_text())
    if not rows:
        return []
    return ["| setting | figure | measured | target |", "|---|---|---|---|",
            *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)]


def measured(res: pathlib.Path) -> list[str]:
    """The targets table and the scripts' tables, from whichever outputs exist in ``res``."""
    out = targets_table(res)
    if out:
        out.append("")
    for name in SPEEDS:
        path = res / name / "speed.md"
        if not path.is_file():
            continue
        md = path.read_text()
        out += [f"*{md.splitlines()[0].lstrip('# ')}*", ""]
        for heading, table in _groups(md):
            out += [f"#### {heading}", "", table, ""]
    for rel in (CROSSING, OUTER_LR, ELASTIC):
        path = res / rel
        if path.is_file():
            text = re.sub(r"^# (.*)$", r"*\1*", path.read_text().strip(), count=1, flags=re.M)
            out += [re.sub(r"^## ", "#### ", text, flags=re.M), ""]
    return out


def section(res: pathlib.Path) -> list[str]:
    """Section 11 of docs/benchmarks.md, or nothing when no DiLoCo output exists."""
    body = measured(res)
    if not body:
        return []
    return [HEADING, "",
            "Two simulated sites (`benchmarks/simcluster.py`: one replica per node, a `tc`-shaped link",
            "between them), the collectives that cross between replicas per step, the loss of 1,024-step",
            "runs on the built-in corpus at each variant's tuned outer learning rate (one replica per",
            "rank), and elastic replica jobs killed and restarted. Bytes between the replicas are the",
            "measured wire bytes per rank per step that left a node, against a bf16 ring all-reduce of",
            "the gradients between the replicas at every step (`2 (R - 1) / R x N x 2` bytes per rank,",
            "computed by the runs; the measure of the run summary); the step time is the mean (it",
            "carries the outer steps, which a median would hide). The runs share a 2-core machine with",
            "other work: the step-time ratios and the elastic timings carry that noise; the bytes and the",
            "collective counts do not.", "",
            "```bash", *COMMANDS, "```", "",
            *body]


def update_guide(res: pathlib.Path, guide: pathlib.Path) -> None:
    """Replace the measured block of ``docs/diloco.md`` (between its markers)."""
    text = guide.read_text()
    if MARK_BEGIN not in text or MARK_END not in text:
        raise SystemExit(f"error: {guide} has no measured block ({MARK_BEGIN} ... {MARK_END})")
    head, rest = text.split(MARK_BEGIN, 1)
    tail = rest.split(MARK_END, 1)[1]
    body = [ln.replace("#### ", "### ") for ln in measured(res)]
    guide.write_text(head + MARK_BEGIN + "\n" + "\n".join(body).rstrip("\n") + "\n" + MARK_END + tail)
    print(guide)
