#!/usr/bin/env python3
"""Assemble ``docs/benchmarks.md`` from the benchmark scripts' outputs, so that every
number in it is one a script printed (none is typed in).

    python benchmarks/report.py --results results --out docs/benchmarks.md

Reads ``RESULTS/speed`` (``benchmarks/speed.py --out``), ``RESULTS/quality``
(``benchmarks/quality.py --out``) and ``RESULTS/kernels.txt`` (the output of
``benchmarks/kernels.py``), copies the plots next to the markdown, and computes the
headline figures next to the project's targets (:mod:`figures`). The 2-bit section comes
from ``RESULTS/quality2bit`` (``quality.py --variants 2bit``) and
``RESULTS/quality2bit_long`` and ``RESULTS/quality2bit_descent`` (``--iters 400``) when present;

    python benchmarks/report.py --results results --sections 2bit

rewrites only that section of an existing page (``--sections checkpoint``: the
checkpoint section, from ``RESULTS/checkpoint.txt``; ``--sections checkpoint_memory``:
from ``RESULTS/checkpoint_memory.txt``; ``--sections gpu``: the GPU check, from
``RESULTS/gpu/``, the files ``OUT=RESULTS/gpu bash benchmarks/gpu_check.sh`` writes;
``--sections muon``: Muon's section, from ``RESULTS/muon/`` and ``RESULTS/muon_scales/``;
``--sections sweep``: the tuned defaults, from ``RESULTS/sweep/sweep.md``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import re
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import figures  # noqa: E402
import report_diloco  # noqa: E402
import report_fast  # noqa: E402
import report_muon  # noqa: E402
import report_sweep  # noqa: E402


def _machine() -> str:
    import torch

    cpu = "unknown CPU"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {gpu}; Linux {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def _rows(md: str, heading: str) -> dict[str, list[str]]:
    """Rows (label -> cells) of the table under ``### heading`` in a markdown string."""
    part = md.split(f"### {heading}", 1)
    if len(part) < 2:
        return {}
    out = {}
    for line in part[1].split("\n### ", 1)[0].splitlines():
        if line.startswith("| ") and not line.startswith("| gradient sync"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


def _wire(speed_dir: pathlib.Path) -> str:
    path = speed_dir / "wire_bytes.json"
    if not path.exists():
        return ""
    data = json.loads(path.read_text())
    lines = ["| run | inter-node wire bytes / rank / step (measured on eth0) |", "|---|---|"]
    lines += [f"| {k} | {v:,.0f} |" for k, v in data.items()]
    return "\n".join(lines) + "\n"


def headline_speed(md: str) -> list[str]:
    """Table rows (:mod:`figures`) of the speed tables' figures that have targets: LoCo 4-bit
    step / bf16 step (target <= 1.15x on an unshaped link, <= 0.7x at 1 Gbit/s), gradient +
    parameter bytes of LoCo 4-bit + 4-bit parameters / bf16's (<= 0.3x) and its step (<= 0.6x
    at 1 Gbit/s), two-hop step / flat step on 2x2 (<= 1x); and beside them the figures that
    explain them (bf16's exposed sync, the compress and decompress time per step where the
    step ratio is above its target, the bytes to other nodes)."""
    out = []
    for heading in re.findall(r"^### (.+)$", md, flags=re.M):
        rows = _rows(md, heading)
        loco, bf16 = rows.get("LoCo 4-bit"), rows.get("bf16 reduce-scatter")
        if not (loco and bf16):
            continue
        # columns: step, tokens/s, comm total, exposed, compress/decompress, grad bytes,
        # grad bytes to other nodes, param bytes, step ratio, comm ratio, speedup
        step_ratio, comm_ratio = float(loco[8]), float(loco[9])
        exposed_share = float(bf16[3]) / (float(bf16[0]) * 1e3)
        fast = "unshaped" in heading
        comp, decomp = (float(x) for x in loco[4].split("/"))
        target = 1.15 if fast else 0.7
        if not fast:
            out.append(figures.row(heading, "bf16 reduce-scatter: exposed gradient sync / its step",
                                   f"{exposed_share:.0%}"))
        out.append(figures.row(heading, "LoCo 4-bit step / bf16 step", f"{step_ratio:.2f}x", f"<= {target}x"))
        if not fast:
            out.append(figures.row(heading, "LoCo 4-bit gradient-sync time / bf16's", f"{comm_ratio:.2f}x"))
        if step_ratio > target:
            out.append(figures.row(heading, "LoCo 4-bit compress (on the backward pass) / decompress per step; "
                                   "bf16 step", f"{comp:.0f} / {decomp:.0f} ms; {float(bf16[0]) * 1e3:.0f} ms"))
        p4 = rows.get("LoCo 4-bit + params 4-bit")
        if p4:
            nbytes = lambda row: float(row[5].replace(",", "")) + float(row[7].replace(",", ""))  # noqa: E731
            out.append(figures.row(heading, "LoCo 4-bit + params 4-bit: gradient + parameter bytes / bf16's",
                                   f"{nbytes(p4) / nbytes(bf16):.3f}x", "<= 0.3x"))
            out.append(figures.row(heading, "LoCo 4-bit + params 4-bit: step / bf16 step", f"{float(p4[8]):.2f}x",
                                   "" if fast else "<= 0.6x"))
        two_hop = rows.get("LoCo 4-bit, flat (no two-hop)")
        if two_hop:
            inter = lambda row: float(row[6].replace(",", ""))  # noqa: E731
            flat_step = float(two_hop[8])
            out.append(figures.row(heading, "gradient bytes per rank per step to other nodes: two-hop LoCo 4-bit, "
                                   "flat LoCo 4-bit, bf16 reduce-scatter",
                                   f"{inter(loco):,.0f} ({inter(loco) / inter(bf16):.3f}x), {inter(two_hop):,.0f} "
                                   f"({inter(two_hop) / inter(bf16):.3f}x), {inter(bf16):,.0f}"))
            out.append(figures.row(heading, "two-hop LoCo 4-bit step / flat LoCo 4-bit step",
                                   f"{step_ratio / flat_step:.2f}x", "<= 1x"))
    return out


def headline_quality(md: str) -> list[str]:
    """Rows for the loss study: LoCo 4-bit's gap to full precision (target within 1%), and the
    original 2-bit scheme with and without error feedback (target: without is worse)."""
    rows = _quality_rows(md)
    out = []
    loco4 = rows.get("LoCo 4-bit")
    if loco4:
        out.append(figures.row(QUALITY_SETTING, "LoCo 4-bit final eval loss vs full precision", loco4[2],
                               "within 1%"))
    loco2, noef2 = rows.get("LoCo 2-bit"), rows.get("2-bit, no error feedback")
    if loco2 and noef2:
        out.append(figures.row(QUALITY_SETTING, "original 2-bit scheme final eval loss: LoCo; without error feedback",
                               f"{loco2[0].split()[0]}; {noef2[0].split()[0]}", "without above LoCo"))
    return out


QUALITY_SETTING = "loss study (section 2)"


def headline_kernels(text: str) -> list[str]:
    """Rows from ``kernels.py``'s rows (elements, threads, kernels, copy GB/s, compress GB/s,
    ratio, cpu ratio, decomp+sum GB/s, ratio, cpu ratio): the fast path's rows on one thread
    (or the GPU's), wall-clock ratios with the CPU-time ones beside (targets: compress >=
    0.25x of a memory copy, decompress-and-sum >= 0.3x)."""
    rows = [c for c in map(str.split, text.splitlines()) if len(c) == 10 and c[0].replace(",", "").isdigit()]
    fast = {c[2] for c in rows} - {"torch"} or {"torch"}
    out = []
    for c in rows:
        if c[2] not in fast or c[1] not in ("1", "-"):
            continue
        setting = f"{c[0]} elements, {c[2]} kernels, {c[1]} thread"
        out.append(figures.row(setting, "compress / memory copy (CPU time)", f"{float(c[5]):.3f}x ({c[6]}x)",
                               ">= 0.25x"))
        out.append(figures.row(setting, "decompress+sum / memory copy (CPU time)", f"{float(c[8]):.3f}x ({c[9]}x)",
                               ">= 0.3x"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results")
    ap.add_argument("--out", default="docs/benchmarks.md")
    ap.add_argument("--sections", choices=["all", *PARTIAL], default="all",
                    help="2bit / fast / gpu / checkpoint / checkpoint_memory: replace only that section of the "
                         "existing --out page")
    args = ap.parse_args()
    res, out = pathlib.Path(args.results), pathlib.Path(args.out)
    if args.sections != "all":
        return update_section(args.sections, res, out)
    assets = out.parent / "benchmarks"
    assets.mkdir(parents=True, exist_ok=True)
    for needed in (res / "speed" / "speed.md", res / "quality" / "quality.md", res / "kernels.txt"):
        if not needed.exists():
            sys.exit(f"error: {needed} is missing; run the benchmark that writes it first")
    speed = (res / "speed" / "speed.md").read_text()
    quality = (res / "quality" / "quality.md").read_text()
    kernels = (res / "kernels.txt").read_text()
    commands = (res / "commands.txt").read_text() if (res / "commands.txt").exists() else ""

    plots = []
    for group in sorted((res / "speed" / "plots").glob("*")):
        for name in ("step_time.png", "bytes_per_step.png"):
            if (group / name).exists():
                dest = assets / f"speed_{group.name}_{name}"
                shutil.copy(group / name, dest)
                plots.append((group.name, name, dest.name))
    shutil.copy(res / "quality" / "loss_vs_tokens.png", assets / "quality_loss_vs_tokens.png")

    doc = [
        "# Benchmarks",
        "",
        *INTRO,
        "",
        f"Machine: {_machine()}.",
        "",
        "## Commands",
        "",
        "All of them, in order, to rerun the whole page (each section repeats its own):",
        "",
        "```bash",
        commands.strip() or "# (see each section)",
        "```",
        "",
        HEADLINES_HEADING,
        "",
        HEADLINES_INTRO,
        "",
        *figures.HEADER,
        *headline_speed(speed),
        *headline_quality(quality),
        *headline_kernels(kernels),
        *report_fast.headlines(res),
        "",
        "## 1. Step time and communication on a simulated cluster (`benchmarks/speed.py`)",
        "",
        "Each \"node\" is a network namespace; nodes talk through veth links shaped by a `tbf`",
        "qdisc (`benchmarks/simcluster.py`); ranks of one node talk over its loopback. Times are",
        "medians of per-step means after the first log window. *comm total* is launch-to-completion",
        "of every gradient collective summed over buckets (buckets overlap each other and the",
        "backward pass, so it can exceed the step); *exposed* is what the step waited for.",
        "",
        *_printed_by(commands, "benchmarks/speed.py"),
        speed.split("\n", 1)[1] if "\n" in speed else speed,
        _wire(res / "speed"),
        *[f"![{g} {n}](benchmarks/{f})" for g, n, f in plots],
        "",
        "## 2. Loss parity (`benchmarks/quality.py`)",
        "",
        "Final and best eval loss of the same training with each gradient sync: mean ± standard",
        "deviation over the seeds, and the gap of the mean to full precision. The 2-bit rows run the",
        "original scheme (symmetric grid, absmax scale: `quality.py`'s `loco2`, `ef2`, `noef2`);",
        "what `--loco-bits 2` runs by default is in section 7.",
        "",
        *_printed_by(commands, "benchmarks/quality.py"),
        re.sub(r"^# (.*)$", r"*\1*", quality, count=1, flags=re.M),
        "![loss vs tokens](benchmarks/quality_loss_vs_tokens.png)",
        "",
        "## 3. Compression kernels (`benchmarks/kernels.py`)",
        "",
        "Compress and decompress-and-sum throughput of the fused kernels and the torch reference",
        "against a memory copy of the same bytes, per bucket size and thread count.",
        "",
        *_printed_by(commands, "benchmarks/kernels.py"),
        "```",
        kernels.strip(),
        "```",
        "",
        "GPU (fused Triton kernels, `--loco-kernels triton`): section 9, when a GPU check",
        "ran (`bash benchmarks/gpu_check.sh`); on CPU the kernels are checked for",
        "bit-compatibility with the reference under `TRITON_INTERPRET=1`.",
        "",
        *optional_sections(res, commands),
        *checkpoint_section(res),
        *two_bit_section(res),
        *checkpoint_memory_section(res),
        *gpu_section(res),
        "## What the numbers mean",
        "",
        "- LoCo compresses the gradient reduce-scatter. With the distributed optimizer the",
        "  updated parameters are all-gathered every step too: at the parameter dtype by default",
        "  (`comm/param_gather_s`), or as 8/4-bit differences with `--param-gather-bits`",
        "  (the `+ params` variants). Whatever stays uncompressed, and the compute, bound the",
        "  achievable step-time ratio on a slow link.",
        "- On CPU the compressor is the fused C++ kernel (`--loco-kernels auto` -> cpu; one pass",
        "  over each bucket, vectorised, on the rank's threads), the torch reference only without",
        "  a compiler. Its cost still sits inline on the backward pass, which is what the",
        "  unshaped (fast-link) rows pay for; the fused Triton kernels are the GPU path.",
        "- Two-hop LoCo on CPU: on this simulator the ranks of a 2x2 run share two cores and the",
        "  ranks of a node talk over TCP loopback, so every intra-node byte costs CPU time the",
        "  backward pass needs. With hop 1 at 8 bits a rank compresses 1.5x the elements flat",
        "  LoCo compresses; with bf16 inside the node it compresses half of them but hands",
        "  about 4.4x the bytes to a loopback all-to-all; what two-hop saves is half of flat's",
        "  inter-node bytes, mostly hidden under the backward pass at 1 Gbit/s. Its design",
        "  assumes compression costs about one memory pass and hop 1 crosses NVLink (GPU nodes),",
        "  where the inter-node bytes dominate (section 10 has the measured ratios over repeated",
        "  runs; a single run on this machine cannot rank two-hop against flat).",
        "- Where `--param-gather-bits` spends its time (`benchmarks/speed.py` prints it under each",
        "  table): the encode of the rank's own shard and the apply of every shard's differences",
        "  run on the rank, inside the step (megatron waits for each bucket group's gather in the",
        "  forward pre-hook, so the apply is on the critical path), while the bytes travel on",
        "  gloo's thread. The apply adds the other shards' differences in place, in 256K-element",
        "  slices, with the metric norms summed in fp32 per chunk.",
        "- Kernel ratios are wall-clock; the CPU-time ratios beside them are steadier on a",
        "  machine shared with other work (a preempted kernel's wall time grows, its CPU time",
        "  does not), and two-thread rows there mostly measure waiting for the second core.",
        "- Bytes are what this rank handed to gradient collectives per step (codes + scales",
        "  for LoCo; *to other nodes*: the part addressed to ranks on other nodes). The",
        "  wire-byte table counts everything that left a node's interface after the first log",
        "  window, per rank per step: it also carries the parameter all-gather, TCP/IP",
        "  overhead and whatever extra traffic gloo's collective algorithms make, so it is",
        "  larger than the payload.",
        "",
    ]
    out.write_text("\n".join(doc))
    print(out)


def optional_sections(res: pathlib.Path, commands: str = "") -> list[str]:
    """Sections 4-5 when their outputs exist: RESULTS/memory.txt (``benchmarks/memory.py``)
    and RESULTS/preprocess.txt (``benchmarks/preprocess.py``)."""
    out = []
    if (res / "memory.txt").is_file():
        out += ["## 4. Memory per rank and layouts (`benchmarks/memory.py`)", "",
                "Analytic table: what the configs' layouts are chosen from (model and formulas in the",
                "script's docstring). Measured table: peak RSS per rank on CPU (it includes the",
                "Python process and megatron-core), so recomputation shows on the larger model.", "",
                *_printed_by(commands, "benchmarks/memory.py"),
                (res / "memory.txt").read_text().strip(), ""]
    if (res / "preprocess.txt").is_file():
        out += ["## 5. Preprocessing throughput (`benchmarks/preprocess.py`)", "",
                "Documents per second of `tools/preprocess_data.py` with one and two workers, and",
                "whether both wrote the same dataset.", "",
                *_printed_by(commands, "benchmarks/preprocess.py"), "```",
                (res / "preprocess.txt").read_text().strip(), "```", ""]
    return out


CHECKPOINT_HEADING = "## 6. Checkpoints (`benchmarks/checkpoint.py`)"
CHECKPOINT_MEMORY_HEADING = "## 8. Checkpoint memory (`benchmarks/checkpoint.py --memory`)"
TWO_BIT_HEADING = "## 7. 2-bit quantiser options (`benchmarks/quality.py --variants 2bit`)"


def _script_output_section(res: pathlib.Path, name: str, heading: str, intro: list[str], command: str,
                           section: str) -> list[str]:
    """A section that shows RESULTS/``name`` (the output of ``command``) under ``intro``."""
    if not (res / name).is_file():
        return []
    return [heading, "", *intro, "", "```bash", f"{command} > results/{name}",
            f"python benchmarks/report.py --results results --sections {section}", "```", "",
            (res / name).read_text().strip(), ""]


def checkpoint_section(res: pathlib.Path) -> list[str]:
    """Section 6 from RESULTS/checkpoint.txt (``benchmarks/checkpoint.py``) when present."""
    return _script_output_section(res, "checkpoint.txt", CHECKPOINT_HEADING, [
        "Per-rank files (`--ckpt-format torch`) against megatron-core dist_checkpointing",
        "(`torch_dist`, reshardable), synchronous and with `--async-save`: how long the",
        "training loop is blocked per save, until the save is committed, loading, and bytes",
        "on disk per parameter."], "python benchmarks/checkpoint.py", "checkpoint")


def checkpoint_memory_section(res: pathlib.Path) -> list[str]:
    """Section 8 from RESULTS/checkpoint_memory.txt (``benchmarks/checkpoint.py --memory``)."""
    return _script_output_section(res, "checkpoint_memory.txt", CHECKPOINT_MEMORY_HEADING, [
        "Each rank's peak extra resident memory while it saves and loads a torch_dist checkpoint,",
        "next to its own share of the distributed optimizer's state: every data-parallel rank",
        "writes and reads only the slices it owns (no gather of the replica)."],
        "python benchmarks/checkpoint.py --memory", "checkpoint_memory")


def _quality_rows(md: str) -> dict[str, list[str]]:
    """label -> cells (final, best, gap) of a ``quality.py`` table."""
    rows = {}
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith("| variant"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def headline_two_bit(md: str, label: str) -> list[str]:
    """Rows for one 2-bit study: the best LoCo 2-bit variant's gap to full precision (target
    within 1%), and the original scheme's (the ``LoCo 2-bit`` row) beside it."""
    rows = {k: v for k, v in _quality_rows(md).items() if k.startswith("LoCo 2-bit")}
    if not rows:
        return []
    best = min(rows, key=lambda k: float(rows[k][2].rstrip("%")))
    out = [figures.row(label, f"best 2-bit variant, {best}: final eval loss vs full precision", rows[best][2],
                       "within 1%")]
    if "LoCo 2-bit" in rows and best != "LoCo 2-bit":
        out.append(figures.row(label, "original 2-bit scheme (LoCo 2-bit): final eval loss vs full precision",
                               rows["LoCo 2-bit"][2]))
    return out


def two_bit_section(res: pathlib.Path) -> list[str]:
    """Section 7 from RESULTS/quality2bit (and RESULTS/quality2bit_long) when present."""
    parts = [(res / "quality2bit" / "quality.md", "200 steps"), (res / "quality2bit_long" / "quality.md", "long run"),
             (res / "quality2bit_descent" / "quality.md", "long run, the code --loco-bits 2 runs")]
    parts = [(p.read_text(), label) for p, label in parts if p.is_file()]
    if not parts:
        return []
    out = [TWO_BIT_HEADING, "",
           "Which 2-bit quantiser options to use, and what they cost in loss. The first table: each",
           "option alone and combined (uniform grid, MSE-clipped scale, block Hadamard rotation,",
           "stochastic rounding; none = the original symmetric absmax scheme), with LoCo's error",
           "feedback and without. The second: a longer run of full precision, the 2-bit default and",
           "the original scheme. The third: the longer run of the 2-bit default as `--loco-bits 2`",
           "runs it (the uniform grid with a zero level and the four-candidate mse descent of",
           "docs/kernels.md), with the parameters at 2 bits too. The uniform-grid rows of the first",
           "two tables (uniform, and the 2-bit default) run a half-integer grid and the full",
           "six-candidate search instead.",
           "", "```bash",
           "python benchmarks/quality.py --out results/quality2bit --variants 2bit --seeds 1234,1235",
           "python benchmarks/quality.py --out results/quality2bit_long --iters 400 --variants fp32,loco2d,loco2 "
           "--seeds 1234,1235",
           "python benchmarks/quality.py --out results/quality2bit_descent --iters 400 --variants fp32,loco2d,loco2p2 "
           "--seeds 1234,1235",
           "python benchmarks/report.py --results results --sections 2bit", "```", ""]
    for md, label in parts:
        out += [*figures.HEADER, *headline_two_bit(md, label), "",
                re.sub(r"^# (.*)$", r"*\1*", md, count=1, flags=re.M), ""]
    return out


GPU_HEADING = "## 9. GPU check (`benchmarks/gpu_check.sh`)"

INTRO = [
    "With this page you can find the measured figure for a feature (step time and bytes of each",
    "gradient sync on a simulated cluster, loss parity, kernel throughput, memory, checkpoints,",
    "the 2-bit options, the GPU check, DiLoCo), the command that printed it, and rerun that",
    "command to check the figure on your machine. Every number here was printed by a script:",
    "`python benchmarks/report.py` assembles the page from the scripts' outputs, and each",
    "section names the commands it comes from. The runs share one small CPU machine, so compare",
    "ratios within a table rather than absolute times across sections.",
]
"""The page's opening paragraph (what a reader can do with it)."""
HEADLINES_HEADING = "## Headlines against the targets"
HEADLINES_INTRO = ("Each row gives a figure a script printed (or a ratio of two) and the project's target for it, "
                   "where it has one; the numbered sections below hold the full tables.")


def _printed_by(commands: str, script: str) -> list[str]:
    """The lines of the page's command list that run ``script``, as a bash block (nothing
    when none does)."""
    lines = [ln for ln in commands.splitlines() if script in ln]
    return ["Printed by:", "", "```bash", *lines, "```", ""] if lines else []


def gpu_section(res: pathlib.Path) -> list[str]:
    """The GPU check's own output (device, per-step exit codes, kernel-test result,
    throughput tables), the one-GPU training run's losses and the person's ``notes.md`` on
    it, or nothing when no GPU check ran."""
    d = res / "gpu"
    if not (d / "summary.txt").exists():
        return []

    def lines(name: str, keep=lambda ln: True) -> list[str]:
        f = d / name
        text = f.read_text(errors="replace").splitlines() if f.exists() else ["(missing)"]
        return [ln for ln in text if ln.strip() and "warn" not in ln.lower() and keep(ln)]

    tests = lines("kernel_tests.txt", lambda ln: ln.startswith("FAILED") or re.search(r"\d+ (passed|failed)", ln))
    return [GPU_HEADING, "", *GPU_INTRO,
            "", "```bash", "OUT=results/gpu bash benchmarks/gpu_check.sh",
            "python benchmarks/report.py --results results --sections gpu", "```",
            "", "```", *lines("gpu.txt"), "", *lines("summary.txt"), "", *tests, "", *lines("kernels_4bit.txt"),
            "", *lines("kernels_2bit.txt"), "```", "", *_training_losses(lines("train_1gpu.txt")), "",
            *([(d / "notes.md").read_text().strip(), ""] if (d / "notes.md").exists() else [])]


GPU_INTRO = [
    "One prepared script on a lent GPU: the Triton kernel tests compiled for the device,",
    "kernel throughput against a device-to-device copy (ratio = copy time / kernel time),",
    "LoCo's per-bucket hot path under `torch.cuda.set_sync_debug_mode(\"error\")`",
    "(`benchmarks/sync_check.py`), a one-GPU training run on NCCL (a DP group of one: no",
    "compression on the wire), and several ranks on the one GPU over gloo",
    "(`benchmarks/gpu_ranks.py`, docs/platform.md): 2 ranks with LoCo 4-bit and the",
    "overlapped 4-bit parameter gather, a save and a resume checked bit for bit against the",
    "unbroken run, 4 ranks with the 2-bit defaults, and Megatron-FSDP on 2 ranks. The output",
    "below holds the steps that ran: the sync-debug and multi-rank steps are not in it.",
]
"""What section 9 covers (its opening paragraph)."""


def _training_losses(log: list[str]) -> list[str]:
    """The one-GPU run's logged losses (from its iteration and eval lines) as a table: the
    run's figures, not its console lines, whose format is the program's of the day it ran."""
    train = {int(m.group(1)): m.group(2) for m in map(re.compile(r"iter (\d+)/\d+ \| loss (\S+)").match, log) if m}
    evals = {int(m.group(1)): m.group(2) for m in map(re.compile(r"iter (\d+) \| eval loss (\S+)").match, log) if m}
    if not train:
        return []
    out = ["The one-GPU training run (`train_1gpu.txt`), its logged losses:", "",
           "| iteration | train loss | eval loss |", "|---|---|---|"]
    return out + [f"| {i} | {train.get(i, '')} | {evals.get(i, '')} |" for i in sorted(train.keys() | evals.keys())]


PARTIAL = {"2bit": (TWO_BIT_HEADING, two_bit_section, "quality2bit/quality.md (quality.py --variants 2bit)"),
           "fast": (report_fast.HEADING, report_fast.section, "fast/ (the commands in benchmarks/report_fast.py)"),
           "gpu": (GPU_HEADING, gpu_section, "gpu/summary.txt (OUT=results/gpu bash benchmarks/gpu_check.sh)"),
           "checkpoint": (CHECKPOINT_HEADING, checkpoint_section, "checkpoint.txt (benchmarks/checkpoint.py)"),
           "checkpoint_memory": (CHECKPOINT_MEMORY_HEADING, checkpoint_memory_section,
                                 "checkpoint_memory.txt (benchmarks/checkpoint.py --memory)"),
           "diloco": (report_diloco.HEADING, report_diloco.section,
                      "speed_diloco/ or quality_diloco_r2/ (the commands in benchmarks/report_diloco.py)"),
           "muon": (report_muon.HEADING, report_muon.section,
                    "muon/ or muon_scales/ (the commands in benchmarks/report_muon.py)"),
           "sweep": (report_sweep.HEADING, report_sweep.section,
                     "sweep/sweep.md (the commands in benchmarks/report_sweep.py)")}
"""``--sections`` name -> (heading, section builder, what must exist in --results)."""
HEADLINES = {"fast": (report_fast.HEADLINE, report_fast.headlines),
             "muon": (report_muon.HEADLINE, report_muon.headlines),
             "sweep": (report_sweep.HEADLINE, report_sweep.headlines)}
"""``--sections`` name -> (the prefix of its lines in the headline list, their builder)."""


def _number(heading: str) -> int:
    return int(re.match(r"## (\d+)\.", heading).group(1))


def update_section(name: str, res: pathlib.Path, out: pathlib.Path) -> None:
    """Replace one numbered section of an existing page, or insert it before the first
    section with a higher number (else before "What the numbers mean")."""
    heading, build, needs = PARTIAL[name]
    section = build(res)
    if not section:
        sys.exit(f"error: {res}/{needs} is missing; run that benchmark first")
    if not out.is_file():
        sys.exit(f"error: {out} does not exist; generate the whole page first")
    text = out.read_text()
    new = "\n".join(section).rstrip("\n") + "\n\n"
    if heading in text:
        head, rest = text.split(heading, 1)
        tail = rest[rest.index("\n## ") + 1:] if "\n## " in rest else ""
    else:
        later = [m.start() for m in re.finditer(r"^## (\d+)\.", text, flags=re.M)
                 if int(m.group(1)) > _number(heading)]
        cut = later[0] if later else text.index("## What the numbers mean")
        head, tail = text[:cut], text[cut:]
    text = head + new + tail
    if name in HEADLINES:  # a section whose targets also go into the headline list
        prefix, lines = HEADLINES[name]
        text = replace_headlines(text, prefix, lines(res))
    out.write_text(text)
    print(out)
    if name == "diloco":  # the guide shows the same measured block
        report_diloco.update_guide(res, out.parent / "diloco.md")


def replace_headlines(text: str, prefix: str, lines: list[str]) -> str:
    """``text`` with the headline table's rows starting with ``prefix`` replaced by
    ``lines``, at the end of that table."""
    start = text.index(HEADLINES_HEADING)
    end = text.index("\n## ", start + 1)
    kept = [line for line in text[start:end].rstrip("\n").split("\n") if not line.startswith(prefix)]
    rows = [i for i, line in enumerate(kept) if line.startswith("|")]
    if rows:
        kept[rows[-1] + 1:rows[-1] + 1] = lines
    elif lines:
        kept += ["", *figures.HEADER, *lines]
    return text[:start] + "\n".join(kept) + "\n" + text[end:]


if __name__ == "__main__":
    main()
