#!/usr/bin/env python3
"""Memory per rank: measured on CPU for small models, analytic for the GPU shapes.

    python benchmarks/memory.py --smoke          # seconds: tiny model, two settings
    python benchmarks/memory.py                  # measured table (tiny + larger CPU model)
    python benchmarks/memory.py --analytic-only  # the GPU configs' layout table only

Measured: peak memory per rank (``mem/peak_bytes``: peak RSS on CPU, so it includes
the Python process and megatron-core, ~hundreds of MB) and step time, for activation
recomputation none / selective / full and sequence parallelism on / off, TP=2 on 2 ranks.

Analytic (per GPU, bytes): :mod:`loco_megatron.training.memory_estimate` (the estimator
``pretrain_gpt.py --dry-run`` prints), for each config's shipped layout at its template's
geometry and a few alternatives, LoCo 4-bit, with the vocabulary each config states for its
dry runs (``dry-run-vocab-size``: LLaMA-2/Mixtral 32000, LLaMA-3 128256, GPT-2 50257).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loco_megatron.cli import load_yaml_config, make_config  # noqa: E402
from loco_megatron.training.memory_estimate import GIB, estimate  # noqa: E402

SETTINGS = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform"],
    "SP": ["--sequence-parallel"],
    "SP+selective": ["--sequence-parallel", "--recompute-granularity", "selective"],
}
MODELS = {
    "tiny (4x128, seq 128)": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
                              "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "4"],
    "larger (4x512, seq 1024)": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
                                 "--seq-length", "1024", "--micro-batch-size", "4", "--global-batch-size", "4"],
}


def measure(model_args: list, extra: list, iters: int, cache: str) -> tuple[float, float]:
    """(peak bytes per rank, mean step seconds) of a TP=2 run on 2 CPU ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = pathlib.Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO / "pretrain_gpt.py"), *model_args, *extra, "--tensor-model-parallel-size", "2",
               "--train-iters", str(iters), "--log-interval", str(iters), "--eval-interval", "0",
               "--data-cache-path", cache, "--metrics-jsonl", str(metrics)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        last = [json.loads(l) for l in metrics.read_text().splitlines() if "train/lm_loss" in l][-1]
        return last["mem/peak_bytes"], last["train/step_s"]


def measured_table(models: dict, settings: dict, iters: int, cache: str) -> str:
    rows = ["| model | setting | peak memory per rank (MiB) | vs none | step (s) |", "|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for name, margs in models.items():
        base = None
        for setting, extra in settings.items():
            peak, step = measure(margs, extra, iters, cache)
            base = base or peak
            rows.append(f"| {name} | {setting} | {peak / 2**20:.0f} | {peak / base:.3f} | {step:.3f} |")
            print(rows[-1], flush=True)
    return "\n".join(rows)


def analytic(config_file: str, tp: int, pp: int, dp: int, ep: int, vp: int, recompute: str, sp: bool,
             micro_batch: int | None = None, loco_bits: int = 4, etp: int | None = None,
             extra: dict | None = None) -> dict:
    """Bytes per GPU on the first pipeline stage for ``config_file`` in one layout
    (world = TP x PP x DP; see :func:`loco_megatron.training.memory_estimate.estimate`), with
    the vocabulary its dry run uses (its dry-run-vocab-size, else the built-in corpus's);
    ``micro_batch`` None: the config's; ``extra``: more flag values (Megatron-FSDP's)."""
    values = load_yaml_config(config_file)
    micro_batch = micro_batch or values.get("micro_batch_size", 4)
    values.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                  expert_tensor_parallel_size=etp, micro_batch_size=micro_batch, loco_bits=loco_bits,
                  virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                  num_layers_per_virtual_pipeline_stage=None, sequence_parallel=sp,
                  recompute_granularity=None if recompute == "none" else recompute,
                  recompute_method="uniform" if recompute == "full" else None)
    values["global_batch_size"] = micro_batch * dp * pp * 8  # any batch the layout accepts
    values.update(extra or {})
    config = make_config(values)
    return estimate(config, tp * pp * dp, config.data.dry_run_vocab_size or config.data.vocab_size)


# (TP, PP, DP, EP, VP, recompute, SP, ETP or None = TP); the first row of each config is
# the layout it ships with, at its Slurm template's GPU count (see its header comment).
LAYOUTS = {
    "configs/tiny_gpt.yaml": [(1, 1, 2, 1, 1, "none", False, None)],
    "configs/tiny_moe.yaml": [(1, 1, 2, 1, 1, "none", False, None)],
    "configs/gpt_125m.yaml": [(1, 1, 16, 1, 1, "none", False, None)],
    "configs/gpt_1.3b.yaml": [(1, 1, 16, 1, 1, "none", False, None), (1, 1, 16, 1, 1, "selective", False, None)],
    "configs/llama_1b.yaml": [
        (1, 1, 16, 1, 1, "selective", False, None), (1, 1, 8, 1, 1, "none", False, None)],
    "configs/llama2_7b.yaml": [
        (2, 1, 8, 1, 1, "selective", True, None),
        (1, 1, 8, 1, 1, "full", False, None), (2, 1, 4, 1, 1, "selective", True, None),
        (4, 1, 2, 1, 1, "none", True, None), (2, 2, 2, 1, 2, "selective", True, None)],
    "configs/llama3_8b.yaml": [
        (2, 1, 8, 1, 1, "selective", True, None), (4, 1, 4, 1, 1, "selective", True, None),
        (1, 1, 16, 1, 1, "full", False, None)],
    "configs/llama2_13b.yaml": [
        (4, 1, 4, 1, 1, "selective", True, None),
        (2, 1, 4, 1, 1, "selective", True, None), (8, 1, 1, 1, 1, "none", True, None),
        (4, 2, 1, 1, 2, "selective", True, None), (2, 2, 2, 1, 2, "full", True, None)],
    "configs/mixtral_8x7b.yaml": [
        (2, 4, 4, 8, 2, "selective", True, 1),
        (2, 4, 8, 8, 2, "selective", True, None),
        (1, 4, 8, 8, 2, "full", False, None), (2, 8, 2, 4, 2, "selective", True, 1)],
}


def analytic_table() -> str:
    rows = ["| config | GPUs | TP | PP | DP | EP | ETP | expert DP | VP | recompute | SP | params (B) | weights | "
            "grads | optimizer | LoCo error + workspace | activations | total GiB | fits 80 GB | fits 141 GB |",
            "|" + "---|" * 20]
    for cfg, layouts in LAYOUTS.items():
        stem = pathlib.Path(cfg).stem
        for tp, pp, dp, ep, vp, rc, sp, etp in layouts:
            r = analytic(str(REPO / cfg), tp, pp, dp, ep, vp, rc, sp, etp=etp)
            gib = {k: v / GIB for k, v in r.items()}
            rows.append(
                f"| {stem} | {tp * pp * dp} | {tp} | {pp} | {dp} | {ep} | {etp or tp} | {r['expert_dp'] or '-'} | {vp} | "
                f"{rc} | {'on' if sp else 'off'} | "
                f"{r['params'] / 1e9:.2f} | {gib['weights']:.1f} | {gib['grads']:.1f} | {gib['optimizer']:.1f} | "
                f"{gib['loco_error'] + gib['loco_workspace']:.1f} | {gib['activations']:.1f} | "
                f"{gib['total']:.3g} | {'yes' if r['total'] < 0.92 * 80e9 else 'no'} | "
                f"{'yes' if r['total'] < 0.92 * 141e9 else 'no'} |")
    return "\n".join(rows)


# Data parallelism over 16 GPUs = 2 nodes x 8, full recomputation: what each way of sharding
# keeps per GPU. LoCo 4-bit where it applies (flat FSDP with LoCo is refused, docs/fsdp.md).
SHARDING = {
    "distributed optimizer (DDP), LoCo 4-bit": {"loco_bits": 4},
    "Megatron-FSDP HSDP 2 x 8, ZeRO-3, LoCo 4-bit": {
        "use_megatron_fsdp": True, "num_distributed_optimizer_instances": 2, "loco_ranks_per_node": 8,
        "ckpt_format": "torch", "loco_bits": 4},
    "Megatron-FSDP HSDP 2 x 8, optim_grads, LoCo 4-bit": {
        "use_megatron_fsdp": True, "num_distributed_optimizer_instances": 2, "loco_ranks_per_node": 8,
        "data_parallel_sharding_strategy": "optim_grads", "ckpt_format": "torch", "loco_bits": 4},
    "Megatron-FSDP flat over 16, ZeRO-3, no LoCo": {"use_megatron_fsdp": True, "ckpt_format": "torch",
                                                     "loco_bits": 0},
}


def sharding_table() -> str:
    rows = ["| config | sharding | weights | grads | optimizer | LoCo error + workspace | activations | total GiB | "
            "vs distributed optimizer |", "|" + "---|" * 9]
    for cfg in ("configs/llama2_7b.yaml", "configs/llama3_8b.yaml", "configs/llama2_13b.yaml"):
        stem, base = pathlib.Path(cfg).stem, None
        for name, extra in SHARDING.items():
            r = analytic(str(REPO / cfg), 1, 1, 16, 1, 1, "full", False, loco_bits=extra["loco_bits"], extra=extra)
            base = base or r["total"]
            gib = {k: v / GIB for k, v in r.items()}
            rows.append(f"| {stem} | {name} | {gib['weights']:.1f} | {gib['grads']:.1f} | {gib['optimizer']:.1f} | "
                        f"{gib['loco_error'] + gib['loco_workspace']:.1f} | {gib['activations']:.1f} | "
                        f"{gib['total']:.3g} | x{r['total'] / base:.2f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, two settings, 2 steps")
    ap.add_argument("--analytic-only", action="store_true")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--data-cache-path", default=None)
    args = ap.parse_args()
    print("Analytic, per GPU on the first pipeline stage, each config's micro batch, LoCo 4-bit, bf16 weights, "
          "fp32 grads (budget: 92% of the card):\n")
    print(analytic_table(), flush=True)
    print("\nDistributed optimizer vs Megatron-FSDP, analytic, per GPU, DP 16 = 2 nodes x 8, full recomputation:\n")
    print(sharding_table(), flush=True)
    if args.analytic_only:
        return
    cache = args.data_cache_path or str(pathlib.Path.home() / ".cache" / "loco_megatron")
    print("\nMeasured, TP=2 on 2 CPU ranks, peak RSS per rank:\n", flush=True)
    if args.smoke:
        measured_table({"tiny": MODELS["tiny (4x128, seq 128)"]},
                       {k: SETTINGS[k] for k in ("none", "full")}, 2, cache)
    else:
        measured_table(MODELS, SETTINGS, args.iters, cache)


if __name__ == "__main__":
    main()
