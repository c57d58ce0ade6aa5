"""Optimizer and LR schedule settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config.base import check_choices, choice, require


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 1e-3
    """Peak learning rate."""
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
        require(self.lr > 0, "lr", "must be positive")
        require(0 <= self.min_lr <= self.lr, "min_lr", "must be in [0, --lr]")
        require(self.lr_warmup_iters >= 0, "lr_warmup_iters", "must be >= 0")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(self.clip_grad >= 0, "clip_grad", "must be >= 0")
        if self.lr_warmup_fraction is not None:
            require(0.0 <= self.lr_warmup_fraction < 1.0, "lr_warmup_fraction", "must be in [0, 1)")
            require(self.lr_warmup_iters == 0, "lr_warmup_fraction", "give either it or --lr-warmup-iters, not both")

    def warmup_iters(self, decay_iters: int) -> int:
        """Warmup steps: --lr-warmup-iters, or --lr-warmup-fraction of ``decay_iters`` (rounded down)."""
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * decay_iters)
        return self.lr_warmup_iters
