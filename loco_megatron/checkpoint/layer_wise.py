"""--optimizer muon's optimizer state in model space (reshardable over DP, TP, PP and EP).

The layer-wise optimizer (:mod:`loco_megatron.optimizer.layer_wise`) holds, on the rank that
owns a parameter, its fp32 main parameter and its state: Muon's ``momentum_buffer``, or AdamW's
``exp_avg`` and ``exp_avg_sq``. Each is written as global tensors of the model parameter's
shape under the keys the distributed optimizer's checkpoint uses
(``optimizer.state.{fp32_param,momentum_buffer,exp_avg,exp_avg_sq}.<model key>``, see
:mod:`.dist_optimizer`, whose model-space blocks this reuses with the whole local parameter
as the range): the owner writes its parameters, and a load under another layout reads the
blocks of the parameters it owns there, from whichever ranks wrote them. Common state per
sub-optimizer: its param groups' hyper-parameters and AdamW's step count (the same for every
parameter: the steps that succeeded).

megatron-core's own ``LayerWiseDistributedOptimizer.sharded_state_dict`` is not used: it goes
through the sub-optimizers' formats, which index state by a rank's own parameter order, fail
for fp32 parameters under its Float16 wrapper, and gather every param group over the world.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from loco_megatron.checkpoint.dist_optimizer import _pieces
from loco_megatron.checkpoint.model_space import model_tensors


def _state_names(inner) -> tuple:
    from loco_megatron.optimizer.muon import Muon

    return ("momentum_buffer",) if isinstance(inner, Muon) else ("exp_avg", "exp_avg_sq")


def _steps(subs: list, device) -> list:
    """Per sub-optimizer, AdamW's step count (0 for Muon, or before any step), the largest
    over the ranks: a rank may own no parameter of a sub-optimizer. Collective (a save is)."""
    local = [max((float(s["step"]) for s in opt.optimizer.state.values() if "step" in s), default=0.0)
             for opt in subs]
    steps = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    return steps.tolist()


def sharded_state_dict(optimizer, model_sd: dict, is_loading: bool) -> dict:
    """``{i: {"common": ..., "params": {j: {name: [ShardedTensor]}}}}`` per sub-optimizer
    ``i`` and owned parameter ``j``: saving, views of the live state; loading, empty host
    buffers (as :func:`.dist_optimizer.sharded_state_dict`)."""
    from loco_megatron.optimizer import sub_optimizers
    from loco_megatron.optimizer.layer_wise import owned

    meta = model_tensors(model_sd)
    subs = sub_optimizers(optimizer)
    pairs_of = owned(optimizer)
    steps = None if is_loading else _steps(subs, next(iter(meta)).device if meta else "cpu")
    out = {}
    for i, (opt, pairs) in enumerate(zip(subs, pairs_of)):
        inner = opt.optimizer
        names = ("fp32_param", *_state_names(inner))
        params = {}
        for j, (param, main) in enumerate(pairs):
            pieces = list(_pieces(meta[param], 0, param.numel()))
            if is_loading:
                tensors = {name: torch.empty(param.numel(), dtype=torch.float32) for name in names}
            else:
                state = inner.state[main]
                tensors = {name: (main if name == "fp32_param" else state[name]).detach().view(-1) for name in names}
            params[j] = {name: [dataclasses.replace(m, key=f"optimizer.state.{name}.{m.key}",
                                                    data=tensors[name][flat:flat + math.prod(shape)].view(shape))
                                for m, shape, flat in pieces] for name in names}
        common = None if is_loading else {
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups], "step": steps[i]}
        out[i] = {"common": common, "params": params}
    return out


@torch.no_grad()
def load_state_dict(optimizer, sd: dict) -> None:
    """Restore every sub-optimizer's param groups and step, and the main parameter and state
    of every parameter this rank owns (from the blocks :func:`sharded_state_dict` asked for)."""
    from loco_megatron.optimizer import sub_optimizers
    from loco_megatron.optimizer.layer_wise import owned

    for i, (opt, pairs) in enumerate(zip(sub_optimizers(optimizer), owned(optimizer))):
        inner, saved = opt.optimizer, sd[i]
        for group, hyper in zip(inner.param_groups, saved["common"]["groups"]):
            group.update({k: v for k, v in hyper.items() if k != "params"})
        names = _state_names(inner)
        for j, (param, main) in enumerate(pairs):
            blocks = saved["params"][j]
            state = inner.state[main]
            for name in names:
                state.setdefault(name, torch.zeros_like(main))
            if names != ("momentum_buffer",):
                state["step"] = torch.tensor(float(saved["common"]["step"]), dtype=torch.float32)
            for name in ("fp32_param", *names):
                target = (main if name == "fp32_param" else state[name]).view(-1)
                at = 0
                for block in blocks[name]:
                    target[at:at + block.numel()].copy_(block.reshape(-1))
                    at += block.numel()
