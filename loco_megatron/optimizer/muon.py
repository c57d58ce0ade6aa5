"""Muon for megatron-core's 2-D hidden matrices: torch's Muon with megatron-core's conventions.

The update of one matrix ``W`` with gradient ``G`` (fp32, shape ``[m, n]``)::

    B <- lerp(B, G, 1 - beta)                     (momentum_buffer, --muon-momentum beta)
    U <- lerp(G, B, beta) if nesterov else B      (--muon-use-nesterov)
    O <- NS(U) * scale(m, n) * extra              (--muon-scale-mode, --muon-extra-scale-factor)
    W <- W * (1 - lr * wd) - lr * O

with ``NS`` torch.optim.Muon's Newton-Schulz iteration (bf16, Keller Jordan's coefficients,
--muon-num-ns-steps) and the scale megatron-core's (emerging-optimizers'
``get_muon_scale_factor``). What megatron-core's ``TensorParallelMuon`` adds to the matrix
maths is used as it is (its ``orthogonalize``, which this class takes over): the fused QKV
matrix split per query group into its query, key and value parts, each orthogonalised on
its own, and the tensor-parallel group of a parameter (the expert one for experts). Its
base class and its Newton-Schulz come from the emerging-optimizers package, which needs
Python >= 3.12; the step and the Newton-Schulz here are torch's. Written here: the step
loop (torch.optim.Muon's own runs one Newton-Schulz per tensor, so it could not split QKV),
the scale, and --muon-tp-mode duplicated (all-gather a TP-sharded matrix, orthogonalise
it whole, keep this rank's slice). With the ``spectral`` scale and an extra factor of 0.2
one step equals ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``'s (tested).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.optim._muon import _zeropower_via_newtonschulz


def muon_scale(rows: int, cols: int, mode: str) -> float:
    """The update's scale for a ``rows x cols`` matrix (megatron-core's modes)."""
    if mode == "spectral":  # RMS 1: an orthogonal m x n matrix has RMS 1 / sqrt(max(m, n))
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode!r}")


def _gathered(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """``x`` concatenated along ``dim`` with its peers' in ``group`` (rank order)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _megatron_orthogonalize():
    """megatron-core's ``TensorParallelMuon.orthogonalize``: the QKV split and the choice of
    TP group and partition dim. A plain function of the class, importable without the
    emerging-optimizers package (its base class is then ``object``)."""
    from megatron.core.optimizer.muon import TensorParallelMuon

    return TensorParallelMuon.orthogonalize


class Muon(torch.optim.Muon):
    """torch.optim.Muon's state (``momentum_buffer``) and checks, megatron-core's update.

    ``qkv_split_shapes``: rows of one query group's query, key and value parts
    (``[heads / groups * kv_channels, kv_channels, kv_channels]``); a parameter with
    ``is_qkv`` set is split by them. ``tp``, ``expert_tp``: the tensor-parallel groups (None:
    no TP); a parameter with ``expert_tp`` set uses the second. ``tp_mode``: blockwise or
    duplicated (see the module docstring). Parameters: 2-D, fp32 (megatron's main params).
    """

    def __init__(self, params, lr: float, momentum: float, nesterov: bool, weight_decay: float, ns_steps: int,
                 scale_mode: str, extra_scale_factor: float, split_qkv: bool, qkv_split_shapes: tuple,
                 tp_mode: str = "blockwise", tp=None, expert_tp=None):
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         ns_steps=ns_steps)
        muon_scale(2, 1, scale_mode)  # (a bad mode fails here, not at the first step)
        self.scale_mode, self.extra_scale_factor = scale_mode, extra_scale_factor
        # What megatron-core's orthogonalize reads from its optimizer:
        self.split_qkv, self.qkv_split_shapes = split_qkv, list(qkv_split_shapes)
        self.is_qkv_fn = lambda p: getattr(p, "is_qkv", False)
        self.mode = tp_mode
        self.pg_collection = _Groups(tp, expert_tp) if tp is not None else None

    orthogonalize = _megatron_orthogonalize()

    def scaled_orthogonalize_fn(self, grad: torch.Tensor, tp_group, partition_dim: Optional[int]) -> torch.Tensor:
        """``NS(grad) * scale * extra`` in fp32; ``partition_dim`` (duplicated mode, a TP-split
        matrix): orthogonalise the matrix gathered over ``tp_group``, return this rank's slice."""
        group = self.param_groups[0]
        size = list(grad.shape)
        whole = partition_dim is not None and tp_group is not None and dist.get_world_size(tp_group) > 1
        if whole:
            grad = _gathered(grad, partition_dim, tp_group)
            size = list(grad.shape)
        orth = _zeropower_via_newtonschulz(grad, group["ns_coefficients"], group["ns_steps"], group["eps"])
        if whole:
            orth = orth.chunk(dist.get_world_size(tp_group), dim=partition_dim)[dist.get_rank(tp_group)]
        return orth.float() * (muon_scale(size[0], size[1], self.scale_mode) * self.extra_scale_factor)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)  # torch's: momentum buffers, checks
            beta = group["momentum"]
            for p, g, buf in zip(params, grads, buffers):
                buf.lerp_(g, 1 - beta)
                update = g.lerp(buf, beta) if group["nesterov"] else buf
                update = self.orthogonalize(p, update)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return None


class _Groups:
    """The two groups megatron-core's orthogonalize reads (``pg_collection.tp``/``.expt_tp``)."""

    def __init__(self, tp, expt_tp):
        self.tp, self.expt_tp = tp, expt_tp if expt_tp is not None else tp
