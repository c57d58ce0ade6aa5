"""Shared helpers: real multi-process runs of pretrain_gpt.py under torchrun (gloo, CPU)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

# Without a GPU, Triton kernels run in Triton's interpreter, which must be chosen before
# triton is first imported in this process (megatron-core may import it early).
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

REPO = pathlib.Path(__file__).resolve().parent.parent

# A model small enough that a few steps take seconds on 2 CPU cores.
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "2",
        "--eval-interval", "0", "--log-interval", "1", "--ddp-bucket-size", "40000"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One built-in corpus (tokenizer + .bin/.idx) for the whole session."""
    return str(tmp_path_factory.mktemp("cache"))


def read_metrics(path) -> list[dict]:
    p = pathlib.Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def train_losses(metrics: list[dict]) -> dict[int, float]:
    return {m["iteration"]: m["train/lm_loss"] for m in metrics if "train/lm_loss" in m}


def torchrun_command(nproc: int, args: list[str], cache: str, metrics: pathlib.Path,
                     script: str = "pretrain_gpt.py", launcher_args: tuple = ()) -> tuple[list[str], dict]:
    """(argv, env) of a local torchrun of ``script`` writing ``metrics``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *launcher_args, str(REPO / script), *args, "--data-cache-path", cache, "--metrics-jsonl", str(metrics)]
    return cmd, dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def torchrun(nproc: int, args: list[str], cache: str, tmp_path: pathlib.Path, script: str = "pretrain_gpt.py",
             timeout: int = 600, name: str = "run") -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``script`` on ``nproc`` local ranks; returns the process and its metrics."""
    metrics = tmp_path / f"{name}.jsonl"
    cmd, env = torchrun_command(nproc, args, cache, metrics, script)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise AssertionError(f"{' '.join(cmd)} failed with {proc.returncode}:\n{tail}")
    return proc, read_metrics(metrics)
