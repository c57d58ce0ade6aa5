"""The DiLoCo section of ``docs/benchmarks.md`` and the measured part of ``docs/diloco.md``,
from the outputs of :data:`COMMANDS`. Each part is shown when its output exists; the
summary lines compare the rows against the targets of the DiLoCo issue (bytes between replicas, step time on a slow link, loss).
"""

from __future__ import annotations

import pathlib
import re

HEADING = "## 11. DiLoCo: bytes, step time and loss (`speed.py`, `quality.py --variants diloco`)"
MARK_BEGIN = "<!-- measured: python benchmarks/report.py --results results --sections diloco -->"
MARK_END = "<!-- end measured -->"
COMMANDS = [
    "sudo python benchmarks/speed.py --out results/speed_diloco --iters 64 --topologies 2x1 \\",
    "    --links 1gbit,100mbit --variants bf16,loco4,dl0,dl4,dls4,dl2,dlnone",
    "sudo python benchmarks/speed.py --out results/speed_diloco_2x2 --iters 64 --topologies 2x2 \\",
    "    --links 100mbit --variants bf16,dl0,dl4,dls4,dlnone",
    "python benchmarks/quality.py --out results/quality_diloco_r2 --ranks 2 --iters 1024 --model small \\",
    "    --variants fp32,dl0-h32,dl4-h32,dl4n-h32,dl2-h32,dl2n-h32 --seeds 1234,1235",
    "python benchmarks/quality.py --out results/quality_diloco_r4 --ranks 4 --iters 1024 --model small \\",
    "    --variants fp32,dl0-h32,dl4-h32,dl2-h32 --seeds 1234",
    "for i in 2 3; do sudo python benchmarks/speed.py --out results/speed_diloco_rerun$i --iters 64 \\",
    "    --topologies 2x1 --links 100mbit --variants dl4,dlnone; done",
    "python benchmarks/report.py --results results --sections diloco",
]


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


def speed_lines(speed_md: str) -> list[str]:
    """Target: DiLoCo H=32 + LoCo 4-bit outer sends <= 0.01x bf16-every-step's bytes between
    the replicas; on the 100 Mbit/s link its mean step is <= 1.2x the no-exchange run's."""
    out = []
    for heading, table in _groups(speed_md):
        rows = _table(table, "DiLoCo run")
        dl4 = rows.get("DiLoCo H=32, LoCo 4-bit outer")
        if not dl4:
            continue
        wire, step = dl4[4], float(dl4[5]) if dl4[5] != "n/a" else None
        line = f"- {heading}: DiLoCo H=32 with LoCo 4-bit outer gradients sends {wire}x bf16-every-step's bytes"
        if wire != "n/a":
            line += f" between the replicas (target <= 0.01x: {'met' if float(wire) <= 0.01 else 'missed'})"
        line += f"; mean step {dl4[5]}x the same replicas' without outer exchanges"
        if "100mbit" in heading and step is not None:
            line += f" (target <= 1.2x at 100 Mbit/s: {'met' if step <= 1.2 else 'missed'})"
        for label, name in (("DiLoCo H=32, fp32 outer", "fp32 outer"),
                            ("Streaming DiLoCo H=32 F=4 tau=2, LoCo 4-bit outer", "Streaming F=4 tau=2, 4-bit"),
                            ("DiLoCo H=32, LoCo 2-bit outer", "2-bit outer")):
            row = rows.get(label)
            if row:
                line += f"; {name}: {row[4]}x the bytes, mean step {row[5]}x"
        out.append(line + ".")
    return out


def rerun_line(reruns: list[str]) -> list[str]:
    """The 4-bit DiLoCo / no-exchange step ratio of each rerun of that pair (the spread a
    loaded machine puts on one such ratio)."""
    ratios = []
    for md in reruns:
        for heading, table in _groups(md):
            row = _table(table, "DiLoCo run").get("DiLoCo H=32, LoCo 4-bit outer")
            if row:
                ratios.append((heading, row[5]))
    if not ratios:
        return []
    return [f"- {ratios[0][0]}, the same two runs again ({len(ratios)} more times): DiLoCo H=32 with LoCo 4-bit "
            f"outer gradients, mean step {', '.join(r for _, r in ratios)}x the no-exchange run's."]


def _means(md: str) -> dict[str, tuple[float, float | None]]:
    """label -> (mean final eval loss, spread or None) of a ``quality.py`` table."""
    out = {}
    for label, cells in _table(md, "variant").items():
        parts = cells[0].split("±")
        out[label] = (float(parts[0]), float(parts[1]) if len(parts) > 1 else None)
    return out


def quality_lines(md: str, replicas: int) -> list[str]:
    """Targets: 4-bit outer with error feedback within 0.5% of the fp32 outer exchange, 2-bit
    within 1%; what error feedback buys; the DiLoCo-vs-DDP gap, all as measured."""
    rows = _means(md)
    ddp = rows.get("full precision (fp32 reduce-scatter)")
    out = []
    for h in (32, 16):
        ref = rows.get(f"DiLoCo H={h}, fp32 outer")
        if not ref:
            continue

        def gap(label: str) -> str | None:
            row = rows.get(label)
            return None if not row else f"{(row[0] - ref[0]) / ref[0] * 100:+.2f}%"

        spread = f" (seed spread of the fp32 outer run ± {ref[1]:.4f})" if ref[1] is not None else ""
        line = f"- {replicas} replicas, H={h}: final eval loss against the fp32 outer exchange{spread}:"
        for bits, target in ((4, 0.5), (2, 1.0)):
            g = gap(f"DiLoCo H={h}, LoCo {bits}-bit outer")
            if g:
                line += (f" {bits}-bit with error feedback {g} (target within {target}%: "
                         f"{'met' if abs(float(g[:-1])) <= target else 'missed'})")
                n = gap(f"DiLoCo H={h}, LoCo {bits}-bit outer, no error feedback")
                line += f", without {n};" if n else ";"
        if ddp:
            line += f" fp32 outer vs data-parallel every step {(ref[0] - ddp[0]) / ddp[0] * 100:+.2f}%"
        out.append(line.rstrip(";") + ".")
    return out


def measured(res: pathlib.Path) -> list[str]:
    """The summary lines and the tables, from whichever outputs exist in ``res``."""
    speeds = [p for p in (res / "speed_diloco" / "speed.md", res / "speed_diloco_2x2" / "speed.md") if p.is_file()]
    qualities = [(res / f"quality_diloco_r{r}" / "quality.md", r) for r in (2, 4)]
    out: list[str] = []
    reruns = sorted(res.glob("speed_diloco_rerun*/speed.md"))
    for speed in speeds:
        out += speed_lines(speed.read_text())
    out += rerun_line([p.read_text() for p in reruns])
    if speeds:
        out.append("")
    for path, r in qualities:
        if path.is_file():
            out += quality_lines(path.read_text(), r)
    if out:
        out.append("")
    for speed in speeds:
        md = speed.read_text()
        out += [f"*{md.splitlines()[0].lstrip('# ')}*", ""]
        for heading, table in _groups(md):
            out += [f"#### {heading}", "", table, ""]
    for path, r in qualities:
        if path.is_file():
            out += [re.sub(r"^# (.*)$", r"*\1*", path.read_text().strip(), count=1, flags=re.M), ""]
    return out


def section(res: pathlib.Path) -> list[str]:
    """Section 11 of docs/benchmarks.md, or nothing when no DiLoCo output exists."""
    body = measured(res)
    if not body:
        return []
    return [HEADING, "",
            "Two simulated sites (`benchmarks/simcluster.py`: one replica per node, a `tc`-shaped link",
            "between them) and the loss of 1,024-step runs on the built-in corpus, one replica per rank.",
            "Bytes between the replicas are the measured wire bytes per rank per step that left a node;",
            "the step time is the mean (it carries the outer steps, which a median would hide).", "",
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
