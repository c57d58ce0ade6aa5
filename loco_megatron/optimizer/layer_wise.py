"""megatron-core's layer-wise distributed optimizer, as --optimizer muon runs it.

``LayerWiseDistributedOptimizer`` (megatron-core 0.16) chains Muon and AdamW, gives each
data-parallel rank whole parameters (sorted by size, dealt ping-pong), lets DDP all-reduce
whole gradients, steps each rank's own parameters and all-gathers them. :class:`LayerWise`
keeps all of that and changes what a run here needs:

* the gradient statistics (the found-inf check, the norm, the zero count) are reduced over
  ``stats_group``, the ranks holding one model replica (None: the world; under DiLoCo a
  replica's ranks): megatron's reduces the norm over the world (every DiLoCo replica in
  one sum) and checks for NaN/Inf over nothing (bf16: no grad scaler; fp32: none at all),
  so a rank owning a non-finite gradient would step alone;
* the all-gather of the updated parameters is part of ``step_with_ready_grads``, so DiLoCo's
  outer update, which runs as an optimizer step (:mod:`loco_megatron.loco.hooks.diloco`),
  reaches every rank of the replica; it gathers each dtype apart (see
  :meth:`LayerWise.allgather_params`), and its bytes and time are counted in the run's
  :class:`~loco_megatron.metrics.comm.CommStats` (``comm/param_*``);
* main (fp32) parameters carry the model parameter's ``is_qkv`` and ``expert_tp`` marks,
  which megatron's Float16 wrapper does not copy (Muon would skip the QKV split and use the
  dense TP group for experts under --bf16).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from loco_megatron.loco.hooks.version import check_megatron_core_version


def _layer_wise_class():
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    return LayerWiseDistributedOptimizer


class LayerWise(_layer_wise_class()):
    """``optimizers``: megatron optimizers (FP32Optimizer-wrapped torch optimizers, before
    sharding); ``config``: megatron's OptimizerConfig (with ``bf16`` the optimizers get
    fp32 main params after sharding, for their own parameters only); ``groups``: megatron's
    ProcessGroupCollection with ``dp_cp`` and ``expt_dp`` (the ranks the parameters are
    dealt over); ``stats_group``: see the module docstring; ``stats``: the run's CommStats
    (None: not counted)."""

    def __init__(self, optimizers: list, config, groups, stats_group=None, stats=None):
        check_megatron_core_version()
        super().__init__(optimizers, config, groups)
        self.stats_group, self.stats = stats_group, stats
        for opt in self.chained_optimizers:  # (Float16 wrappers: the main params' marks)
            for model_group, main_group in zip(getattr(opt, "float16_groups", ()),
                                               getattr(opt, "fp32_from_float16_groups", ())):
                for model, main in zip(model_group, main_group):
                    for mark in ("is_qkv", "expert_tp"):
                        if hasattr(model, mark):
                            setattr(main, mark, getattr(model, mark))
        lists = [x for x in (self.dp_cp_params_list, self.expt_dp_params_list) if x]
        self._gathered_bytes = sum(p.numel() * p.element_size() for x in lists for params in x for p in params)

    def _own_grads(self) -> list:
        return [p.grad for opt in self.chained_optimizers for p in opt.get_parameters() if p.grad is not None]

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Megatron's (main grads in place), then whether any rank of ``stats_group`` holds
        a non-finite gradient (one all-reduce, as the distributed optimizer's check)."""
        super().prepare_grads()
        grads = self._own_grads()
        device = grads[0].device if grads else torch.device(torch.cuda.current_device())
        found = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones(1, device=device))
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.stats_group)
        return found.item() > 0

    @torch.no_grad()
    def get_grad_norm(self):
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

        grads = [g for opt in self.chained_optimizers for g in opt.get_main_grads_for_grad_norm()]
        return get_grad_norm_fp32(grads, grad_stats_parallel_group=self.stats_group)

    @torch.no_grad()
    def count_zeros(self):
        from megatron.core.optimizer.clip_grads import count_zeros_fp32

        params = [p for opt in self.chained_optimizers for p in opt.get_parameters()]
        return count_zeros_fp32(params, grad_stats_parallel_group=self.stats_group)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Every sub-optimizer's step on this rank's parameters, then their all-gather."""
        ok = super().step_with_ready_grads()
        self.allgather_params()
        return ok

    @torch.no_grad()
    def step(self):
        # megatron's LayerWise.step gathers after ChainedOptimizer.step; here the gather is in
        # step_with_ready_grads (which ChainedOptimizer.step calls unless a gradient is not finite).
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        return ChainedOptimizer.step(self)

    @torch.no_grad()
    def allgather_params(self) -> None:
        """Every rank's updated parameters to every rank of the group they were dealt over,
        one all-gather per dtype (of different sizes per rank: NCCL's all-gather-v).
        megatron-core's gathers all of them in the dtype of the group's first parameter: in a
        --bf16 model with fp32 norms that sends the bf16 matrices as fp32, and where a bf16
        parameter comes first it rounds the fp32 ones, so the ranks' copies drift apart."""
        start = self.stats.clock.mark() if self.stats is not None else None
        for params_list, group in ((self.dp_cp_params_list, self.pg_collection.dp_cp),
                                   (self.expt_dp_params_list, self.pg_collection.expt_dp)):
            if params_list:
                _gather_whole(params_list, group)
        if start is not None and self._gathered_bytes:
            self.stats.add_interval("param_gather", start, self.stats.clock.mark())
            self.stats.add_param_bytes(self._gathered_bytes, self._gathered_bytes)

    def instrument(self, wrap) -> None:
        """Let a profiler put ``muon/newton_schulz`` around every orthogonalisation and
        ``param_gather`` around the all-gather (``wrap(obj, method_name, range_name)``)."""
        for opt in self.chained_optimizers:
            if hasattr(opt.optimizer, "scaled_orthogonalize_fn"):
                wrap(opt.optimizer, "scaled_orthogonalize_fn", "muon/newton_schulz")
        wrap(self, "allgather_params", "param_gather")


def _gather_whole(params_list: list, group) -> None:
    """``params_list[r]``: the parameters group rank ``r`` updated; after this every rank
    holds every one of them. Per dtype, in an order every rank knows from ``params_list``."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    rank = dist.get_rank(group)
    device = next(p.device for params in params_list for p in params)
    for dtype in sorted({p.dtype for params in params_list for p in params}, key=str):
        lists = [[p for p in params if p.dtype == dtype] for params in params_list]
        mine = _flatten_dense_tensors(lists[rank]) if lists[rank] else torch.empty(0, dtype=dtype, device=device)
        out = [torch.empty(sum(p.numel() for p in ps), dtype=dtype, device=device) for ps in lists]
        dist.all_gather(out, mine, group=group)
        for r, (flat, ps) in enumerate(zip(out, lists)):
            if r != rank and ps:
                for new, p in zip(_unflatten_dense_tensors(flat, ps), ps):
                    p.data.copy_(new)


def owned(optimizer) -> Optional[list]:
    """Per sub-optimizer of a :class:`LayerWise` optimizer, this rank's ``[(model param,
    fp32 main param)]`` in the sub-optimizer's order (the main param is the model param
    itself when that is fp32); None for any other optimizer."""
    if not isinstance(optimizer, LayerWise):
        return None
    out = []
    for opt in optimizer.chained_optimizers:
        model_of = {}
        for model_group, main_group in zip(getattr(opt, "float16_groups", ()),
                                           getattr(opt, "fp32_from_float16_groups", ())):
            model_of.update({id(main): model for model, main in zip(model_group, main_group)})
        out.append([(model_of.get(id(p), p), p) for p in opt.get_parameters()])
    return out
