"""Section 10 of ``docs/benchmarks.md``: the fast defaults (issue 22's targets), from ``RESULTS/fast``.

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


def _verdict(value: float, target: float) -> str:
    return "met" if value <= target else f"missed by {value / target:.2f}x"


def _option_ratios(text: str) -> list[tuple[float, float]]:
    """(compress, decompress+sum) ratios of the 2-bit default in a ``kernels.py --options`` output."""
    pattern = (r"\s+2-bit default \(uniform/mse/hadamard/nearest\)\s+compress\s+\S+ ms =\s+(\S+)x 4-bit\s+"
               r"decompress\+sum\s+\S+ ms =\s+(\S+)x 4-bit")
    return [(float(m.group(1)), float(m.group(2))) for m in re.finditer(pattern, text)]


def _option_lines(texts: list[str]) -> list[str]:
    runs = [r for t in texts for r in _option_ratios(t)]
    if not runs:
        return []
    comp, dec = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    return [f"- CPU, one thread, 16M elements, {len(runs)} runs: the 2-bit default compresses in "
            f"{', '.join(f'{r[0]:.2f}' for r in runs)}x the 4-bit kernel's CPU time (median {comp:.2f}x; target "
            f"<= 1.2x: {_verdict(comp, 1.2)}), decompresses and sums in {', '.join(f'{r[1]:.2f}' for r in runs)}x "
            f"(median {dec:.2f}x; target <= 1.2x: {_verdict(dec, 1.2)})."]


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
    flat, i16_label = "LoCo 4-bit, flat (no two-hop)", "LoCo 4-bit, two-hop, bf16 inside the node"
    out += _two_hop_line(sorted(fast.glob("speed_2x2_[a-z]/speed.md")), "", "")
    out += _two_hop_line(sorted(fast.glob("speed_2x2p4_[a-z]/speed.md")), " + params 4-bit",
                         ", all with the parameter all-gather at 4 bits")
    slow = fast / "speed_2x2_slow" / "speed.md"
    if slow.is_file():
        for heading, rows in _tables(slow.read_text()).items():
            if {flat, "LoCo 4-bit"} <= rows.keys():
                parts = [f"two-hop {_step(rows, 'LoCo 4-bit') / _step(rows, flat):.2f}x flat's step"]
                if i16_label in rows:
                    parts.append(f"with bf16 inside the node {_step(rows, i16_label) / _step(rows, flat):.2f}x")
                out.append(f"- {heading}, a slower link (the uncompressed parameter all-gather's bytes take most of "
                           f"these steps): {', '.join(parts)}.")
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
    ratios = [p[0] for p in pairs]
    line = (f"- 2x2 at 1 Gbit/s{note}, {len(pairs)} runs: two-hop (the default, 8 bits inside the node) step / "
            f"flat step {', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}; target "
            f"<= 1: {_verdict(statistics.median(ratios), 1.0)})")
    i16 = [p[1] for p in pairs if p[1] is not None]
    if i16:
        line += (f"; two-hop with bf16 inside the node {', '.join(f'{x:.2f}' for x in i16)} (median "
                 f"{statistics.median(i16):.2f}: {_verdict(statistics.median(i16), 1.0)})")
    return [line + "."]


HEADLINE = "- Fast defaults (section 10): "
"""The prefix of this section's lines in the page's headline list (replaced on each update)."""


def headlines(res: pathlib.Path) -> list[str]:
    """The headline list's lines for this section: each target's verdict, one line each,
    and the GPU targets' state; [] when ``RESULTS/fast`` holds none of the outputs."""
    fast = res / "fast"
    if not fast.is_dir():
        return []
    texts = [p.read_text() for p in sorted(fast.glob("options*.txt"))]
    lines = [HEADLINE + line[2:] for line in _option_lines(texts) + _speed_lines(fast)]
    if lines and not (res / "gpu" / "summary.txt").is_file():
        lines.append(HEADLINE + "GPU (every kernel >= 0.7x of device-copy bandwidth at 64M+ elements): not "
                     "measured (section 9's GPU check ran other versions of these kernels; "
                     "`bash benchmarks/gpu_check.sh` measures them on a GPU).")
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
           "torch's `add_` (the `old C++` column), the kernels at training shapes against the torch",
           "reference, and training steps on the simulated cluster. Step ratios are to the baseline of",
           "the compute dtype the speed script picked (see its first line in each run).",
           "", "```bash", *COMMANDS, "python benchmarks/report.py --results results --sections fast", "```", "",
           "Against the targets:", "", *heads, ""]
    for name, body in text.items():
        out += ["```", body, "```", ""]
    for path in [fast / "speed_1x2" / "speed.md", fast / "speed_2x1" / "speed.md",
                 *sorted(fast.glob("speed_2x2_[a-z]/speed.md")), *sorted(fast.glob("speed_2x2p4_[a-z]/speed.md")),
                 fast / "speed_2x2_slow" / "speed.md"]:
        if path.is_file():
            body = re.sub(r"^# (.*)$", r"*\1*", path.read_text().strip(), count=1, flags=re.M)
            out += [f"{path.parent.name}:", "", body.replace("\n### ", "\n#### "), ""]
    return out
