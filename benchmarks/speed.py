#!/usr/bin/env python3
"""Step time, communication time and bytes of LoCo vs Megatron-Core's own gradient sync,
on a simulated bandwidth-limited cluster (see ``benchmarks/simcluster.py``; needs root).

For each topology (``NODESxRANKS``) and inter-node link it trains the same GPT for
``--iters`` steps with each gradient sync and writes, under ``--out``:

* ``speed.md``: per topology and link, median step time, tokens/s, gradient-sync time
  total and exposed per step, bytes sent per rank per step, and step / comm time as a
  ratio to the bf16 reduce-scatter;
* ``runs/*.jsonl``: every run's metrics; ``plots/<topology>_<link>/``: the
  ``tools/compare_runs.py`` table and plots of that group.

    sudo python benchmarks/speed.py --out results/speed            # the full study
    sudo python benchmarks/speed.py --smoke --out /tmp/speed-smoke # seconds-scale check

All variants train in one compute dtype, ``--dtype`` (default ``auto``: one matmul of
the model's shape is timed in fp32 and in bf16 on one thread at start and the faster
wins; a CPU without native bf16 arithmetic runs bf16 many times slower, which would
swamp every ratio). The dtype and both probe times are printed and written at the top of
``speed.md``. With bf16, weights are bf16 with fp32 main weights (``--bf16``). "fp32
reduce-scatter" is megatron's default fp32 gradient buffer, "bf16 reduce-scatter" adds
``--grad-reduce-in-bf16`` (megatron-core needs bf16 parameters for that, so with fp32
compute this one variant trains in bf16 and says so in its label); the ratios are to
the baseline of the compute dtype (bf16 reduce-scatter, or fp32 with fp32 compute), and
both baselines stay side by side in the table. LoCo compresses the fp32 buffer. A 1-node topology has no
inter-node link, so it runs once, unshaped. With several ranks per node LoCo runs
two-hop (8-bit inside the node, ``--loco-bits`` across; see ``loco/two_hop.py``);
``loco4flat`` is the flat all-to-all for comparison, ``loco4i16`` two-hop with hop 1 at
bf16 (no compression inside the node); ``loco4p8`` / ``loco4p4`` add 8-/4-bit
weight differences in the parameter all-gather (``--param-gather-bits``), and
``loco4flatp4`` / ``loco4i16p4`` are flat and bf16-inside two-hop with them. Bytes are per
rank per step: gradient bytes sent, the part sent to other nodes, and the parameter
all-gather's gathered bytes. ``fsdp`` / ``fsdp4`` run Megatron-FSDP as HSDP (one instance
per node, ZeRO-3 inside it) at full precision and with LoCo 4-bit on the cross-node
reduction, multi-node topologies only, and print one line comparing the two.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))

from simcluster import SimCluster, SimClusterError, available  # noqa: E402

import compare_runs  # noqa: E402

_FSDP = ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "{nodes}", "--loco-ranks-per-node",
         "{ranks}", "--ckpt-format", "torch"]  # {nodes}/{ranks}: filled in per topology
VARIANTS = {
    "fp32": ("fp32 reduce-scatter", ["--loco-bits", "0"]),
    "bf16": ("bf16 reduce-scatter", ["--loco-bits", "0", "--grad-reduce-in-bf16"]),
    "loco8": ("LoCo 8-bit", ["--loco-bits", "8"]),
    "loco4": ("LoCo 4-bit", ["--loco-bits", "4"]),
    "loco2": ("LoCo 2-bit", ["--loco-bits", "2"]),
    # Only where a node holds several ranks of a multi-node group (elsewhere it equals loco4):
    "loco4flat": ("LoCo 4-bit, flat (no two-hop)", ["--loco-bits", "4", "--no-loco-hierarchical"]),
    "loco4i16": ("LoCo 4-bit, two-hop, bf16 inside the node", ["--loco-bits", "4", "--loco-intra-node-bits", "16"]),
    "loco4p8": ("LoCo 4-bit + params 8-bit", ["--loco-bits", "4", "--param-gather-bits", "8"]),
    "loco4p4": ("LoCo 4-bit + params 4-bit", ["--loco-bits", "4", "--param-gather-bits", "4"]),
    # Two-hop against flat with the parameter all-gather compressed too (on a slow link the
    # uncompressed gather's bytes otherwise dominate the step; multi-node, several ranks per node):
    "loco4flatp4": ("LoCo 4-bit, flat (no two-hop) + params 4-bit",
                    ["--loco-bits", "4", "--no-loco-hierarchical", "--param-gather-bits", "4"]),
    "loco4i16p4": ("LoCo 4-bit, two-hop, bf16 inside the node + params 4-bit",
                   ["--loco-bits", "4", "--loco-intra-node-bits", "16", "--param-gather-bits", "4"]),
    # Megatron-FSDP as HSDP, one instance per node (multi-node topologies only; docs/fsdp.md):
    "fsdp": ("Megatron-FSDP HSDP, full precision", [*_FSDP, "--loco-bits", "0"]),
    "fsdp4": ("Megatron-FSDP HSDP + LoCo 4-bit", [*_FSDP, "--loco-bits", "4"]),
}
_DILOCO = ["--loco-bits", "0", "--diloco-replicas", "{nodes}", "--diloco-inner-steps", "32"]  # a replica per node
VARIANTS.update({
    # DiLoCo: one replica per node, H = 32 inner steps between outer exchanges; inside a node
    # megatron's fp32 reduce-scatter every step (multi-node topologies only; docs/diloco.md).
    "dl0": ("DiLoCo H=32, fp32 outer", [*_DILOCO, "--diloco-outer-bits", "0"]),
    "dl4": ("DiLoCo H=32, LoCo 4-bit outer", [*_DILOCO, "--diloco-outer-bits", "4"]),
    "dls4": ("Streaming DiLoCo H=32 F=4 tau=2, LoCo 4-bit outer",
             [*_DILOCO, "--diloco-outer-bits", "4", "--diloco-fragments", "4", "--diloco-sync-delay", "2"]),
    # (the form measured in docs/benchmarks.md section 11, given explicitly: not the 2-bit default)
    "dl2": ("DiLoCo H=32, LoCo 2-bit outer", [*_DILOCO, "--diloco-outer-bits", "2", "--diloco-outer-beta", "0.8",
                                              "--no-diloco-outer-gain-correction"]),
    # Eager updates: the exchange runs through the next interval (docs/diloco.md, "Eager updates").
    "dle4": ("Eager DiLoCo H=32, LoCo 4-bit outer", [*_DILOCO, "--diloco-outer-bits", "4", "--diloco-eager"]),
    # The same replicas with no outer exchange in the run (H beyond its end): the step time
    # DiLoCo's exchanges are measured against.
    "dlnone": ("DiLoCo replicas, no outer exchange", [*_DILOCO[:-1], "1000000", "--diloco-outer-bits", "4"]),
})
DILOCO = ("dl0", "dl4", "dls4", "dl2", "dle4", "dlnone")
FSDP_PAIR = ("fsdp", "fsdp4")

# About 15M parameters: big enough that full-precision gradient sync dominates a step
# on a 1 Gbit/s link, small enough for a 2-core CPU.
MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "1", "--lr", "3e-4",
         "--lr-warmup-iters", "2", "--eval-interval", "0", "--ddp-bucket-size", "4000000", "--overlap-param-gather"]
SMOKE_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--micro-batch-size", "1", "--lr-warmup-iters", "1",
               "--eval-interval", "0", "--ddp-bucket-size", "40000"]


def _matmul_seconds(dtype: torch.dtype, shape: tuple[int, int, int] = (128, 512, 2048), repeats: int = 5) -> float:
    """Median time of one ``[m, k] @ [k, n]`` matmul in ``dtype`` on one thread (the
    model's MLP shape: 128 tokens, hidden 512, 4x hidden)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m, k, n = shape
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        a @ b
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def pick_dtype(choice: str, probe: Callable[[torch.dtype], float] = _matmul_seconds) -> tuple[str, str]:
    """``(dtype, note)``: ``choice`` if given, else whichever of fp32/bf16 ``probe`` times
    faster; the note says why, with the figures."""
    if choice != "auto":
        return choice, f"compute dtype {choice} (--dtype)"
    fp32, bf16 = probe(torch.float32), probe(torch.bfloat16)
    dtype = "bf16" if bf16 <= fp32 else "fp32"
    return dtype, (f"compute dtype {dtype} (auto: one matmul takes {fp32 * 1e3:.2f} ms in fp32, "
                   f"{bf16 * 1e3:.2f} ms in bf16 on one thread)")


def _topology(spec: str) -> tuple[int, int]:
    try:
        nodes, ranks = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: --topologies: '{spec}' is not NODESxRANKS (e.g. 2x1)")
    if nodes < 1 or ranks < 1:
        raise SystemExit(f"error: --topologies: '{spec}' needs at least 1 node and 1 rank")
    return nodes, ranks


def run_one(out: pathlib.Path, name: str, nodes: int, ranks: int, link: str, delay: str | None,
            args: list[str], timeout: float) -> tuple[pathlib.Path, dict | None]:
    """Train once on a fresh simulated cluster; returns the metrics file and the measured
    inter-node wire bytes per rank per step (``{"wire", "store", "other"}``, None on 1 node):
    read by ``benchmarks/wire_probe.py`` after steps a quarter and three quarters into the
    run, so neither the start-up nor the end of the run (DiLoCo's final outer step) counts."""
    metrics = out / "runs" / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    logs = out / "logs" / name
    logs.mkdir(parents=True, exist_ok=True)
    probes = logs / "probe"
    shutil.rmtree(probes, ignore_errors=True)
    probes.mkdir()
    rate = None if link == "none" else link
    iters = int(args[args.index("--train-iters") + 1])
    a, b = iters // 4, 3 * iters // 4
    port = 29555
    with SimCluster(nodes, rate=rate, delay=delay if rate else None) as cluster:
        cluster.run_torchrun(["benchmarks/wire_probe.py", *args, "--metrics-jsonl", str(metrics)], ranks, timeout,
                             env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "LOCO_WIRE_PROBE": f"{a},{b}",
                                  "LOCO_WIRE_PROBE_OUT": str(probes), "LOCO_WIRE_STORE_PORT": str(port)},
                             log_dir=logs, port=port)
    if nodes == 1 or b <= a:
        return metrics, None
    marks = [json.loads(p.read_text()) for p in sorted(probes.glob("node*.json"))]
    per = nodes * ranks * (b - a)
    return metrics, {k: sum(m["b"][k] - m["a"][k] for m in marks) / per for k in ("tx", "store", "other")}


def _finished(out: pathlib.Path, name: str, iters: int) -> tuple[pathlib.Path, float | None] | None:
    """``(metrics, wire bytes)`` of a run of ``name`` that an earlier invocation finished
    (its last record at ``iters``, its wire bytes written), else None."""
    metrics, wire = out / "runs" / f"{name}.jsonl", out / "runs" / f"{name}.wire.json"
    if not (metrics.is_file() and wire.is_file()):
        return None
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    if max((r.get("iteration", 0) for r in rows if "train/lm_loss" in r), default=0) != iters:
        return None
    measured = json.loads(wire.read_text())["wire_bytes_per_step"]
    return metrics, measured if isinstance(measured, dict) or measured is None else None  # (an older format: rerun)


def table(groups: dict, baseline: str = "bf16") -> str:
    """One markdown table per (topology, link) group; ratios to the ``baseline`` variant."""
    out = []
    for (topo, link), rows in groups.items():
        base = next((r for r in rows if r["key"] == baseline), rows[0])
        ref = base["label"].split(" (")[0]
        out.append(f"\n### {topo} ({'unshaped loopback' if link == 'none' else 'inter-node link ' + link})\n")
        out.append("| gradient sync | median step (s) | tokens/s | comm total / step (ms) | comm exposed / step (ms) "
                   "| compress / decompress (ms) | grad bytes / rank / step | of which to other nodes "
                   "| param bytes / rank / step "
                   f"| step vs {ref} | comm total vs {ref} | speedup vs {ref} |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            comm_ratio = r["comm_total_s"] / base["comm_total_s"] if base["comm_total_s"] else float("nan")
            out.append(
                f"| {r['label']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['comm_total_s'] * 1e3:.1f} "
                f"| {r['comm_exposed_s'] * 1e3:.1f} | {r['compress_s'] * 1e3:.1f} / {r['decompress_s'] * 1e3:.1f} "
                f"| {r['bytes_per_step']:,.0f} | {r['inter_bytes_per_step']:,.0f} "
                f"| {r['param_bytes_per_step']:,.0f} "
                f"| {r['step_s'] / base['step_s']:.2f} | {comm_ratio:.2f} "
                f"| {base['step_s'] / r['step_s']:.2f}x |")
        for r in rows:
            if r.get("param_compress_s"):  # where a compressed parameter gather spends its time
                out.append(f"\n{r['label']}: parameter gather per step: encode {r['param_compress_s'] * 1e3:.1f} ms "
                           f"and apply {r['param_decompress_s'] * 1e3:.1f} ms on the rank, "
                           f"{r['param_gather_s'] * 1e3:.1f} ms from launch to applied")
        out.extend(diloco_lines(rows))
        fsdp = {r["key"]: r for r in rows if r["key"] in FSDP_PAIR}
        if len(fsdp) == 2:
            f0, f4 = fsdp["fsdp"], fsdp["fsdp4"]
            inter = (f"{f4['inter_bytes_per_step'] / f0['inter_bytes_per_step']:.3f}"
                     if f0["inter_bytes_per_step"] else "n/a")
            out.append(f"\n{f4['label']} vs {f0['label']}: step x{f4['step_s'] / f0['step_s']:.2f}, "
                       f"comm total x{f4['comm_total_s'] / f0['comm_total_s']:.2f}, bytes to other nodes x{inter}")
    return "\n".join(out) + "\n"


def diloco_lines(rows: list[dict]) -> list[str]:
    """The DiLoCo rows of one group: measured wire bytes between the nodes (the replicas)
    per rank per step against a bf16 ring all-reduce between the replicas at every step
    (``2 (R - 1) / R x N x 2`` bytes per rank, computed by the runs themselves, the measure
    of the run summary: gloo's "bf16 reduce-scatter" row is an all-reduce plus a copy on
    the wire, not that), what of those bytes the rendezvous store's connections carried,
    and the mean step time against the same replicas without outer exchanges (the mean,
    unlike the median, carries the outer steps)."""
    by = {r["key"]: r for r in rows}
    dl = [r for r in rows if r["key"] in DILOCO]
    if not dl:
        return []
    ring = next((r["outer_bf16_every_step"] for r in dl if r.get("outer_bf16_every_step")), None)
    out = ["", "| DiLoCo run | mean step (s) | outer bytes / rank / step | outer time / step (ms), exposed "
               "| measured wire bytes to other nodes / rank / step | of them the rendezvous store's "
               "| wire bytes vs a bf16 ring all-reduce every step | mean step vs no outer exchange |",
           "|---|---|---|---|---|---|---|---|"]
    none = by.get("dlnone")
    for r in [x for x in (by.get("bf16"), by.get("fp32"), by.get("loco4")) if x] + dl:
        wire, store = r.get("wire_bytes_per_step"), r.get("store_bytes_per_step")
        vs_ring = f"{wire / ring:.4f}" if wire is not None and ring else "n/a"
        vs_none = f"{r['mean_step_s'] / none['mean_step_s']:.2f}" if none else "n/a"
        cells = [f"{wire:,.0f}", f"{store:,.0f}"] if wire is not None else ["n/a", "n/a"]
        out.append(f"| {r['label']} | {r['mean_step_s']:.3f} | {r['outer_bytes_per_step']:,.0f} "
                   f"| {r['outer_time_s'] * 1e3:.1f}, {r['outer_exposed_s'] * 1e3:.1f} | {' | '.join(cells)} "
                   f"| {vs_ring} | {vs_none} |")
    if ring:
        out.append(f"\nA bf16 ring all-reduce of the gradients between the replicas at every step: "
                   f"{ring:,.0f} bytes per rank per step (computed).")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--links", default="none,1gbit", help="comma-separated tc rates, 'none' = unshaped")
    ap.add_argument("--delay", default=None, help="netem delay on shaped links, e.g. 1ms (needs sch_netem)")
    ap.add_argument("--topologies", default="1x2,2x1,2x2", help="comma-separated NODESxRANKS")
    ap.add_argument("--variants", default=None, help=f"subset of {','.join(VARIANTS)} (default: all)")
    ap.add_argument("--data-cache-path", default=None, help="passed to pretrain_gpt.py (built-in corpus cache)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                    help="compute dtype of every run (auto: the faster one in a matmul probe at start)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the runs an earlier invocation finished in --out (same names and --iters)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, 4 steps, 2x1 at 1gbit (bf16 vs LoCo 4-bit unless --variants)")
    args = ap.parse_args()
    if args.smoke:
        args.iters, args.links, args.topologies = 4, "1gbit", "2x1"
        args.variants = args.variants or "bf16,loco4"
    variants = [v for v in (args.variants or ",".join(VARIANTS)).split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"error: --variants: unknown {unknown[0]!r} (choose from {', '.join(VARIANTS)})")
    topologies = [_topology(t) for t in args.topologies.split(",") if t]
    reason = available()
    if reason:
        sys.exit(f"error: the simulated cluster {reason}")
    out = pathlib.Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    dtype, dtype_note = pick_dtype(args.dtype)
    print(dtype_note, flush=True)
    model = [*(SMOKE_MODEL if args.smoke else MODEL), *(["--bf16"] if dtype == "bf16" else [])]
    if args.data_cache_path:
        model = [*model, "--data-cache-path", args.data_cache_path]
    # DiLoCo's outer steps make single steps long: every step is its own log record, so the
    # mean step time covers them exactly (and the first window, start-up, is one step).
    log_interval = 1 if args.smoke or set(variants) & set(DILOCO) else 5
    groups: dict = {}
    wire_bytes: dict = {}
    t_start = time.time()
    for nodes, ranks in topologies:
        links = ["none"] if nodes == 1 else [x for x in args.links.split(",") if x]
        for link in links:
            topo = f"{nodes}x{ranks}"
            rows, files = [], []
            for v in variants:
                if v in ("loco4flat", "loco4i16", "loco4flatp4", "loco4i16p4") and not (nodes > 1 and ranks > 1):
                    continue  # two-hop only differs with several nodes of several ranks
                if v in FSDP_PAIR + DILOCO and nodes == 1:
                    continue  # HSDP needs several nodes (flat FSDP with LoCo is refused); DiLoCo a replica per node
                label, flags = VARIANTS[v]
                flags = [f.format(nodes=nodes, ranks=ranks) for f in flags]
                base_args = model
                if "--use-megatron-fsdp" in flags:  # Megatron-FSDP gathers parameters itself
                    base_args = [a for a in model if a != "--overlap-param-gather"]
                if "--grad-reduce-in-bf16" in flags and dtype != "bf16":
                    label, flags = f"{label} (bf16 compute)", [*flags, "--bf16"]  # megatron needs bf16 params
                name = f"{topo}_{link}_{v}"
                # One micro batch per rank per step: the same compute per rank on every topology.
                run_args = [*base_args, *flags, "--global-batch-size", str(nodes * ranks), "--train-iters",
                            str(args.iters), "--log-interval", str(log_interval)]
                print(f"[{time.time() - t_start:6.0f}s] {name}", flush=True)
                done = _finished(out, name, args.iters) if args.reuse else None
                if done is not None:
                    path, wire = done
                    print(f"         (reusing {path})", flush=True)
                else:
                    try:
                        path, wire = run_one(out, name, nodes, ranks, link, args.delay, run_args, args.timeout)
                    except SimClusterError as e:
                        sys.exit(f"error: {name}: {e} (logs in {out / 'logs' / name})")
                    (out / "runs" / f"{name}.wire.json").write_text(json.dumps({"wire_bytes_per_step": wire}))
                run = compare_runs.load_run(str(path))
                run.label = label
                rows.append({"key": v, **compare_runs.summarize(run),
                             "wire_bytes_per_step": wire["tx"] if wire else None,
                             "store_bytes_per_step": wire["store"] if wire else None,
                             "gloo_bytes_per_step": wire["other"] if wire else None})
                if wire is not None:
                    wire_bytes[f"{name} ({label})"] = wire["tx"]
                files.append(str(path))
            groups[(topo, link)] = rows
            compare_runs.compare(files, str(out / "plots" / f"{topo}_{link}"), [r["label"] for r in rows])
    md = table(groups, baseline=dtype)
    header = (f"# Speed: {args.iters} steps per run, variants {', '.join(variants)}; "
              f"netem delay on shaped links: {args.delay or 'none'}; {dtype_note}\n")
    (out / "speed.md").write_text(header + md)
    (out / "wire_bytes.json").write_text(json.dumps(wire_bytes, indent=1))
    print(header + md)


if __name__ == "__main__":
    main()
