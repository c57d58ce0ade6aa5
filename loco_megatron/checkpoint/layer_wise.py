"""--optimizer muon's optimizer state in model space (reshardable over DP, TP, PP and EP).

The layer-wise optimizer (:mod:`loco_megatron.optimizer.layer_wise`) holds, on the rank that
owns a parameter, its fp32 main parameter and its state: Muon's ``momentum_buffer``, or AdamW's
``exp_avg`` and ``exp_avg_sq``. Each is written as global tensors of the model parameter's
shape under the keys the distributed optimizer's checkpoint uses
(``optimizer.state.{fp32_param,momentum_buffer,exp_avg,exp_avg_sq}.<model key>``, see
:mod:`.dist_optimizer`, whose model-space blocks this reuses with the whole local parameter
as the range): the owner writes its parameters, and a load under another layout reads the
blocks of the parameters it owns there, from whichever ranks wrote them. Common state per
sub-optimizer: its param groups' hyper-parameters and, per group, AdamW's step count (the
steps that succeeded), read where the optimizer keeps it: torch's AdamW in each parameter's
state (``state[p]["step"]``), Transformer Engine's FusedAdam (megatron-core's Adam when TE
is installed) in the group (``param_groups[i]["step"]``), which older TE versions do not
advance on a rank owning nothing of the group. So each group's count is the largest over
every rank (the ranks that own some of it), not rank 0's, and a load restores it where the
loading optimizer keeps it.

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


def _hyper(group: dict) -> dict:
    """A param group's hyper-parameters: neither its parameters nor its step count (a
    checkpoint keeps that per group apart, see :func:`_steps`)."""
    return {k: v for k, v in group.items() if k not in ("params", "step")}


def _state_names(inner) -> tuple:
    from loco_megatron.optimizer.muon import Muon

    return ("momentum_buffer",) if isinstance(inner, Muon) else ("exp_avg", "exp_avg_sq")


def _keeps_step_per_group(inner) -> bool:
    """Whether the torch optimizer ``inner`` counts its steps in ``param_groups[i]["step"]``
    (Transformer Engine's and Apex's FusedAdam) rather than in each parameter's state
    (torch's own Adam and AdamW)."""
    return not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _group_step(inner, group: dict) -> float:
    """The steps ``group`` of ``inner`` took on this rank: its own count, else the largest of
    its parameters' (0 before any step, or where this rank owns nothing of it)."""
    if "step" in group:
        return float(group["step"])
    states = (inner.state[p] for p in group["params"] if p in inner.state)
    return max((float(s["step"]) for s in states if "step" in s), default=0.0)


def _steps(subs: list, device) -> list:
    """Per sub-optimizer, per param group, AdamW's step count (0 for Muon, or before any
    step), the largest over the ranks: a rank may own nothing of a group (every rank holds
    every group, megatron aligns them, empty where it owns none). Collective (a save is)."""
    local = [_group_step(opt.optimizer, g) for opt in subs for g in opt.optimizer.param_groups]
    steps = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    flat, out = steps.tolist(), []
    for opt in subs:
        out.append(flat[:len(opt.optimizer.param_groups)])
        flat = flat[len(out[-1]):]
    return out


def saved_steps(common: dict) -> list:
    """Per param group, the step count a checkpoint's common state of one sub-optimizer
    holds; one written before the per-group counts (one ``step`` for every group) reads as
    that count for each group."""
    if "steps" in common:
        return list(common["steps"])
    return [common["step"]] * len(common["groups"])


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
            "groups": [_hyper(g) for g in inner.param_groups], "steps": steps[i]}
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
        names = _state_names(inner)
        adam = names != ("momentum_buffer",)
        step_of = {}
        for group, hyper, step in zip(inner.param_groups, saved["common"]["groups"], saved_steps(saved["common"])):
            group.update(_hyper(hyper))
            if adam and _keeps_step_per_group(inner):
                group["step"] = int(step)
            step_of.update({p: step for p in group["params"]})
        for j, (param, main) in enumerate(pairs):
            blocks = saved["params"][j]
            state = inner.state[main]
            for name in names:
                state.setdefault(name, torch.zeros_like(main))
            if adam and not _keeps_step_per_group(inner):
                state["step"] = torch.tensor(float(step_of[main]), dtype=torch.float32)
            for name in ("fp32_param", *names):
                target = (main if name == "fp32_param" else state[name]).view(-1)
                at = 0
                for block in blocks[name]:
                    target[at:at + block.numel()].copy_(block.reshape(-1))
                    at += block.numel()
