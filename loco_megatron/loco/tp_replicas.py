"""Tensor-parallel replicas of a parameter stay identical under LoCo.

With tensor parallelism, the parameters TP does not split (norm weights, biases of
row-parallel layers, the router, learned position embeddings) are replicated on every
TP rank and receive the same gradient there. Megatron keeps the copies equal by never
reducing them across TP: each TP rank's data-parallel reduction of an identical gradient
gives an identical result. LoCo breaks that: a replicated parameter shares its
quantisation blocks (and Hadamard rotations) with TP-split parameters whose values differ
between TP ranks, so each TP rank receives a differently quantised gradient and the
copies drift apart from the first step; a resume, which loads TP rank 0's copy on every
TP rank, would then not continue bit-exactly either.

:class:`ReplicaGradAverage` runs after megatron's ``finalize_model_grads`` (every
bucket's reduction finished) and averages the reduced gradients of those parameters
over the TP group: one all-reduce of their concatenation per step, in the same program
order on every rank. The parameters megatron itself reduces across TP there (norms
under sequence parallelism, qk-layernorm, ``average_gradients_across_tp_domain``) are
already equal and are left out. Without LoCo the gradients are equal already and
nothing is built (see :func:`needs_replica_average`).

Not covered: ``--param-gather-bits`` quantises the parameter differences in blocks that
mix replicated and TP-split parameters too, so the gathered (forward) copies of a
replicated parameter may differ between TP ranks by up to one quantisation step of the
gather (error-fed, so the difference does not grow); the optimizer's fp32 copies stay
equal.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from loco_megatron.loco.collectives import TORCH_OPS, CollectiveOps

__all__ = ["ReplicaGradAverage", "needs_replica_average", "tp_replicated_params"]


def needs_replica_average(loco_bits: int, tp_size: int) -> bool:
    """Only a compressed gradient sync with TP > 1 lets replicas drift."""
    return loco_bits > 0 and tp_size > 1


def tp_replicated_params(chunks: list, sequence_parallel: bool, qk_layernorm: bool) -> list:
    """Parameters with a gradient that TP replicates and megatron does not reduce over TP."""
    out = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad or getattr(p, "tensor_model_parallel", False):
                continue
            # Expert parameters (megatron marks them allreduce=False) live on the expert grid:
            # with --expert-tensor-parallel-size 1 the dense TP peers hold *different* experts
            # (parallel folding), and megatron allows unsplit (bias) expert parameters only
            # with ETP 1, so no expert parameter has a TP replica to agree with.
            if not getattr(p, "allreduce", True):
                continue
            if getattr(p, "average_gradients_across_tp_domain", False):
                continue
            if (sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                    qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
                continue
            out.append(p)
    return out


class ReplicaGradAverage:
    """``()`` averages ``main_grad`` of ``params`` over ``tp_group`` (in place).

    With the distributed optimizer only this rank's shard of a gradient is reduced; the
    TP peers hold the same shard (TP ranks lay out identical buffers), so averaging the
    whole tensors averages the shards that matter. ``scratch``: one fp32 buffer of the
    parameters' total size, allocated once."""

    def __init__(self, params: list, tp_group, ops: CollectiveOps = TORCH_OPS):
        self.params, self.group, self.ops = params, tp_group, ops
        self.size = dist.get_world_size(tp_group)
        numel = sum(p.numel() for p in params)
        device = params[0].main_grad.device if params else torch.device("cpu")
        self.scratch: Optional[torch.Tensor] = torch.empty(numel, dtype=torch.float32, device=device) if params else None

    def __call__(self) -> None:
        if not self.params:
            return
        views, offset = [], 0
        for p in self.params:
            n = p.numel()
            views.append((p.main_grad, self.scratch[offset:offset + n]))
            offset += n
        for grad, slot in views:
            slot.copy_(grad.reshape(-1))
        # SUM then scale: gloo has no AVG, and every rank gets the same sum, so the copies
        # end up bit-identical (exactly the old value when they were already equal and
        # the TP size is a power of two).
        self.ops.all_reduce(self.scratch, group=self.group)
        self.scratch.mul_(1.0 / self.size)
        for grad, slot in views:
            grad.copy_(slot.view_as(grad))
