"""--optimizer muon in one process and on spawned gloo ranks: Muon's update against
torch.optim.Muon (whole matrices, the QKV split, the tensor-parallel modes), its flags and the
combinations refused in one line (training runs: test_muon_training.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from loco_megatron.cli import parse_config
from loco_megatron.config import ConfigError
from loco_megatron.optimizer.muon import Muon, muon_scale
from test_collectives import _spawn

LR, WD, BETA = 0.02, 0.1, 0.95
"""Large enough that a wrong scale, momentum or decay moves the weights by ~1e-3, far above
the ~1e-7 by which the same maths in another order (torch's and this class's multiply the
learning rate and the scale in the other order) can differ."""


def _muon(params, scale_mode="spectral", extra=0.2, nesterov=False, split_qkv=True, shapes=(1, 1, 1), **kw):
    return Muon(params, lr=LR, momentum=BETA, nesterov=nesterov, weight_decay=WD, ns_steps=5, scale_mode=scale_mode,
                extra_scale_factor=extra, split_qkv=split_qkv, qkv_split_shapes=shapes, **kw)


def _grads(shape, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("scale_mode,extra,adjust", [("spectral", 0.2, "match_rms_adamw"),
                                                     ("shape_scaling", 1.0, "original")])
def test_step_equals_torch_muon(nesterov, scale_mode, extra, adjust):
    """Guards against a wrong momentum (lerp weight, Nesterov), Newton-Schulz, update scale or
    decoupled weight decay: three steps on a tall, a wide and a square matrix equal
    torch.optim.Muon's, whose ``match_rms_adamw`` is the spectral scale times 0.2 and whose
    ``original`` is the shape scaling; the momentum buffers are bit-identical."""
    shapes = [(48, 16), (16, 40), (24, 24)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))) for i, s in enumerate(shapes)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    a = _muon(ours, scale_mode, extra, nesterov)
    b = torch.optim.Muon(theirs, lr=LR, momentum=BETA, nesterov=nesterov, weight_decay=WD, adjust_lr_fn=adjust)
    grads = [_grads(s, 3, 10 + i) for i, s in enumerate(shapes)]
    for step in range(3):
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g[step].clone(), g[step].clone()
        a.step()
        b.step()
    for p, q, s in zip(ours, theirs, start):
        assert torch.equal(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"])
        torch.testing.assert_close(p, q, rtol=0, atol=2e-7)
        assert (p.detach() - s).abs().max() > 1e-3  # (the weights moved: not a no-op)


def test_qkv_split_orthogonalises_query_key_and_value_apart():
    """Guards against the fused QKV matrix orthogonalised whole, or split at the wrong rows:
    with ``is_qkv`` set, megatron-core's split (per query group: its query, key and value
    rows) makes the update of the query rows of all groups, of the key rows and of the
    value rows each equal torch.optim.Muon's on that matrix alone (2 query groups of 2
    heads, head dim 4); without the split the update differs."""
    groups, q, kv, cols = 2, 8, 4, 16
    rows = groups * (q + 2 * kv)
    start = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    grads = _grads((rows, cols), 3, 1)

    def parts(t: torch.Tensor) -> list[torch.Tensor]:
        return [x.reshape(-1, cols) for x in torch.split(t.view(groups, q + 2 * kv, cols), [q, kv, kv], dim=1)]

    qkv = torch.nn.Parameter(start.clone())
    qkv.is_qkv = True
    fused = torch.nn.Parameter(start.clone())
    fused.is_qkv = True
    split, whole = _muon([qkv], shapes=(q, kv, kv)), _muon([fused], shapes=(q, kv, kv), split_qkv=False)
    apart = [torch.nn.Parameter(x.clone()) for x in parts(start)]
    ref = torch.optim.Muon(apart, lr=LR, momentum=BETA, weight_decay=WD, nesterov=False, adjust_lr_fn="match_rms_adamw")
    for g in grads:
        qkv.grad, fused.grad = g.clone(), g.clone()
        for p, x in zip(apart, parts(g)):
            p.grad = x.clone()
        split.step()
        whole.step()
        ref.step()
    for mine, expected in zip(parts(qkv.detach()), apart):
        torch.testing.assert_close(mine, expected.detach(), rtol=0, atol=2e-7)
    assert (fused - qkv).abs().max() > 1e-3


def _tp_worker(rank: int, world: int, port: int, queue, collected) -> None:
    """One TP rank: its slices (dim 0 of a column-parallel, dim 1 of a row-parallel matrix)
    stepped in duplicated and in blockwise mode; returns them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {}
        for mode in ("duplicated", "blockwise"):
            params = []
            for i, (shape, dim) in enumerate((((32, 12), 0), ((12, 40), 1))):
                full = torch.randn(shape, generator=torch.Generator().manual_seed(i))
                p = torch.nn.Parameter(full.chunk(world, dim)[rank].clone())
                p.partition_dim, p.tensor_model_parallel = dim, True
                params.append((p, dim))
            opt = _muon([p for p, _ in params], tp_mode=mode, tp=dist.group.WORLD, expert_tp=dist.group.WORLD)
            for step in range(2):
                for i, (p, dim) in enumerate(params):
                    p.grad = _grads(p.shape[:dim] + (p.shape[dim] * world,) + p.shape[dim + 1:], 2, 20 + i)[step] \
                        .chunk(world, dim)[rank].clone()
                opt.step()
            out[mode] = [p.detach().clone() for p, _ in params]
        queue.put((rank, out))
        collected.wait(120)  # (the tensors travel in shared memory this process keeps until they are read)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_modes_against_torch_muon_on_one_rank():
    """Guards against --muon-tp-mode duplicated gathering the wrong slices, cutting its
    result at the wrong place or scaling by the slice's shape, and against blockwise
    touching the other rank's slice: on 2 gloo ranks, two steps of a column-parallel (split
    on dim 0) and a row-parallel (dim 1) matrix; duplicated equals torch.optim.Muon on the
    whole matrix on one rank, cut to each rank's slice; blockwise equals torch.optim.Muon on
    each slice alone."""
    world = 2
    got = _spawn(_tp_worker, world)
    for i, (shape, dim) in enumerate((((32, 12), 0), ((12, 40), 1))):
        full = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(i)))
        slices = [torch.nn.Parameter(x.clone()) for x in full.detach().chunk(world, dim)]
        whole = torch.optim.Muon([full], lr=LR, momentum=BETA, weight_decay=WD, nesterov=False,
                                 adjust_lr_fn="match_rms_adamw")
        apart = torch.optim.Muon(slices, lr=LR, momentum=BETA, weight_decay=WD, nesterov=False,
                                 adjust_lr_fn="match_rms_adamw")
        for g in _grads(shape, 2, 20 + i):
            full.grad = g.clone()
            for s, x in zip(slices, g.chunk(world, dim)):
                s.grad = x.clone()
            whole.step()
            apart.step()
        for rank in range(world):
            torch.testing.assert_close(got[rank]["duplicated"][i], full.detach().chunk(world, dim)[rank],
                                       rtol=0, atol=2e-7)
            torch.testing.assert_close(got[rank]["blockwise"][i], slices[rank].detach(), rtol=0, atol=2e-7)
        assert not torch.allclose(got[0]["duplicated"][i], got[0]["blockwise"][i], atol=1e-4)


def _gather_worker(rank: int, world: int, port: int, queue, collected) -> None:
    """Rank ``r`` owns ``OWNED[r]`` (fp32 and bf16 parameters), sets them to its values and
    zeros the others', then the layer-wise gather; returns every parameter."""
    from loco_megatron.optimizer.layer_wise import _gather_whole
    from loco_megatron.platform import gloo_ragged_all_gather

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        params = [[torch.zeros(shape, dtype=dtype) for shape, dtype in owned] for owned in OWNED]
        for i, p in enumerate(params[rank]):  # (thirds: fp32 values that bf16 cannot hold)
            p.copy_((torch.arange(p.numel()).view(p.shape) + 1 + 10 * i).to(torch.float64) / 3)
        with gloo_ragged_all_gather():
            _gather_whole(params, dist.group.WORLD)
        queue.put((rank, params))
        collected.wait(120)
    finally:
        dist.destroy_process_group()


OWNED = [[((3, 2), torch.bfloat16), ((5,), torch.float32)],
         [((4,), torch.bfloat16), ((2, 3), torch.float32), ((7,), torch.float32)],
         []]
"""The parameters each of 3 ranks updates (the last none: a rank dealt nothing). A bf16 one
first: gathered at the first parameter's dtype, the fp32 ones would arrive rounded."""


def test_the_layer_wise_gather_sends_each_dtype_at_its_own():
    """Guards against the layer-wise all-gather of the updated parameters sending every
    parameter at one dtype, as megatron-core's did (the dtype of the first parameter dealt:
    bf16 matrices travelled as fp32, twice their bytes, or fp32 norms reached the other
    ranks rounded to bf16), and against a rank dealt nothing breaking the gather: on 3 gloo
    ranks, owners of fp32 and bf16 parameters side by side, every rank ends with every
    parameter bit for bit as its owner set it, at its own dtype."""
    got = _spawn(_gather_worker, 3)
    for owner, owned in enumerate(OWNED):
        for i, (shape, dtype) in enumerate(owned):
            expected = ((torch.arange(torch.Size(shape).numel()).view(shape) + 1 + 10 * i).to(torch.float64) / 3).to(dtype)
            for rank in range(3):
                tensor = got[rank][owner][i]
                assert tensor.dtype == dtype and torch.equal(tensor, expected), (rank, owner, i, tensor, expected)


def test_a_checkpoint_with_one_adamw_step_count_gives_it_to_every_group():
    """Guards against a --optimizer muon checkpoint written before the per-group AdamW step
    counts (one ``step`` per sub-optimizer in its common state) failing to load (KeyError on
    ``steps``) or restarting a group's count: each group reads that count; a checkpoint with
    per-group counts reads them as written."""
    from loco_megatron.checkpoint.layer_wise import saved_steps

    assert saved_steps({"groups": [{"lr": 1e-3}, {"lr": 1e-3}], "step": 7.0}) == [7.0, 7.0]
    assert saved_steps({"groups": [{"lr": 1e-3}, {"lr": 1e-3}], "steps": [7.0, 3.0]}) == [7.0, 3.0]


def test_scales_are_megatrons():
    """Guards against a scale mode computing another factor than megatron-core's
    (emerging-optimizers' get_muon_scale_factor) for a tall and a wide matrix."""
    assert muon_scale(64, 16, "spectral") == muon_scale(16, 64, "spectral") == 8.0
    assert muon_scale(64, 16, "shape_scaling") == 2.0 and muon_scale(16, 64, "shape_scaling") == 1.0
    assert muon_scale(64, 16, "unit_rms_norm") == 2.0 and muon_scale(16, 64, "unit_rms_norm") == 0.5


def test_flags_are_megatron_lms():
    """Guards against flags or defaults that differ from Megatron-LM's names (a user's
    Megatron-LM command must mean the same here): momentum 0.95, no Nesterov, 5 steps, the
    spectral scale, blockwise TP, the QKV split on, --muon-no-split-qkv turning it off."""
    o = parse_config(["--optimizer", "muon"]).optimizer
    assert (o.optimizer, o.muon_momentum, o.muon_use_nesterov, o.muon_num_ns_steps, o.muon_scale_mode,
            o.muon_tp_mode, o.muon_split_qkv) == ("muon", 0.95, False, 5, "spectral", "blockwise", True)
    assert parse_config(["--optimizer", "muon", "--muon-no-split-qkv"]).optimizer.muon_split_qkv is False
    assert parse_config(["--optimizer", "muon", "--no-muon-split-qkv"]).optimizer.muon_split_qkv is False
    assert parse_config(["--muon-use-nesterov", "--muon-tp-mode", "duplicated"]).optimizer.muon_tp_mode == "duplicated"


@pytest.mark.parametrize("argv,line", [
    (["--param-gather-bits", "4"], "--param-gather-bits: compresses the distributed optimizer's all-gather"),
    (["--overlap-param-gather"], "--overlap-param-gather: is the distributed optimizer's"),
    (["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2", "--loco-ranks-per-node", "1"],
     "--optimizer: muon is not supported with --use-megatron-fsdp: Megatron-FSDP shards every matrix"),
    (["--no-use-distributed-optimizer"], "--optimizer: muon runs in megatron-core's layer-wise distributed optimizer"),
    (["--muon-tp-mode", "distributed"], "--muon-tp-mode: 'distributed' is not one of blockwise, duplicated"),
    (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps: must be >= 1"),
    (["--muon-momentum", "1"], "--muon-momentum: must be in [0, 1)"),
])
def test_what_muon_does_not_combine_with_is_one_line(argv, line):
    """Guards against a combination Muon cannot run starting anyway (and failing deep inside
    megatron, or compressing nothing while claiming to): each is one ConfigError naming the
    flag and why."""
    with pytest.raises(ConfigError) as e:
        parse_config(["--optimizer", "muon", *argv])
    assert str(e.value).startswith(line), str(e.value)
    assert "\n" not in str(e.value)
