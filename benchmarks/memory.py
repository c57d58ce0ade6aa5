#!/usr/bin/env python3
"""Memory per rank: measured on CPU for small models, analytic for the GPU shapes.

    python benchmarks/memory.py --smoke          # seconds: tiny model, two settings
    python benchmarks/memory.py                  # measured table (tiny + larger CPU model)
    python benchmarks/memory.py --analytic-only  # the 7B / 13B / 8x7B layout table only

Measured: peak memory per rank (``mem/peak_bytes``: peak RSS on CPU, so it includes
the Python process and megatron-core, ~hundreds of MB) and step time, for activation
recomputation none / selective / full and sequence parallelism on / off, TP=2 on 2 ranks.

Analytic (per GPU, bytes): bf16 weights (2/param), fp32 gradient buffer (4/param; 2 with
--grad-reduce-in-bf16), distributed-optimizer state (fp32 main params + Adam moments,
12/param / DP), LoCo error (int8 + one fp32 scale per block: 1 + 4/block per gradient
element) and workspace (two fp32 copies of the largest bucket plus its send/receive
payloads), activations of the micro batches in flight (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198:
per layer and micro batch ``s*b*h*(34 + 5*a*s/h)`` bytes at 16 bits with no parallelism;
with TP t and sequence parallelism ``s*b*h*(34/t + 5*a*s/(h*t))``, selective
recomputation drops the ``5as/h`` term, full recomputation keeps ``2*s*b*h/t`` per
layer plus one whole layer being recomputed; 1F1B keeps PP micro batches in flight on the first stage, interleaving adds
``(PP-1)/(PP*VP)``). The formula is the paper's GPT layer (4h MLP); for SwiGLU/GQA it is
an estimate. Not counted: the CUDA context and allocator fragmentation (add ~5-10%).
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
from loco_megatron.model import padded_vocab_size  # noqa: E402
from loco_megatron.training.flops import parameter_count  # noqa: E402

GIB = 2**30
BUCKET = 40_000_000  # megatron-core's default DDP bucket (elements)

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
             micro_batch: int, loco_bits: int = 4, block: int = 256) -> dict:
    """Bytes per GPU on the first pipeline stage (the fullest) for one layout."""
    values = load_yaml_config(config_file)
    values.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                  micro_batch_size=micro_batch)
    m = make_config(values).model
    vocab = padded_vocab_size(32000, tp)
    total = parameter_count(m, vocab)
    if m.num_experts:
        expert_params = m.num_layers * m.num_experts * 3 * m.hidden_size * (m.moe_ffn_hidden_size or m.ffn_hidden_size)
    else:
        expert_params = 0
    dense = total - expert_params
    # Dense weights split by TP x PP, experts additionally by EP; the expert optimizer
    # state is sharded over the expert-data-parallel group (DP / EP).
    per_gpu = dense / (tp * pp) + expert_params / (tp * pp * ep)
    optimizer = 12 * (dense / (tp * pp) / dp + expert_params / (tp * pp * ep) / max(dp // ep, 1))
    s, b, h, a, L = m.seq_length, micro_batch, m.hidden_size, m.num_attention_heads, m.num_layers
    t = tp
    attn = 0 if recompute == "selective" else 5 * a * s / (h * t)
    stored = s * b * h * ((34 / t) if sp else (10 + 24 / t)) + s * b * h * attn
    in_flight = pp * (1 + ((pp - 1) / (pp * vp) if vp > 1 else 0))
    if recompute == "full":  # layer inputs only, plus the one layer being recomputed
        full_layer = s * b * h * ((34 / t) if sp else (10 + 24 / t)) + s * b * h * 5 * a * s / (h * t)
        activations = 2 * s * b * h / (t if sp else 1) * (L / pp) * in_flight + full_layer
    else:
        activations = stored * (L / pp) * in_flight
    out = {
        "weights": 2 * per_gpu,
        "grads": 4 * per_gpu,
        "optimizer": optimizer,
        "loco_error": per_gpu * (1 + 4 / block) if loco_bits else 0,
        "loco_workspace": (2 * 4 * BUCKET + 2 * BUCKET * (loco_bits / 8 + 4 / block)) if loco_bits else 0,
        "activations": activations,
    }
    out["total"] = sum(out.values())
    out["params"] = total
    return out


LAYOUTS = {
    "configs/llama2_7b.yaml": [
        (1, 1, 8, 1, 1, "full", False), (2, 1, 4, 1, 1, "selective", True), (4, 1, 2, 1, 1, "none", True),
        (4, 1, 2, 1, 1, "selective", True), (2, 2, 2, 1, 2, "selective", True)],
    "configs/llama2_13b.yaml": [
        (2, 1, 4, 1, 1, "selective", True), (4, 1, 2, 1, 1, "selective", True), (8, 1, 1, 1, 1, "none", True),
        (4, 2, 1, 1, 2, "selective", True), (2, 2, 2, 1, 2, "full", True)],
    "configs/mixtral_8x7b.yaml": [
        (2, 4, 8, 8, 1, "selective", True), (2, 4, 8, 8, 2, "selective", True), (1, 4, 16, 8, 1, "full", False),
        (2, 8, 4, 4, 2, "selective", True), (4, 4, 4, 4, 1, "selective", True)],
}


def analytic_table() -> str:
    rows = ["| config | TP | PP | DP | EP | VP | recompute | SP | params (B) | weights | grads | optimizer | "
            "LoCo error + workspace | activations | total GiB | fits 80 GB | fits 141 GB |",
            "|" + "---|" * 17]
    for cfg, layouts in LAYOUTS.items():
        for tp, pp, dp, ep, vp, rc, sp in layouts:
            r = analytic(str(REPO / cfg), tp, pp, dp, ep, vp, rc, sp, micro_batch=1)
            gib = {k: v / GIB for k, v in r.items()}
            rows.append(
                f"| {pathlib.Path(cfg).stem} | {tp} | {pp} | {dp} | {ep} | {vp} | {rc} | {'on' if sp else 'off'} | "
                f"{r['params'] / 1e9:.2f} | {gib['weights']:.1f} | {gib['grads']:.1f} | {gib['optimizer']:.1f} | "
                f"{gib['loco_error'] + gib['loco_workspace']:.1f} | {gib['activations']:.1f} | "
                f"{gib['total']:.1f} | {'yes' if r['total'] < 0.92 * 80e9 else 'no'} | "
                f"{'yes' if r['total'] < 0.92 * 141e9 else 'no'} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, two settings, 2 steps")
    ap.add_argument("--analytic-only", action="store_true")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--data-cache-path", default=None)
    args = ap.parse_args()
    print("Analytic, per GPU on the first pipeline stage, micro batch 1, LoCo 4-bit, bf16 weights, "
          "fp32 grads (budget: 92% of the card):\n")
    print(analytic_table(), flush=True)
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
