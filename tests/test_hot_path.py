"""No host-device synchronisation in LoCo's gradient-sync and parameter-gather hot paths."""

import re
import sys

import pytest
from conftest import TINY, run_launch, torchrun


@pytest.mark.parametrize("bits,kernels", [("4", "triton"), ("2", "triton"), ("2", "torch")])
def test_overlapped_step_makes_no_host_sync(cache_dir, tmp_path, monkeypatch, bits, kernels):
    """Guards against a blocking host-device sync on the hot path (e.g. the compressor's
    ``torch.tensor([float(numel)], device=dev)`` per bucket, or the mse scale's ratios
    copied per chunk): one overlapped step (--overlap-grad-reduce, --overlap-param-gather,
    --param-gather-bits) of the real hooks on the Triton kernels (interpreted; the GPU
    path) and on the torch reference (which also runs on GPUs), after a
    warm-up step, must make no ``.item()``/``bool()``/``float()``/``tolist()``/``cpu()``
    and no ``torch.tensor`` from LoCo's own code (tests/sync_spy.py). 2 bits runs the
    2-bit default options (uniform grid, mse scale, Hadamard rotation) on both sides."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = TINY + ["--train-iters", "4", "--lr-decay-iters", "4", "--loco-bits", bits, "--loco-kernels", kernels,
                   "--param-gather-bits", bits, "--overlap-param-gather", "--bf16"]
    proc, metrics = torchrun(2, args, cache_dir, tmp_path, script="tests/sync_spy.py")
    lines = re.findall(r"SYNCS rank=(\d) n=(\d+) first=(.*)", proc.stdout)
    assert sorted(r for r, _, _ in lines) == ["0", "1"], proc.stdout[-2000:]
    assert all(n == "0" for _, n, _ in lines), lines
    assert any("comm/grad_bytes_sent" in m for m in metrics)



def test_sync_check_runs_every_configuration():
    """Guards against benchmarks/sync_check.py (gpu_check.sh's sync-debug step) breaking
    unseen on CPU: its one-bucket hot path (compress, reduce-scatter, decompress, parameter
    gather encode and apply) runs for the torch kernels at 4 and 2 bits and says ok for each."""
    proc = run_launch([sys.executable, "benchmarks/sync_check.py", "--kernels", "torch", "--bits", "4,2",
                       "--numel", "3000"], None, 300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count(": ok") == 2 and "bits=2" in proc.stdout
