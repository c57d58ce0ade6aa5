#!/usr/bin/env python3
"""Checkpoint cost per format: save and load time, bytes on disk per parameter, and how
long the training loop is blocked by a synchronous vs an --async-save save.

    python benchmarks/checkpoint.py --smoke    # tiny model, torch vs torch_dist async, one save each
    python benchmarks/checkpoint.py            # tiny + larger CPU model, 3 saves each

Each variant is a real run of ``pretrain_gpt.py`` on 2 CPU ranks (DP2, distributed
optimizer) saving every 2 steps, then a run that only loads the last checkpoint. Times
come from the runs' own metrics (``ckpt/blocking_s``: training loop blocked per save;
``ckpt/write_s``: from the save's start until it is committed; ``ckpt/load_s``); means
over the saves. Ratios are to the ``torch`` format (per-rank files) of the same model.
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

from loco_megatron.cli import make_config  # noqa: E402
from loco_megatron.model import padded_vocab_size  # noqa: E402
from loco_megatron.training.flops import parameter_count  # noqa: E402

MODELS = {
    "tiny (2x64)": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"],
    "larger (4x512)": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
                       "--seq-length", "128"],
}
VARIANTS = {
    "torch": ["--ckpt-format", "torch"],
    "torch_dist": ["--ckpt-format", "torch_dist"],
    "torch_dist async": ["--ckpt-format", "torch_dist", "--async-save"],
}


def _run(args: list, metrics: pathlib.Path, cache: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "pretrain_gpt.py"), *args, "--micro-batch-size", "2", "--global-batch-size", "4",
           "--lr-warmup-iters", "1", "--eval-interval", "0", "--log-interval", "100",
           "--data-cache-path", cache, "--metrics-jsonl", str(metrics)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values)


def measure(model_args: list, variant: list, iters: int, cache: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp, ck = pathlib.Path(tmp), pathlib.Path(tmp) / "ck"
        args = [*model_args, *variant, "--train-iters", str(iters), "--lr-decay-iters", str(iters)]
        saved = _run(args + ["--save", str(ck), "--save-interval", "2"], tmp / "save.jsonl", cache)
        last = sorted(ck.glob("iter_*"))[-1]
        size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
        loaded = _run(args + ["--load", str(ck)], tmp / "load.jsonl", cache)
    values = saved[0]["config"]
    config = make_config({k: v for k, v in values.items() if k not in (
        "world_size", "data_parallel_size", "device", "resumed_from_iteration")})
    params = parameter_count(config.model, padded_vocab_size(values["vocab_size"], 1))
    return {"blocking_s": _mean(saved, "ckpt/blocking_s"), "write_s": _mean(saved, "ckpt/write_s"),
            "load_s": _mean(loaded, "ckpt/load_s"), "bytes_per_param": size / params, "params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, one save per variant")
    ap.add_argument("--data-cache-path", default=None)
    args = ap.parse_args()
    cache = args.data_cache_path or str(pathlib.Path.home() / ".cache" / "loco_megatron")
    models = {k: v for k, v in MODELS.items() if k.startswith("tiny")} if args.smoke else MODELS
    iters = 2 if args.smoke else 6
    variants = {k: VARIANTS[k] for k in ("torch", "torch_dist async")} if args.smoke else VARIANTS
    rows = ["| model | format | blocked per save (s) | vs torch | write (s) | vs torch | load (s) | vs torch "
            "| bytes/param | vs torch |", "|---|---|---|---|---|---|---|---|---|---|"]
    print(f"2 CPU ranks (DP2), {iters} steps, a save every 2 steps; means over the saves\n")
    print("\n".join(rows), flush=True)
    for name, model_args in models.items():
        base = None
        for variant, extra in variants.items():
            r = measure(model_args, extra, iters, cache)
            base = base or r
            rows.append(f"| {name} ({r['params'] / 1e6:.2f}M params) | {variant} | {r['blocking_s']:.3f} | "
                        f"{r['blocking_s'] / base['blocking_s']:.2f} | {r['write_s']:.3f} | "
                        f"{r['write_s'] / base['write_s']:.2f} | {r['load_s']:.3f} | {r['load_s'] / base['load_s']:.2f} | "
                        f"{r['bytes_per_param']:.2f} | {r['bytes_per_param'] / base['bytes_per_param']:.2f} |")
            print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
