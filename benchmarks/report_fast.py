"""Section 10 of ``docs/benchmarks.md``: the fast defaults (issue 22), from ``RESULTS/fast``.

    python benchmarks/report.py --results results --sections fast

Reads the outputs of the commands in :data:`COMMANDS` (each written under
``RESULTS/fast``) and states every target of the issue as met or missed, with the
figures the scripts printed. Step-time ratios are to the baseline of the compute dtype
the speed script picked on this machine (``speed.py --dtype auto``: where bf16 matmuls
are many times slower than fp32 ones, the runs train in fp32 and the baseline is
megatron's fp32 reduce-scatter, which sends twice the bytes of a bf16 one).
"""

from __future__ import annotations

import pathlib
import re
import statistics

HEADING = "## 10. Fast defaults on the fused kernels (`kernels.py --options`, `speed.py`)"

COMMANDS = [
    "python benchmarks/kernels.py --options --sizes 16M --kernels cpu --repeats 11 > results/fast/options.txt",
    "python benchmarks/kernels.py --param-gather > results/fast/param_gather.txt",
    "python benchmarks/shapes_check.py > results/fast/shapes.txt",
    "sudo python benchmarks/speed.py --out results/fast/speed_1x2 --iters 20 --links none --topologies 1x2 "
    "--variants fp32,loco4,loco2",
    "sudo python benchmarks/speed.py --out results/fast/speed_2x1 --iters 20 --links 1gbit --topologies 2x1 "
    "--variants fp32,loco4,loco4p4",
    "for run in a b c; do sudo python benchmarks/speed.py --out results/fast/speed_2x2_$run --iters 20 "
    "--links 1gbit --topologies 2x2 --variants fp32,loco4flat,loco4,loco4i16; done",
]


def _table(md: str) -> dict[str, list[str]]:
    """label -> cells of the first gradient-sync table of a ``speed.md``."""
    rows = {}
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith(("| gradient sync", "| run ")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) > 8:
                rows[cells[0]] = cells[1:]
    return rows


def _step(rows: dict, label: str) -> float:
    return float(rows[label][0])


def _baseline(rows: dict) -> str:
    """The compute dtype's baseline row: bf16 reduce-scatter when it ran, else fp32."""
    return "bf16 reduce-scatter" if "bf16 reduce-scatter" in rows else "fp32 reduce-scatter"


def _verdict(value: float, target: float) -> str:
    return "met" if value <= target else f"missed by {value / target:.2f}x"


def _option_lines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        m = re.match(r"\s+2-bit default \(uniform/mse/hadamard/nearest\)\s+compress\s+\S+ ms =\s+(\S+)x 4-bit\s+"
                     r"decompress\+sum\s+\S+ ms =\s+(\S+)x 4-bit", line)
        if m:
            comp, dec = float(m.group(1)), float(m.group(2))
            out.append(f"- CPU, one thread, 16M elements: the 2-bit default compresses in {comp:.2f}x the 4-bit "
                       f"kernel's CPU time (target <= 1.2x: {_verdict(comp, 1.2)}), decompresses and sums in "
                       f"{dec:.2f}x (target <= 1.2x: {_verdict(dec, 1.2)}).")
    return out


def _speed_lines(fast: pathlib.Path) -> list[str]:
    out = []
    one = fast / "speed_1x2" / "speed.md"
    if one.is_file():
        rows = _table(one.read_text())
        if {"LoCo 4-bit", "LoCo 2-bit"} <= rows.keys():
            r = _step(rows, "LoCo 2-bit") / _step(rows, "LoCo 4-bit")
            out.append(f"- 1x2, loopback: the 2-bit default's training step is {r:.2f}x the 4-bit step "
                       f"(target <= 1.10x: {_verdict(r, 1.10)}).")
    two = fast / "speed_2x1" / "speed.md"
    if two.is_file():
        rows = _table(two.read_text())
        base = _baseline(rows)
        if {"LoCo 4-bit", "LoCo 4-bit + params 4-bit", base} <= rows.keys():
            p4 = _step(rows, "LoCo 4-bit + params 4-bit") / _step(rows, base)
            l4 = _step(rows, "LoCo 4-bit") / _step(rows, base)
            out.append(f"- 2x1 at 1 Gbit/s: LoCo 4-bit + params 4-bit step {p4:.2f}x the {base}'s (target <= 0.6x: "
                       f"{_verdict(p4, 0.6)}), LoCo 4-bit alone {l4:.2f}x (target: the first below the second: "
                       f"{'met' if p4 < l4 else 'missed'}).")
    runs = sorted(fast.glob("speed_2x2_*/speed.md"))
    pairs = []
    for path in runs:
        rows = _table(path.read_text())
        flat = "LoCo 4-bit, flat (no two-hop)"
        if {flat, "LoCo 4-bit"} <= rows.keys():
            i16 = rows.get("LoCo 4-bit, two-hop, bf16 inside the node")
            pairs.append((_step(rows, "LoCo 4-bit") / _step(rows, flat),
                          float(i16[0]) / _step(rows, flat) if i16 else None))
    if pairs:
        default = [p[0] for p in pairs]
        line = (f"- 2x2 at 1 Gbit/s, {len(pairs)} runs: two-hop (the default, 8 bits inside the node) step / flat "
                f"step {', '.join(f'{x:.2f}' for x in default)} (median {statistics.median(default):.2f}; "
                f"target <= 1: {_verdict(statistics.median(default), 1.0)})")
        i16 = [p[1] for p in pairs if p[1] is not None]
        if i16:
            line += (f"; two-hop with bf16 inside the node {', '.join(f'{x:.2f}' for x in i16)} (median "
                     f"{statistics.median(i16):.2f}: {_verdict(statistics.median(i16), 1.0)})")
        out.append(line + ".")
    return out


def section(res: pathlib.Path) -> list[str]:
    """The section's lines, or [] when ``RESULTS/fast`` holds none of its outputs."""
    fast = res / "fast"
    if not fast.is_dir():
        return []
    text = {name: (fast / name).read_text().strip() for name in ("options.txt", "param_gather.txt", "shapes.txt")
            if (fast / name).is_file()}
    heads = _option_lines(text.get("options.txt", "")) + _speed_lines(fast)
    if not heads and not text:
        return []
    out = [HEADING, "",
           "The defaults of issue 22 on this machine: the 2-bit default on the fused C++ kernels against the",
           "4-bit kernel (one thread; the cases interleaved round by round), the parameter gather's",
           "fused decode-and-apply against its former path, the kernels at training shapes against the",
           "torch reference, and training steps on the simulated cluster. Step ratios are to the",
           "baseline of the compute dtype the speed script picked (see its first line in each run).",
           "", "```bash", *COMMANDS, "python benchmarks/report.py --results results --sections fast", "```", "",
           "Against the targets:", "", *heads, ""]
    for name in ("options.txt", "param_gather.txt", "shapes.txt"):
        if name in text:
            out += ["```", text[name], "```", ""]
    for path in [fast / "speed_1x2" / "speed.md", fast / "speed_2x1" / "speed.md",
                 *sorted(fast.glob("speed_2x2_*/speed.md"))]:
        if path.is_file():
            body = re.sub(r"^# (.*)$", r"*\1*", path.read_text().strip(), count=1, flags=re.M)
            out += [f"{path.parent.name}:", "", body.replace("\n### ", "\n#### "), ""]
    return out
