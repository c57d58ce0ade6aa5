"""The CPU compatibility layer: redirects CUDA requests, restores everything on exit."""

import numpy as np
import torch

from loco_megatron.platform import cpu_compat, detect_platform, megatron_fixes
from conftest import free_port


def test_cuda_requests_run_on_cpu_and_are_restored():
    """Guards against megatron's hard-coded CUDA allocations failing on CPU hosts, and
    against the patches leaking past the run."""
    before = torch.cuda.current_device
    with cpu_compat():
        t = torch.zeros(3, device="cuda")
        u = torch.empty(2, device=torch.cuda.current_device())
        assert t.device.type == "cpu" and u.device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(1).to("cuda").device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            event = stream.record_event()
        event.synchronize()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("x")
        torch.cuda.nvtx.range_pop()
        torch.cuda.manual_seed(5)
        state = torch.cuda.get_rng_state()
        a = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(a, torch.rand(3))
    assert torch.cuda.current_device is before
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_platform_picks_gloo_without_cuda():
    """Guards against choosing NCCL on a host without GPUs."""
    p = detect_platform(0, force_cpu=True)
    assert p.backend == "gloo" and p.device.type == "cpu"


def test_moe_split_sizes_become_lists():
    """Guards against torch 2.13 rejecting numpy split sizes in the MoE all-to-all."""
    import megatron.core.transformer.moe.token_dispatcher as td

    seen = {}
    original = td.all_to_all
    with megatron_fixes():
        wrapped = td.all_to_all
        assert wrapped is not original
        import loco_megatron.platform as plat

        probe = plat._splits_as_lists(lambda g, x, o, i: seen.update(o=o, i=i))
        probe(None, None, np.array([1, 2]), np.array([3, 4]))
    assert seen == {"o": [1, 2], "i": [3, 4]}
    assert td.all_to_all is original


def _staging_worker(rank: int, world: int, port: int) -> None:
    import os

    import torch.distributed as dist

    from loco_megatron import platform

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = torch.arange(8, dtype=torch.float32) + 10 * rank
        always = lambda t: True  # noqa: E731 - stage CPU tensors too, as CUDA ones would be
        for name in platform.STAGED_COLLECTIVES:
            direct, staged = getattr(dist, name), platform._host_staged(getattr(dist, name), stage=always)
            if name == "all_gather":
                want, got = [torch.empty(8) for _ in range(world)], [torch.empty(8) for _ in range(world)]
            else:
                size = {"all_gather_into_tensor": 8 * world, "reduce_scatter_tensor": 8 // world}.get(name, 8)
                want, got = torch.empty(size), torch.empty(size)
            direct(want, x, group=None)
            handle = staged(got, x, group=None, async_op=True)
            assert handle.wait() and handle.is_completed(), name
            for a, b in zip(want if isinstance(want, list) else [want], got if isinstance(got, list) else [got]):
                assert torch.equal(a, b), (name, a, b)
    finally:
        dist.destroy_process_group()


def test_host_staged_collectives_equal_the_direct_ones():
    """Guards against the gloo-on-one-GPU staging (platform.gloo_cuda_staging) delivering
    other values than the collective it stands in for, or an async caller getting a handle
    that is not complete: on 2 gloo ranks, each staged collective (forced onto host copies,
    as a CUDA tensor would be) writes exactly what the direct call writes."""

    import torch.multiprocessing as mp

    port = free_port()
    mp.start_processes(_staging_worker, args=(2, port), nprocs=2, start_method="spawn")


def test_gpu_ranks_compare_says_bit_exact_or_not(tmp_path):
    """Guards against gpu_check.sh's resume check passing a resume that differs (or one
    that logged nothing): benchmarks/gpu_ranks.py --compare exits 0 only when every resumed
    loss equals the unbroken run's at the same iteration."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    def write(name, losses):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"iteration": i, "train/lm_loss": v}) + "\n" for i, v in losses.items()))
        return str(path)

    full = write("full.jsonl", {1: 9.5, 2: 9.25, 3: 9.125, 4: 9.0})

    def rc(resumed):
        cmd = [sys.executable, "benchmarks/gpu_ranks.py", "--compare", full, write("r.jsonl", resumed)]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120).returncode

    assert rc({3: 9.125, 4: 9.0}) == 0
    assert rc({3: 9.125, 4: 9.000001}) == 1
    assert rc({}) == 1
