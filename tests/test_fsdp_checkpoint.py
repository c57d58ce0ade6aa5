"""--ckpt-format fsdp_dtensor (Megatron-FSDP's DTensors through torch.distributed.checkpoint):
same-layout resume (of an --async-save) bit-exact with LoCo's error buffers, resume at another layout resharded
with the per-rank state reset in one line, the flag refused without --use-megatron-fsdp."""

import functools
import shutil
import sys

import pytest

import conftest
from conftest import REPO, TINY, run_launch, train_losses

# Plain torchruns, not the fork server: Megatron-FSDP's runs, as in tests/test_fsdp.py (see there).
torchrun = functools.partial(conftest.torchrun, plain=True)

HSDP = TINY + ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2", "--micro-batch-size", "1",
               "--train-iters", "4", "--loco-bits", "4", "--ckpt-format", "fsdp_dtensor"]
RESET = "RNG re-seeded and LoCo error buffers start at zero"


def _grad_norms(metrics):
    return {m["iteration"]: m["train/grad_norm"] for m in metrics if "train/grad_norm" in m}


@pytest.fixture(scope="module")
def saved(cache_dir, tmp_path_factory):
    """The uninterrupted 4-step run, HSDP 2 nodes x 2 ranks with LoCo 4-bit, saving at steps
    2 and 4 with --async-save: (metrics, checkpoint folder rewound to step 2)."""
    out = tmp_path_factory.mktemp("fsdp_ck")
    _, metrics = torchrun(4, HSDP + ["--loco-ranks-per-node", "2", "--save", str(out / "ck"), "--save-interval", "2",
                                     "--async-save"], cache_dir, out, name="full")
    ck = out / "ck"
    # Both background writes were committed, the last one waited for before the exit.
    assert [m["ckpt/iteration"] for m in metrics if "ckpt/write_s" in m] == [2, 4]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    files = sorted(p.name for p in (ck / "iter_0000002").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "common.pt",
                     "metadata.json", *(f"sha256.rank_{r:05d}.json" for r in range(4))], files
    shutil.rmtree(ck / "iter_0000004")
    (ck / "latest_checkpointed_iteration.txt").write_text("2\n")
    return metrics, ck


def test_same_layout_resume_is_bit_exact_with_loco_state(saved, cache_dir, tmp_path):
    """Guards against an fsdp_dtensor checkpoint that loses or misplaces any part of the
    state at the same layout: the fp32 main weights (or leaves the gathered model weights
    stale), Adam's moments or step (bias correction), the param-group hyper-parameters, the
    schedule or data position, or LoCo's per-rank error buffers (step 3's compressed
    gradient adds step 2's error: its gradient norm would differ), or an --async-save
    writer that misses part of it. Resumed from step 2,
    steps 3-4 repeat the uninterrupted run's losses and gradient norms bit for bit, and no
    reset line is printed."""
    full, ck = saved
    ck = shutil.copytree(ck, tmp_path / "ck")
    proc, resumed = torchrun(4, HSDP + ["--loco-ranks-per-node", "2", "--load", str(ck)], cache_dir, tmp_path,
                             name="same")
    want = {i: v for i, v in train_losses(full).items() if i > 2}
    assert train_losses(resumed) == want and sorted(want) == [3, 4]
    assert _grad_norms(resumed) == {i: v for i, v in _grad_norms(full).items() if i > 2}
    assert RESET not in proc.stdout


def test_other_layout_resume_reshards_and_resets_loco_in_one_line(saved, cache_dir, tmp_path):
    """Guards against an fsdp_dtensor checkpoint that only loads at the layout it was written
    with (Megatron-FSDP's uneven DTensor shards read at the wrong offsets, the optimizer
    state keyed by a layout-dependent order), and against a silent reset or a wrong read of
    the per-rank state: saved at 4 ranks (2 x 2), loaded at 2 ranks (2 x 1), the first loss
    equals the uninterrupted run's (same weights, same global batch: only the reduction
    order differs), the second too (same Adam moments and LR), and one line says that RNG
    and LoCo state start fresh."""
    full, ck = saved
    ck = shutil.copytree(ck, tmp_path / "ck")
    proc, resumed = torchrun(2, HSDP + ["--loco-ranks-per-node", "1", "--load", str(ck)], cache_dir, tmp_path,
                             name="other")
    a, b = train_losses(full), train_losses(resumed)
    assert sorted(b) == [3, 4]
    assert b[3] == pytest.approx(a[3], rel=1e-5), (a, b)
    assert b[4] == pytest.approx(a[4], rel=1e-4), (a, b)
    assert proc.stdout.count(RESET) == 1, proc.stdout[-2000:]
    assert "saved with layout world4_" in proc.stdout and "resuming with world2_" in proc.stdout


def test_fsdp_dtensor_without_megatron_fsdp_is_one_line_exit_2(tmp_path):
    """Guards against --ckpt-format fsdp_dtensor accepted without --use-megatron-fsdp (a DDP
    model has no DTensors: the run would fail at its first save, after training): one line
    on stderr naming the flag, exit code 2, nothing written. (torch_dist with
    --use-megatron-fsdp pointing to fsdp_dtensor: tests/test_fsdp.py's refused combinations.)"""
    argv = ["--ckpt-format", "fsdp_dtensor", "--save", str(tmp_path / "ck")]
    needle = "--ckpt-format: fsdp_dtensor is Megatron-FSDP's format and needs --use-megatron-fsdp"
    proc = run_launch([sys.executable, str(REPO / "pretrain_gpt.py"), *TINY, *argv], None, 120)
    lines = [l for l in proc.stderr.splitlines() if l.strip() and "warn" not in l.lower()]
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "ck").exists()
