"""The CPU compatibility layer: redirects CUDA requests, restores everything on exit."""

import numpy as np
import torch

from loco_megatron.platform import cpu_compat, detect_platform, megatron_fixes


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
