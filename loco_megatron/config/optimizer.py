"""Optimizer and LR schedule settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config.base import check_choices, choice, require


@dataclasses.dataclass
class OptimizerConfig:
    optimizer: str = choice("adam", ("adam", "muon"))
    """adam: megatron-core's AdamW (decoupled weight decay) on every parameter, its distributed
    optimizer with --use-distributed-optimizer. muon: Muon (momentum orthogonalised by a
    Newton-Schulz iteration) on the 2-D matrices of the transformer layers and AdamW on the
    rest (embeddings, output layer, norms, biases), sharded over the data-parallel ranks by
    whole parameters (megatron-core's layer-wise optimizer, Megatron-LM's --optimizer
    dist_muon; needs --use-distributed-optimizer); see docs/training.md, Muon."""
    lr: Optional[float] = None
    """Peak learning rate (with --optimizer muon: of both Muon and AdamW; Muon's update is
    scaled by --muon-scale-mode and --muon-extra-scale-factor). Default: the best of the sweeps of
    the default model (docs/benchmarks.md, section 13), by optimizer, data parallel or inside
    DiLoCo (--diloco-replicas): DEFAULT_LRS in loco_megatron/config/optimizer.py, listed in
    docs/training.md, "Learning rates", with the rule for another model size."""
    min_lr: float = 1e-4
    """Learning rate at the end of decay."""
    lr_warmup_iters: int = 0
    """Linear warmup iterations (or use --lr-warmup-fraction)."""
    lr_decay_style: str = choice("cosine", ("constant", "linear", "cosine"))
    """'constant', 'linear' or 'cosine'."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the LR decays (None = --train-iters)."""
    weight_decay: float = 0.1
    """Decoupled (AdamW) weight decay."""
    clip_grad: float = 1.0
    """Gradient-norm clipping threshold (0 = off)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    muon_momentum: float = 0.95
    """Muon: the momentum of its inner SGD (an exponential moving average of the gradients)."""
    muon_use_nesterov: bool = False
    """Muon: Nesterov momentum (orthogonalise ``lerp(grad, momentum, beta)`` instead of the momentum)."""
    muon_num_ns_steps: int = 5
    """Muon: Newton-Schulz iterations per orthogonalisation (torch.optim.Muon's, Keller Jordan's coefficients)."""
    muon_scale_mode: str = choice("spectral", ("spectral", "shape_scaling", "unit_rms_norm"))
    """Muon: the update's scale for an m x n matrix: spectral sqrt(max(m, n)) (an update of RMS 1, before
    --muon-extra-scale-factor), shape_scaling sqrt(max(1, m / n)) (Keller Jordan's), unit_rms_norm sqrt(m / n)."""
    muon_extra_scale_factor: Optional[float] = None
    """Muon: a factor on the scaled update (with the spectral scale the update's RMS is --lr times this).
    Default: the sweeps' best with Muon's default --lr, data parallel or inside DiLoCo (docs/training.md,
    "Learning rates"); Megatron-LM's default is 1.0, Moonshot's AdamW-matching value 0.2 at AdamW's --lr
    (arXiv 2502.16982)."""
    muon_tp_mode: str = choice("blockwise", ("blockwise", "duplicated"))
    """Muon under tensor parallelism: blockwise orthogonalises each TP rank's slice of a matrix on its own;
    duplicated all-gathers the slices over the TP group and orthogonalises the whole matrix on every TP rank.
    (Megatron-LM's distributed mode needs the emerging-optimizers package's Newton-Schulz.)"""
    muon_split_qkv: bool = dataclasses.field(default=True, metadata={"negative": "muon_no_split_qkv"})
    """Muon: orthogonalise the fused QKV matrix's query, key and value parts of each query group as
    separate matrices (megatron-core's split); --no-muon-split-qkv (Megatron-LM's --muon-no-split-qkv):
    the fused matrix as one."""
    lr_warmup_fraction: Optional[float] = None
    """Linear warmup as a fraction of the decay iterations (Megatron-LM's flag); replaces
    --lr-warmup-iters. A flag given on the command line overrides the other one's value
    from the config file."""
    override_opt_param_scheduler: bool = False
    """On a resume, take every LR-schedule value (--lr, --min-lr, warmup, decay length and
    style, --weight-decay) from this run, not from the checkpoint (Megatron-LM's flag). Without
    it or --use-checkpoint-opt-param-scheduler, the values given on the command line win and
    the others keep the checkpoint's; a differing value is named in one line."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On a resume, keep every LR-schedule value of the checkpoint, whatever this run's flags
    say (Megatron-LM's flag)."""

    def __post_init__(self):
        check_choices(self)
        require(not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
                "override_opt_param_scheduler", "give either it or --use-checkpoint-opt-param-scheduler, not both")
        # (--lr's default depends on DiLoCo too: the whole Config resolves it, default_lr)
        require(self.lr is None or self.lr > 0, "lr", "must be positive")
        require(0 <= self.min_lr <= (self.lr if self.lr is not None else float("inf")), "min_lr",
                "must be in [0, --lr]")
        require(self.lr_warmup_iters >= 0, "lr_warmup_iters", "must be >= 0")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(self.clip_grad >= 0, "clip_grad", "must be >= 0")
        require(0 <= self.muon_momentum < 1, "muon_momentum", "must be in [0, 1)")
        require(self.muon_num_ns_steps >= 1, "muon_num_ns_steps", "must be >= 1")
        require(self.muon_extra_scale_factor is None or self.muon_extra_scale_factor > 0, "muon_extra_scale_factor",
                "must be positive")
        if self.lr_warmup_fraction is not None:
            require(0.0 <= self.lr_warmup_fraction < 1.0, "lr_warmup_fraction", "must be in [0, 1)")
            require(self.lr_warmup_iters == 0, "lr_warmup_fraction", "give either it or --lr-warmup-iters, not both")

    def warmup_iters(self, decay_iters: int) -> int:
        """Warmup steps: --lr-warmup-iters, or --lr-warmup-fraction of ``decay_iters`` (rounded down)."""
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * decay_iters)
        return self.lr_warmup_iters


DEFAULT_LRS = {("adam", False): (3e-3, 0.025), ("muon", False): (6.4e-2, 0.025),
               ("adam", True): (1e-3, 0.5), ("muon", True): (1e-3, 0.5)}
"""(--lr, --muon-extra-scale-factor) by (--optimizer, DiLoCo on): the best cells of benchmarks/sweep.py on
the default model (docs/benchmarks.md, section 13). The factor of an AdamW run is Muon's of the same
setting (it reaches no parameter)."""


def default_lr(optimizer: str, diloco: bool) -> tuple[float, float]:
    """(--lr, --muon-extra-scale-factor) defaults for ``optimizer`` (adam or muon), data parallel or
    (``diloco``) as DiLoCo's inner optimizer: :data:`DEFAULT_LRS`. Inside DiLoCo both optimizers keep
    the smaller step: between two outer steps the replicas drift apart at the data-parallel one."""
    return DEFAULT_LRS[optimizer, diloco]
