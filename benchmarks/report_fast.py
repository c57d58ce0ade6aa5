"""Section 10 of ``docs/benchmarks.md``: the fast defaults (issue 22's targets), from ``RESULTS/fast``.

    python benchmarks/report.py --results results --sections fast

Reads the outputs of the commands in :data:`COMMANDS` (each written under
``RESULTS/fast``) and puts each figure with a target next to it in a table
(:mod:`figures`). Step-time ratios are to the baseline of the compute dtype
the speed script picked on this machine (``speed.py --dtype auto``: where bf16 matmuls
are many times slower than fp32 ones, the runs train in fp32 and the baseline is
megatron's fp32 reduce-scatter, which sends twice the bytes of a bf16 one).
"""

from __future__ import annotations

import pathlib
import re
import statistics

import figures

HEADING = "## 10. Fast defaults on the fused kernels (`kernels.py --options`, `speed.py`)"

COMMANDS = [
    "for run in 1 2 3 4; do python benchmarks/kernels.py --options --sizes 16M --kernels cpu --repeats 11 "
    "> results/fast/options_$run.txt; done",
    "python benchmarks/kernels.py --param-gather > results/fast/param_gather.txt",
    "python benchmarks/shapes_check.py > results/fast/shapes.txt",
    "sudo python benchmarks/speed.py --out results/fast/speed_1x2 --iters 20 --links none --topologies 1x2 "
    "--variants fp32,loco4,loco2",
    "sudo python benchmarks/speed.py --out results/fast/speed_2x1 --iters 20 --links 1gbit --topologies 2x1 "
    "--variants fp32,loco4,loco4p4",
    "for run in a b c; do sudo python benchmarks/speed.py --out results/fast/speed_2x2_$run --iters 20 "
    "--links 1gbit --topologies 2x2 --variants fp32,loco4flat,loco4,loco4i16; done",
    "sudo python benchmarks/speed.py --out results/fast/speed_2x2_slow --iters 20 --links 300mbit,100mbit "
    "--topologies 2x2 --variants loco4flat,loco4,loco4i16",
    "for run in a b; do sudo python benchmarks/speed.py --out results/fast/speed_2x2p4_$run --iters 20 --links 1gbit "
    "--topologies 2x2 --variants loco4flatp4,loco4p4,loco4i16p4; done",
]


def _tables(md: str) -> dict[str, dict[str, list[str]]]:
    """``### heading`` -> (label -> cells) of each gradient-sync table of a ``speed.md``."""
    out: dict[str, dict[str, list[str]]] = {}
    rows: dict[str, list[str]] = {}
    for line in md.splitlines():
        if line.startswith("### "):
            rows = out.setdefault(line[4:].strip(), {})
        elif line.startswith("| ") and not line.startswith(("| gradient sync", "| run ")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) > 8:
                rows[cells[0]] = cells[1:]
    return out


def _table(md: str) -> dict[str, list[str]]:
    """The first table of :func:`_tables`."""
    return next(iter(_tables(md).values()), {})


def _step(rows: dict, label: str) -> float:
    return float(rows[label][0])


def _baseline(rows: dict) -> str:
    """The compute dtype's baseline row: bf16 reduce-scatter when it ran, else fp32."""
    return "bf16 reduce-scatter" if "bf16 reduce-scatter" in rows else "fp32 reduce-scatter"


def _option_ratios(text: str) -> list[tuple[float, float]]:
    """(compress, decompress+sum) ratios of the 2-bit default in a ``kernels.py --options`` output."""
    pattern = (r"\s+2-bit default \(uniform/mse/hadamard/nearest\)\s+compress\s+\S+ ms =\s+(\S+)x 4-bit\s+"
               r"decompress\+sum\s+\S+ ms =\s+(\S+)x 4-bit")
    return [(float(m.group(1)), float(m.group(2))) for m in re.finditer(pattern, text)]


def _runs(ratios: list[float]) -> str:
    """``1.40, 1.47x (median 1.43x)``: each run's ratio and their median."""
    return f"{', '.join(f'{r:.2f}' for r in ratios)}x (median {statistics.median(ratios):.2f}x)"


def _count(runs: int) -> str:
    return f"{runs} run{'' if runs == 1 else 's'}"


def _option_lines(texts: list[str]) -> list[str]:
    runs = [r for t in texts for r in _option_ratios(t)]
    if not runs:
        return []
    setting = f"CPU, one thread, 16M elements, {_count(len(runs))}"
    return [figures.row(setting, "2-bit default compress / 4-bit kernel's, CPU time", _runs([r[0] for r in runs]),
                        "<= 1.2x"),
            figures.row(setting, "2-bit default decompress+sum / 4-bit kernel's, CPU time",
                        _runs([r[1] for r in runs]), "<= 1.2x")]


def _speed_lines(fast: pathlib.Path) -> list[str]:
    out = []
    one = fast / "speed_1x2" / "speed.md"
    if one.is_file():
        rows = _table(one.read_text())
        if {"LoCo 4-bit", "LoCo 2-bit"} <= rows.keys():
            r = _step(rows, "LoCo 2-bit") / _step(rows, "LoCo 4-bit")
            out.append(figures.row("1x2, loopback", "2-bit default step / 4-bit step", f"{r:.2f}x", "<= 1.10x"))
    two = fast / "speed_2x1" / "speed.md"
    if two.is_file():
        rows = _table(two.read_text())
        base = _baseline(rows)
        if {"LoCo 4-bit", "LoCo 4-bit + params 4-bit", base} <= rows.keys():
            p4 = _step(rows, "LoCo 4-bit + params 4-bit") / _step(rows, base)
            l4 = _step(rows, "LoCo 4-bit") / _step(rows, base)
            out.append(figures.row("2x1 at 1 Gbit/s", f"LoCo 4-bit + params 4-bit step / {base} step", f"{p4:.2f}x",
                                   "<= 0.6x"))
            out.append(figures.row("2x1 at 1 Gbit/s", f"LoCo 4-bit step / {base} step", f"{l4:.2f}x",
                                   "above the row before"))
    flat, i16_label = "LoCo 4-bit, flat (no two-hop)", "LoCo 4-bit, two-hop, bf16 inside the node"
    out += _two_hop_line(sorted(fast.glob("speed_2x2_[a-z]/speed.md")), "", "")
    out += _two_hop_line(sorted(fast.glob("speed_2x2p4_[a-z]/speed.md")), " + params 4-bit",
                         ", all with the parameter all-gather at 4 bits")
    slow = fast / "speed_2x2_slow" / "speed.md"
    if slow.is_file():
        for heading, rows in _tables(slow.read_text()).items():
            if {flat, "LoCo 4-bit"} <= rows.keys():
                out.append(figures.row(heading, "two-hop step / flat step",
                                       f"{_step(rows, 'LoCo 4-bit') / _step(rows, flat):.2f}x"))
                if i16_label in rows:
                    out.append(figures.row(heading, "two-hop with bf16 inside the node, step / flat step",
                                           f"{_step(rows, i16_label) / _step(rows, flat):.2f}x"))
    return out


def _two_hop_line(paths: list, suffix: str, note: str) -> list[str]:
    """Two-hop (the default, and bf16 inside the node) against flat over repeated 2x2 runs
    at 1 Gbit/s: the step ratios of the variants labelled with ``suffix``."""
    flat, default = "LoCo 4-bit, flat (no two-hop)" + suffix, "LoCo 4-bit" + suffix
    i16_label = "LoCo 4-bit, two-hop, bf16 inside the node" + suffix
    pairs = []
    for path in paths:
        rows = _table(path.read_text())
        if {flat, default} <= rows.keys():
            pairs.append((_step(rows, default) / _step(rows, flat),
                          _step(rows, i16_label) / _step(rows, flat) if i16_label in rows else None))
    if not pairs:
        return []
    setting = f"2x2 at 1 Gbit/s{note}, {_count(len(pairs))}"
    out = [figures.row(setting, "two-hop (8 bits inside the node) step / flat step", _runs([p[0] for p in pairs]),
                       "<= 1x")]
    i16 = [p[1] for p in pairs if p[1] is not None]
    if i16:
        out.append(figures.row(setting, "two-hop with bf16 inside the node, step / flat step", _runs(i16), "<= 1x"))
    return out


HEADLINE = "| section 10: "
"""The prefix of this section's rows in the page's headline table (replaced on each update)."""


def headlines(res: pathlib.Path) -> list[str]:
    """The headline table's rows for this section (its figures with targets, and the GPU
    targets' state); [] when ``RESULTS/fast`` holds none of the outputs."""
    fast = res / "fast"
    if not fast.is_dir():
        return []
    texts = [p.read_text() for p in sorted(fast.glob("options*.txt"))]
    lines = [HEADLINE + line[2:] for line in _option_lines(texts) + _speed_lines(fast)]
    if lines and not (res / "gpu" / "summary.txt").is_file():
        lines.append(figures.row("section 10: GPU", "every kernel / device-copy bandwidth, 64M+ elements",
                                 "not measured (`bash benchmarks/gpu_check.sh` measures it)", ">= 0.7x"))
    return lines


def section(res: pathlib.Path) -> list[str]:
    """The section's lines, or [] when ``RESULTS/fast`` holds none of its outputs."""
    fast = res / "fast"
    if not fast.is_dir():
        return []
    names = [p.name for p in sorted(fast.glob("options*.txt"))] + ["param_gather.txt", "shapes.txt"]
    text = {name: (fast / name).read_text().strip() for name in names if (fast / name).is_file()}
    heads = _option_lines([t for n, t in text.items() if n.startswith("options")]) + _speed_lines(fast)
    if not heads and not text:
        return []
    out = [HEADING, "",
           "What the default settings cost on this machine: the 2-bit default on the fused C++ kernels",
           "against the 4-bit kernel (one thread; the cases interleaved round by round), the parameter",
           "gather's fused decode-and-apply against the torch reference and a C++ decode followed by",
           "torch's `add_`, the kernels at training shapes against the torch",
           "reference, and training steps on the simulated cluster. Step ratios are to the baseline of",
           "the compute dtype the speed script picked (see its first line in each run).",
           "", "```bash", *COMMANDS, "python benchmarks/report.py --results results --sections fast", "```", "",
           "Against the targets (on the slower links the uncompressed parameter all-gather's bytes take most of",
           "each step):", "", *figures.HEADER, *heads, ""]
    for name, body in text.items():
        out += ["```", body, "```", ""]
    for path in [fast / "speed_1x2" / "speed.md", fast / "speed_2x1" / "speed.md",
                 *sorted(fast.glob("speed_2x2_[a-z]/speed.md")), *sorted(fast.glob("speed_2x2p4_[a-z]/speed.md")),
                 fast / "speed_2x2_slow" / "speed.md"]:
        if path.is_file():
            body = re.sub(r"^# (.*)$", r"*\1*", path.read_text().strip(), count=1, flags=re.M)
            out += [f"{path.parent.name}:", "", body.replace("\n### ", "\n#### "), ""]
    return out
