"""Real megatron-core training under torchrun on CPU/gloo: layouts, LoCo, resume, NaN.

Runs that start from scratch and share a world size share one torchrun
(:func:`conftest.torchrun_runs`: start-up is most of a tiny run's cost on CPU); the
resumes and the comparison with plain megatron run in fresh processes."""

import pathlib

import torch
import pytest

from conftest import TINY, finished_run, torchrun, torchrun_runs, train_losses
from loco_megatron.checkpoint.resume import compare_layout
from loco_megatron.config import ConfigError


def _falls(losses: dict) -> bool:
    its = sorted(losses)
    return losses[its[-1]] < losses[its[0]] - 0.05


LAYOUTS = {
    "dp2": (2, []),
    "dp2_no_distopt": (2, ["--no-use-distributed-optimizer", "--no-overlap-grad-reduce"]),
    "tp2xdp2": (4, ["--tensor-model-parallel-size", "2"]),
    "pp2xdp2": (4, ["--pipeline-model-parallel-size", "2"]),
    "moe_ep2": (2, ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]),
}
"""test_layouts_train_with_loco4's layouts: id -> (ranks, flags)."""
TP_ARGS = TINY + ["--train-iters", "3", "--global-batch-size", "4", "--micro-batch-size", "2"]
QUALITY_ARGS = ["--train-iters", "60", "--log-interval", "10", "--eval-interval", "60", "--eval-iters", "2",
                "--lr-warmup-iters", "5", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "64",
                "--lr", "0.003", "--ddp-bucket-size", "40000"]
_ORIGINAL = ["--loco-quantizer", "symmetric", "--loco-scale", "absmax", "--loco-rotation", "none"]
QUALITY = {"fp": [], "loco4": ["--loco-bits", "4"], "loco2": ["--loco-bits", "2", *_ORIGINAL],
           "noef2": ["--loco-bits", "2", "--no-loco-error-feedback", *_ORIGINAL]}
"""test_loco_quality_on_tiny_default's variants: name -> flags (on QUALITY_ARGS)."""


def _runs(nproc: int) -> list[tuple[str, list[str]]]:
    """The fresh runs on ``nproc`` ranks of this module's tests: (name, full flags)."""
    runs = [(f"layout_{k}", TINY + ["--train-iters", "8", "--loco-bits", "4", *extra])
            for k, (n, extra) in LAYOUTS.items() if n == nproc]
    runs.append((f"tp{nproc // 2}", TP_ARGS + ["--tensor-model-parallel-size", str(nproc // 2)]))
    if nproc == 2:
        runs += [(f"quality_{k}", QUALITY_ARGS + extra) for k, extra in QUALITY.items()]
    return runs


@pytest.fixture(scope="module")
def shared(cache_dir, tmp_path_factory) -> dict:
    """{ranks: (runs, launch)}: one torchrun per world size (2 and 4) doing :func:`_runs`."""
    out = {}
    for nproc in (2, 4):
        runs = _runs(nproc)
        out[nproc] = runs, torchrun_runs(nproc, [], cache_dir, tmp_path_factory.mktemp(f"shared{nproc}"), runs)
    return out


def _metrics(shared: dict, nproc: int, name: str) -> list[dict]:
    runs, launch = shared[nproc]
    return finished_run(launch, runs, name)[1]


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=[k.replace("_", "-") for k in LAYOUTS])
def test_layouts_train_with_loco4(layout, shared):
    """Guards against LoCo breaking any parallel layout (dense/expert buckets, PP stages,
    TP shards, the non-distributed-optimizer all-gather): loss falls, every gradient
    byte is sent compressed, at the 4-bit payload ratio."""
    nproc, extra = LAYOUTS[layout]
    metrics = _metrics(shared, nproc, f"layout_{layout}")
    assert _falls(train_losses(metrics))
    last = [m for m in metrics if "comm/compression_ratio" in m][-1]
    assert last["comm/compressed_fraction"] == pytest.approx(1.0)
    # 4 bits + one fp32 scale per 256 elements, over 32-bit gradient buffers (+ shard padding);
    # without the distributed optimizer each rank also hands its reduced fp32 shard (1/DP of
    # the buffer) to the all-gather.
    gather = 0.5 if "--no-use-distributed-optimizer" in extra else 0.0
    assert 4.125 / 32 + gather <= last["comm/compression_ratio"] <= 4.125 / 32 * 1.05 + gather


def test_loco_bits_0_is_bit_identical_to_plain_megatron(cache_dir, tmp_path):
    """Guards against the grad-sync hook perturbing megatron's own reduce-scatter, and the
    parameter-gather hook (--param-gather-bits 0) megatron's own all-gather."""
    args = TINY + ["--train-iters", "4", "--loco-bits", "0", "--param-gather-bits", "0"]
    _, ours = torchrun(2, args, cache_dir, tmp_path, name="ours")
    _, plain = torchrun(2, args, cache_dir, tmp_path, script="tests/plain_megatron.py", name="plain")
    assert train_losses(ours) == train_losses(plain)


def test_tp2_matches_tp1(shared):
    """Guards against TP sharding changing the model (init or maths): same seed and data,
    same losses within float tolerance."""
    a, b = train_losses(_metrics(shared, 2, "tp1")), train_losses(_metrics(shared, 4, "tp2"))
    assert a.keys() == b.keys()
    for it in a:
        assert a[it] == pytest.approx(b[it], rel=1e-4)


def test_resume_with_loco_is_bit_exact(cache_dir, tmp_path):
    """Guards against any state (model, distributed-optimizer shards, Adam step, LR,
    RNG, data position, LoCo error buffers and reset counter) missing from checkpoints;
    and against the end-of-run summary (console block, ``summary/...`` record) miscounting
    iterations, tokens or bytes, naming the wrong checkpoint, or missing the checkpoint-load
    start-up line."""
    args = TINY + ["--train-iters", "8", "--lr-decay-iters", "8", "--loco-bits", "4",
                   "--loco-reset-interval", "3"]
    ck = tmp_path / "ck"
    # The uninterrupted run writes the checkpoint it is compared with (one run fewer).
    proc, full = torchrun(2, args + ["--save", str(ck), "--save-interval", "4"], cache_dir, tmp_path, name="full")
    summary = proc.stdout[proc.stdout.index("run summary: "):].splitlines()
    assert summary[0].startswith("run summary: 8 iterations this run, now at iteration 8; 4,096 tokens "), summary
    assert summary[-1] == f"  last checkpoint: {ck / 'iter_0000008'}", summary
    record = full[-1]
    assert record["summary/iteration"] == 8 and record["summary/train_loss"] == train_losses(full)[8]
    # Every rank's bytes of every step (log interval 1: each record is one step, mean over 2 ranks).
    for key in ("grad_bytes_sent", "grad_bytes_uncompressed"):
        assert record[f"summary/{key}"] == pytest.approx(2 * sum(m[f"comm/{key}"] for m in full if f"comm/{key}" in m))
    ratio = record["summary/grad_bytes_sent"] / record["summary/grad_bytes_uncompressed"]
    assert 4.125 / 32 <= ratio <= 4.125 / 32 * 1.05
    assert f"(x{ratio:.3f}), all 2 ranks together" in proc.stdout
    (ck / "latest_checkpointed_iteration.txt").write_text("4\n")  # resume from iteration 4
    proc, resumed = torchrun(2, args + ["--load", str(ck)], cache_dir, tmp_path, name="resumed")
    assert proc.stdout.index(f"loading checkpoint {ck / 'iter_0000004'}\n") < proc.stdout.index("resuming from")
    assert "run summary: 4 iterations this run, now at iteration 8 (resumed at 4); 2,048 tokens (4,096 in all)" \
        in proc.stdout
    assert "  last checkpoint: none saved (no --save)" in proc.stdout
    a, b = train_losses(full), train_losses(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    assert all(a[it] == b[it] for it in b), (a, b)


def test_overlap_param_gather_matches_and_resumes(cache_dir, tmp_path):
    """Guards against stale weights with --overlap-param-gather: the deferred all-gather
    must give the same losses as the synchronous one, and a checkpoint written while a
    gather is pending must hold the updated weights (resume continues identically). Also
    against --bf16's fp32 torch norms: torch's rms_norm warned of the dtype mismatch on
    every rank, and their buffer of their own made megatron's deferred all-gathers run out
    of forward order (a warning per rank); a --ckpt-format torch checkpoint from before
    (its norms in a buffer of their own) is refused in one line."""
    args = TINY + ["--train-iters", "6", "--lr-decay-iters", "6", "--loco-bits", "4", "--bf16", "--ckpt-format", "torch"]
    _, sync = torchrun(2, args + ["--save", str(tmp_path / "ck_sync"), "--save-interval", "3"], cache_dir,
                       tmp_path, name="sync")
    ck = str(tmp_path / "ck")
    over = args + ["--overlap-param-gather"]
    proc, first = torchrun(2, over + ["--train-iters", "3", "--save", ck], cache_dir, tmp_path, name="first")
    for warning in ("Mismatch dtype between input and weight", "all-gather operation has already been dispatched"):
        assert warning not in proc.stdout + proc.stderr
    _, resumed = torchrun(2, over + ["--load", ck], cache_dir, tmp_path, name="resumed")
    a, b = train_losses(sync), {**train_losses(first), **train_losses(resumed)}
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    assert all(a[it] == b[it] for it in a), (a, b)
    assert [m for m in resumed if "comm/param_gather_s" in m][-1]["comm/param_gather_s"] > 0
    for rank in (0, 1):
        name = f"iter_0000003/rank_0000{rank}.pt"
        want = torch.load(tmp_path / "ck_sync" / name, weights_only=False)["model"][0]
        got = torch.load(tmp_path / "ck" / name, weights_only=False)["model"][0]
        for key, t in want.items():
            if torch.is_tensor(t) and t.is_floating_point():
                assert torch.equal(t, got[key]), (rank, key)
    layout = torch.load(tmp_path / "ck" / "iter_0000003" / "rank_00000.pt", weights_only=False)["layout"]
    assert layout["bf16_norms"] is True and all(
        t.dtype == torch.bfloat16 for t in got.values() if torch.is_tensor(t) and t.is_floating_point())
    older = {k: v for k, v in layout.items() if k != "bf16_norms"}
    with pytest.raises(ConfigError, match=r"^--load: ck was saved with a different model/parallel layout "
                                          r"\(saved vs now: \{'bf16_norms': \(None, True\)\}\)$"):
        compare_layout(older, layout, pathlib.Path("ck"))


def test_nan_on_one_rank_skips_step_and_keeps_error(cache_dir, tmp_path):
    """Guards against a NaN gradient updating the weights or entering LoCo's error."""
    ck = tmp_path / "ck"
    args = TINY + ["--train-iters", "4", "--loco-bits", "4", "--inject-nan", "4:1",
                   "--save", str(ck), "--save-interval", "1", "--ckpt-format", "torch"]
    _, metrics = torchrun(2, args, cache_dir, tmp_path)
    assert [m for m in metrics if "train/skipped_iters" in m][-1]["train/skipped_iters"] == 1
    before = torch.load(ck / "iter_0000003" / "rank_00001.pt", weights_only=False)
    after = torch.load(ck / "iter_0000004" / "rank_00001.pt", weights_only=False)
    for key, sd in before["loco"].items():
        assert torch.equal(sd["error"], after["loco"][key]["error"]), key
        assert torch.equal(sd["error_scales"], after["loco"][key]["error_scales"]), key
        assert torch.isfinite(after["loco"][key]["error_scales"]).all()
    for name, t in before["model"][0].items():
        if torch.is_tensor(t) and t.is_floating_point():
            assert torch.equal(t, after["model"][0][name]), name


def test_loco_quality_on_tiny_default(shared):
    """Guards against compensation that does not work: LoCo 4-bit ends near full
    precision, and 2-bit without error feedback ends clearly worse than 2-bit LoCo (both
    with the original symmetric absmax quantiser, where feedback matters most)."""
    final = {}
    for name in QUALITY:
        metrics = _metrics(shared, 2, f"quality_{name}")
        final[name] = [m["eval/lm_loss"] for m in metrics if "eval/lm_loss" in m][-1]
    print("final eval loss:", final)
    assert final["loco4"] <= final["fp"] * 1.02
    assert final["noef2"] > final["loco2"] + 0.05
