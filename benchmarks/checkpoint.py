#!/usr/bin/env python3
"""Checkpoint cost per format: save and load time, bytes on disk per parameter, and how
long the training loop is blocked by a synchronous vs an --async-save save; then the
torch_dist save's and load's peak memory per rank next to the rank's own optimizer state.

    python benchmarks/checkpoint.py --smoke    # tiny model, torch vs torch_dist async, one save each
    python benchmarks/checkpoint.py            # tiny + larger CPU model, 3 saves each
    python benchmarks/checkpoint.py --memory   # peak memory per rank, larger model, DP2 and DP4
                                               # (--smoke --memory: tiny model, DP2)

Each variant is a real run of ``pretrain_gpt.py`` on 2 CPU ranks (DP2, distributed
optimizer) saving every 2 steps, then a run that only loads the last checkpoint. Times
come from the runs' own metrics (``ckpt/blocking_s``: training loop blocked per save;
``ckpt/write_s``: from the save's start until it is committed; ``ckpt/load_s``); means
over the saves. Ratios are to the ``torch`` format (per-rank files) of the same model.

Memory: the larger model (the tiny one with --smoke) under DP2 and DP4 saves once with
torch_dist (synchronous), then a run loads it. Each rank samples its own resident set
(every millisecond, plus the process's peak from getrusage when the call set a new one)
during ``Checkpointer.save`` and ``Checkpointer.load``; "extra" is that peak minus the
resident set just before the call. "own" is the rank's share of the distributed
optimizer's state (fp32 main params + two Adam moments of the elements it owns). Writer
processes megatron may fork are not counted. The bound is the one the checkpoint code
aims at: 2 x own + 64 MiB. On CUDA the device peak is reported too (the allocator's
``max_memory_allocated`` during the call minus what was allocated before it; "n/a" on
CPU, where host and device are one), and "state copied by loco" is the bytes the code
that builds the optimizer's save state cloned (``Tensor.clone`` called from
``checkpoint/dist_optimizer.py`` or ``training/state.py``): the staging is megatron's
writer's (see loco_megatron/checkpoint/dist_optimizer.py), so it is 0.
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


def _run(args: list, metrics: pathlib.Path, cache: str, nproc: int = 2, script: tuple = ("pretrain_gpt.py",)
         ) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / script[0]), *script[1:], *args, "--micro-batch-size", "2", "--global-batch-size", str(2 * nproc),
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
        "world_size", "data_parallel_size", "device", "resumed_from_iteration", "variant")})
    params = parameter_count(config.model, padded_vocab_size(values["vocab_size"], 1))
    return {"blocking_s": _mean(saved, "ckpt/blocking_s"), "write_s": _mean(saved, "ckpt/write_s"),
            "load_s": _mean(loaded, "ckpt/load_s"), "bytes_per_param": size / params, "params": params}


def _probe(out: str, argv: list) -> None:
    """Under torchrun: pretrain_gpt.py with Checkpointer.save/load measured (see the docstring)."""
    import resource
    import threading
    import warnings

    import psutil
    import torch
    import torch.distributed as dist

    from loco_megatron.checkpoint import Checkpointer, dist_optimizer
    from loco_megatron.cli import main_config
    from loco_megatron.optimizer import sub_optimizers
    from loco_megatron.training.trainer import train

    warnings.filterwarnings("ignore")
    proc, record = psutil.Process(), {}

    def measured(name: str, fn):
        def wrapper(self, arg, stateful):
            own = sum(dist_optimizer.own_state_bytes(o) for o in sub_optimizers(stateful["optimizer"].optimizer)
                      if hasattr(o, "gbuf_ranges"))
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            device_before = torch.cuda.memory_allocated() if cuda else 0
            before, max_before = proc.memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak, done = [before], threading.Event()

            def sample():
                while not done.wait(0.001):
                    peak[0] = max(peak[0], proc.memory_info().rss)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                return fn(self, arg, stateful)
            finally:
                done.set()
                sampler.join()
                max_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                if max_after > max_before:  # a new lifetime peak (KiB on Linux): exact, not sampled
                    peak[0] = max(peak[0], max_after * 1024)
                device = torch.cuda.max_memory_allocated() - device_before if cuda else None
                record[name] = {"extra": peak[0] - before, "own": own, "before": before, "device_extra": device}
                pathlib.Path(f"{out}.rank{dist.get_rank()}.json").write_text(json.dumps(record))
        return wrapper

    # The optimizer state's staging: our two places that build its save state.
    staging_code = (str(REPO / "loco_megatron" / "checkpoint" / "dist_optimizer.py"),
                    str(REPO / "loco_megatron" / "training" / "state.py"))
    cloned = [0]
    clone = torch.Tensor.clone

    def counted_clone(self, *args, **kwargs):
        if sys._getframe(1).f_code.co_filename in staging_code:
            cloned[0] += self.numel() * self.element_size()
        return clone(self, *args, **kwargs)

    def with_clones(fn):
        def wrapper(self, arg, stateful):
            cloned[0] = 0
            torch.Tensor.clone = counted_clone
            try:
                return fn(self, arg, stateful)
            finally:
                torch.Tensor.clone = clone
                record["save"]["cloned"] = cloned[0]
                pathlib.Path(f"{out}.rank{dist.get_rank()}.json").write_text(json.dumps(record))
        return wrapper

    Checkpointer.save = with_clones(measured("save", Checkpointer.save))
    Checkpointer.load = measured("load", Checkpointer.load)
    config, env = main_config(argv)
    train(config, env)


def measure_memory(model_args: list, dp: int, cache: str) -> list[dict]:
    """Per rank: {"save"/"load": {"extra", "own", "before"}} in bytes (sync torch_dist)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp, ck = pathlib.Path(tmp), pathlib.Path(tmp) / "ck"
        args = [*model_args, "--ckpt-format", "torch_dist", "--train-iters", "2", "--lr-decay-iters", "2"]
        for phase, extra in (("save", ["--save", str(ck), "--save-interval", "2"]), ("load", ["--load", str(ck)])):
            _run(args + extra, tmp / f"{phase}.jsonl", cache, dp,
                 ("benchmarks/checkpoint.py", "--probe", str(tmp / phase)))
        return [{**json.loads((tmp / f"save.rank{r}.json").read_text()),
                 **json.loads((tmp / f"load.rank{r}.json").read_text())} for r in range(dp)]


def memory_table(models: dict, cache: str, dps: tuple) -> None:
    mib = 2 ** 20
    print("\nPeak extra resident memory per rank during a torch_dist save / load (synchronous), "
          "next to the rank's own optimizer state\n")
    print("| model | layout | rank | own optimizer state (MiB) | save: peak extra (MiB) | save / own | "
          "load: peak extra (MiB) | load / own | bound 2 x own + 64 (MiB) | save extra (B/param) | "
          "load extra (B/param) | save: device peak extra (MiB) | load: device peak extra (MiB) | "
          "save: state copied by loco (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name, model_args in models.items():
        for dp in dps:
            params = None
            for rank, r in enumerate(measure_memory(model_args, dp, cache)):
                own, save, load = r["save"]["own"], r["save"]["extra"], r["load"]["extra"]
                params = params or _params(model_args)
                print(f"| {name} ({params / 1e6:.2f}M params) | DP{dp} | {rank} | {own / mib:.1f} | "
                      f"{save / mib:.1f} | {save / own:.2f} | {load / mib:.1f} | {load / own:.2f} | "
                      f"{(2 * own + 64 * mib) / mib:.1f} | {save / params:.1f} | {load / params:.1f} | "
                      f"{_mib(r['save']['device_extra'])} | {_mib(r['load']['device_extra'])} | "
                      f"{r['save']['cloned'] / mib:.1f} |", flush=True)


def _mib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2 ** 20:.1f}"


def _params(model_args: list) -> int:
    values = dict(zip([a.lstrip("-").replace("-", "_") for a in model_args[::2]], model_args[1::2]))
    config = make_config({k: int(v) for k, v in values.items()})
    return parameter_count(config.model, padded_vocab_size(config.data.vocab_size, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, one save per variant")
    ap.add_argument("--data-cache-path", default=None)
    ap.add_argument("--memory", action="store_true", help="the memory table instead of the timings")
    args = ap.parse_args()
    cache = args.data_cache_path or str(pathlib.Path.home() / ".cache" / "loco_megatron")
    models = {k: v for k, v in MODELS.items() if k.startswith("tiny")} if args.smoke else MODELS
    iters = 2 if args.smoke else 6
    variants = {k: VARIANTS[k] for k in ("torch", "torch_dist async")} if args.smoke else VARIANTS
    rows = ["| model | format | blocked per save (s) | vs torch | write (s) | vs torch | load (s) | vs torch "
            "| bytes/param | vs torch |", "|---|---|---|---|---|---|---|---|---|---|"]
    memory_models = {k: v for k, v in MODELS.items() if k.startswith("tiny" if args.smoke else "larger")}
    dps = (2,) if args.smoke else (2, 4)
    if args.memory:
        memory_table(memory_models, cache, dps)
        return
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
    if sys.argv[1:2] == ["--probe"]:
        _probe(sys.argv[2], sys.argv[3:])
    else:
        main()
