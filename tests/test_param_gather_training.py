"""--param-gather-bits under torchrun on CPU/gloo with real megatron-core: identical
parameters on every data-parallel rank, bounded error, overlap, resume, NaN.

Layouts covered (a small subset, chosen to hit every code path once): DP2 fp32 (main
params aliased to the model buffer) with LoCo 4-bit and a NaN step; TP2xDP2 bf16
(separate fp32 main params) with LoCo off; MoE with EP2 on 4 ranks (expert bucket
groups gathered over the expert-data-parallel group); DP2 with --overlap-param-gather
for overlap, checkpoint and resume.
"""

import json
import re

import pytest
import torch

from conftest import TINY, torchrun, train_losses

# (ranks, bits, extra args, steps); steps >= 30 for the boundedness check.
CASES = {
    "dp2-fp32-4bit-loco4-nan": (2, 4, ["--loco-bits", "4", "--inject-nan", "3:1"], 30),
    "tp2xdp2-bf16-8bit": (4, 8, ["--tensor-model-parallel-size", "2", "--bf16"], 5),
    "moe-ep2-dp4-4bit-loco4": (4, 4, ["--num-experts", "4", "--moe-router-topk", "2",
                                      "--expert-model-parallel-size", "2", "--loco-bits", "4"], 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_params_identical_across_data_parallel_ranks(case, cache_dir, tmp_path):
    """Guards against ranks drifting apart (an owner applying its exact update instead of
    the quantised one, a missed shard or bucket group, expert groups gathered over the
    wrong group), against error that accumulates over steps, against a skipped (NaN)
    step sending or keeping a stale update, and against wrong byte accounting."""
    nproc, bits, extra, steps = CASES[case]
    proc, metrics = torchrun(nproc, TINY + ["--train-iters", str(steps), "--param-gather-bits", str(bits), *extra],
                             cache_dir, tmp_path, script="tests/param_identity.py")
    checks = re.findall(r"IDENTICAL rank=(\d+) iter=(\d+) dense=(\w+) expert=(\w+)", proc.stdout)
    assert len(checks) == nproc * (steps - 1)
    assert all(d == "True" and e == "True" for _, _, d, e in checks), [c for c in checks if "False" in c]
    losses = train_losses(metrics)
    its = sorted(losses)
    assert losses[its[-1]] < losses[its[0]] - 0.02  # a few steps of a tiny model: it learns
    last = [m for m in metrics if "comm/param_compression_ratio" in m][-1]
    elem_bits = 16 if "--bf16" in extra else 32
    assert bits / elem_bits < last["comm/param_compression_ratio"] <= (bits + 32 / 256) / elem_bits * 1.05
    assert last["comm/param_compress_s"] > 0 and last["comm/param_decompress_s"] > 0
    errors = [m["loco/param_rel_error"] for m in metrics if "loco/param_rel_error" in m]
    assert all(0 <= e < 0.01 for e in errors), errors
    if "--inject-nan" in extra:
        assert [m for m in metrics if "train/skipped_iters" in m][-1]["train/skipped_iters"] == 1
        # ||agreed - main|| stays one step's rounding: it does not grow with the step count.
        late, early = errors[-10:], errors[2:12]
        assert max(late) <= 2 * max(early), errors


def test_overlap_matches_sync_resumes_and_switches_bits(cache_dir, tmp_path):
    """Guards against the deferred (--overlap-param-gather) compressed gather differing
    from the synchronous one, a checkpoint taken while it is pending holding stale or
    unagreed weights, state missing from the checkpoint (resume not bit-exact: the
    exact fp32 main shard of an fp32 model), and a checkpoint written with
    --param-gather-bits 4 not loading with --param-gather-bits 0."""
    args = TINY + ["--train-iters", "6", "--lr-decay-iters", "6", "--loco-bits", "4", "--param-gather-bits", "4",
                   "--ckpt-format", "torch"]
    _, sync = torchrun(2, args + ["--save", str(tmp_path / "ck_sync"), "--save-interval", "3"], cache_dir,
                       tmp_path, name="sync")
    ck = str(tmp_path / "ck")
    over = args + ["--overlap-param-gather"]
    _, first = torchrun(2, over + ["--train-iters", "3", "--save", ck], cache_dir, tmp_path, name="first")
    proc, resumed = torchrun(2, over + ["--load", ck], cache_dir, tmp_path, name="resumed")
    assert "resuming from" in proc.stdout
    a, b = train_losses(sync), {**train_losses(first), **train_losses(resumed)}
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    assert all(a[it] == b[it] for it in a), (a, b)
    saved = [torch.load(tmp_path / d / f"iter_0000003/rank_0000{r}.pt", weights_only=False)
             for d in ("ck_sync", "ck") for r in (0, 1)]
    for sd in saved[1:]:  # every rank, synchronous or deferred gather: the same weights
        for key, t in saved[0]["model"][0].items():
            if torch.is_tensor(t) and t.is_floating_point():
                assert torch.equal(t, sd["model"][0][key]), key
    for r in (0, 1):  # and the same exact main shards
        for key, st in saved[r]["param_gather"].items():
            assert torch.equal(st["spare"], saved[2 + r]["param_gather"][key]["spare"]), key
    _, switched = torchrun(2, args + ["--param-gather-bits", "0", "--load", ck], cache_dir, tmp_path,
                           name="switched")
    last = [m for m in switched if "comm/param_compression_ratio" in m][-1]
    assert last["comm/param_compression_ratio"] == 1.0 and sorted(train_losses(switched)) == [4, 5, 6]


def test_param_gather_goes_through_the_recorded_collectives(cache_dir, tmp_path, monkeypatch):
    """Guards against the compressed parameter gather calling torch.distributed directly
    (issue 21): the collective-order recorder could not see it, so its program order was
    never checked. With the distributed optimizer LoCo issues no all-gather of its own,
    so every recorded all-gather is a parameter gather (uint8 rows): one per gathered
    bucket and update, in the same order, with the same sizes, on both ranks, under
    random delays and --overlap-param-gather."""
    monkeypatch.setenv("LOCO_TEST_RECORD_DIR", str(tmp_path))
    args = TINY + ["--train-iters", "3", "--loco-bits", "4", "--param-gather-bits", "4", "--overlap-param-gather"]
    torchrun(2, args, cache_dir, tmp_path, script="tests/record_collectives.py")
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert logs[0] == logs[1]
    gathers = [n for _, op, n in logs[0] if op == "all_gather"]
    buckets = len([n for _, op, n in logs[0] if op == "all_to_all"]) // 3  # LoCo: one per bucket and step
    # Steps 1 and 2's updates are gathered in the next forward; step 3's is never needed.
    assert buckets > 1 and len(gathers) == 2 * buckets, (buckets, gathers)


def test_two_bit_fused_matches_torch_and_resumes_bit_exact(cache_dir, tmp_path, cpu_kernels_built):
    """Guards against --param-gather-bits 2 (the gradients' 2-bit options, here with
    stochastic rounding) differing between the fused C++ kernels and the torch reference
    (ranks or a resume mixing them would break the agreed parameters), against the
    stochastic-rounding key not being checkpointed (a resumed run rounds differently), and
    against the start-up line not naming the parameter gather's kernels and options."""
    args = TINY + ["--lr-decay-iters", "4", "--loco-bits", "2", "--param-gather-bits", "2",
                   "--loco-rounding", "stochastic", "--ckpt-format", "torch"]
    proc, whole = torchrun(2, args + ["--train-iters", "4", "--loco-kernels", "cpu"], cache_dir, tmp_path,
                           name="whole")
    assert "params cpu (2-bit uniform/mse/hadamard/stochastic)" in proc.stdout
    ck = str(tmp_path / "ck")
    _, first = torchrun(2, args + ["--train-iters", "2", "--loco-kernels", "torch", "--save", ck], cache_dir,
                        tmp_path, name="first")
    proc, resumed = torchrun(2, args + ["--train-iters", "4", "--loco-kernels", "cpu", "--load", ck], cache_dir,
                             tmp_path, name="resumed")
    assert "resuming from" in proc.stdout
    a, b = train_losses(whole), {**train_losses(first), **train_losses(resumed)}
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and a == b, (a, b)
    last = [m for m in whole if "comm/param_bytes_sent" in m][-1]
    saved = torch.load(tmp_path / "ck" / "iter_0000002/rank_00000.pt", weights_only=False)
    numel = sum(st["spare"].numel() for st in saved["param_gather"].values())  # rank 0's shards
    blocks = sum(-(-st["spare"].numel() // 256) for st in saved["param_gather"].values())
    # Each rank contributes one row per bucket: 2-bit codes of whole blocks + fp32 scales.
    assert last["comm/param_bytes_sent"] == 2 * (blocks * 256 * 2 // 8 + 4 * blocks), (last, numel)
