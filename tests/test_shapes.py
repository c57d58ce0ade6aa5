"""Real model shapes under torchrun (CPU/gloo, real megatron-core): activation
recomputation, sequence parallelism, virtual pipeline stages, with and without LoCo."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY, torchrun, train_losses

# Four layers: PP=2 x two virtual stages = one layer per model chunk.
SHAPE = list(TINY)
SHAPE[SHAPE.index("--num-layers") + 1] = "4"


def _falls(losses: dict) -> bool:
    its = sorted(losses)
    return losses[its[-1]] < losses[its[0]] - 0.02


def _close(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys()
    for it in a:
        assert a[it] == pytest.approx(b[it], rel=rel), (it, a, b)


def test_sequence_parallel_and_recompute_twins(cache_dir, tmp_path):
    """Guards against sequence parallelism changing the maths (norm weights' gradients not
    summed over the TP group, wrong sequence scatter/gather) and against recomputation
    changing anything but memory: SP matches its non-SP twin within fp32 tolerance, full
    recomputation reproduces the losses exactly (LoCo off)."""
    args = SHAPE + ["--train-iters", "4", "--tensor-model-parallel-size", "2"]
    _, base = torchrun(2, args, cache_dir, tmp_path, name="base")
    _, sp = torchrun(2, args + ["--sequence-parallel", "--recompute-granularity", "selective"],
                     cache_dir, tmp_path, name="sp")
    _, full = torchrun(2, args + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                  "--recompute-num-layers", "2"], cache_dir, tmp_path, name="full")
    a = train_losses(base)
    _close(a, train_losses(sp), 1e-5)
    assert train_losses(full) == a


def test_virtual_pipeline_matches_plain_pipeline(cache_dir, tmp_path):
    """Guards against the interleaved schedule or the chunk construction (layer offsets,
    first/last chunk, per-chunk grad sync) differing from the plain PP=2 model: same seed,
    same losses within fp32 tolerance (LoCo off)."""
    args = SHAPE + ["--train-iters", "4", "--pipeline-model-parallel-size", "2"]
    _, pp = torchrun(2, args, cache_dir, tmp_path, name="pp")
    _, vpp = torchrun(2, args + ["--num-layers-per-virtual-pipeline-stage", "1"], cache_dir, tmp_path, name="vpp")
    _close(train_losses(pp), train_losses(vpp), 1e-5)


def _all_compressed(metrics) -> None:
    last = [m for m in metrics if "comm/compressed_fraction" in m][-1]
    assert last["comm/compressed_fraction"] == pytest.approx(1.0)


def test_loco4_sequence_parallel_tp2xdp2(cache_dir, tmp_path):
    """Guards against LoCo missing the gradients of sequence-parallel layers or breaking
    with selective recomputation: TP2 x DP2, loss falls, every byte compressed."""
    _, metrics = torchrun(4, SHAPE + ["--train-iters", "6", "--loco-bits", "4", "--tensor-model-parallel-size",
                                      "2", "--sequence-parallel", "--recompute-granularity", "selective"],
                          cache_dir, tmp_path)
    assert _falls(train_losses(metrics))
    _all_compressed(metrics)


def test_loco4_virtual_pipeline_pp2xdp2_resumes_bit_exact(cache_dir, tmp_path):
    """Guards against a model chunk's buckets going without LoCo (or its error state
    missing from checkpoints) under the interleaved schedule with full recomputation:
    PP2 x DP2 x two virtual stages, loss falls, every byte compressed, both chunks'
    compressors checkpointed, resume bit-exact."""
    args = SHAPE + ["--train-iters", "6", "--lr-decay-iters", "6", "--loco-bits", "4",
                    "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                    "--recompute-granularity", "full", "--recompute-method", "block"]
    _, full = torchrun(4, args, cache_dir, tmp_path, name="full")
    ck = tmp_path / "ck"
    torchrun(4, args + ["--train-iters", "3", "--save", str(ck), "--ckpt-format", "torch"], cache_dir, tmp_path,
             name="first")
    _, resumed = torchrun(4, args + ["--load", str(ck)], cache_dir, tmp_path, name="resumed")
    a, b = train_losses(full), train_losses(resumed)
    assert _falls(a)
    _all_compressed(full)
    assert sorted(b) == [4, 5, 6] and all(a[it] == b[it] for it in b), (a, b)
    saved = torch.load(ck / "iter_0000003" / "rank_00000.pt", weights_only=False)
    assert len(saved["model"]) == 2
    assert {k.split(".")[1] for k in saved["loco"]} == {"chunk0", "chunk1"}


def test_short_run_default_config_summary_profile_tensorboard(cache_dir, tmp_path):
    """Guards against: the default warmup making short runs fail (--train-iters below
    the warmup); the analytic parameter count disagreeing with megatron's model; MFU
    missing from the metrics; the profiler trace missing a named range; TensorBoard
    getting nothing; a validation error printed once per rank."""
    # Two ranks: with one, nothing is compressed (a group of one rank sends nothing), so the
    # LoCo ranges would be absent.
    proc, metrics = torchrun(2, ["--train-iters", "2", "--eval-iters", "1", "--log-interval", "1",
                                 "--loco-bits", "4", "--peak-tflops", "2.0", "--profile", "--profile-step-start",
                                 "2", "--profile-step-end", "2", "--profile-dir", str(tmp_path / "prof"),
                                 "--tensorboard-dir", str(tmp_path / "tb")], cache_dir, tmp_path)
    assert sorted(train_losses(metrics)) == [1, 2]
    total, here = re.search(r"model: ([\d,]+) parameters .*, ([\d,]+) on rank 0", proc.stdout).groups()
    assert total == here  # every rank (DP only) holds the whole model
    last = [m for m in metrics if "train/lm_loss" in m][-1]  # (the end-of-run summary record comes after)
    assert last["train/mfu"] == pytest.approx(last["train/tflops_per_device"] / 2.0)
    trace = json.loads((tmp_path / "prof" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"forward", "backward", "optimizer_step", "loco/compress", "loco/decompress", "grad_sync/launch",
            "grad_sync/wait", "param_gather"} <= names
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "pretrain_gpt.py"), "--sequence-parallel"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith("pretrain_gpt.py: error:")]
    assert lines == ["pretrain_gpt.py: error: --sequence-parallel: needs --tensor-model-parallel-size > 1"]
