"""megatron-core's optimizer (distributed Adam) and LR schedule."""

from __future__ import annotations

from loco_megatron.config import Config


def sub_optimizers(optimizer) -> list:
    """The optimizers inside megatron's: a ChainedOptimizer (dense + expert) lists its parts,
    a single optimizer is its own one part."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def build_optimizer(config: Config, model_chunks: list):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = config.optimizer
    opt_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=config.model.bf16,
        use_distributed_optimizer=config.parallel.use_distributed_optimizer,
        # A constant scale of 1 changes no number but turns on megatron's found-inf
        # check, so a NaN/Inf gradient (also one that LoCo carried) skips the step.
        loss_scale=1.0,
    )
    return get_megatron_optimizer(opt_config, model_chunks)


def build_scheduler(config: Config, optimizer):
    """LR warmup + decay in optimizer steps (megatron's scheduler, stepped by 1 per iteration)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, t = config.optimizer, config.train
    decay = o.lr_decay_iters or t.train_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_iters(decay), lr_decay_steps=decay,
        lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=decay, wd_incr_style="constant",
    )
