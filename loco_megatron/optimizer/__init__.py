"""megatron-core's optimizers and LR schedule: AdamW (the distributed optimizer) or Muon
with AdamW (the layer-wise optimizer, :mod:`.layer_wise`; the Muon maths: :mod:`.muon`)."""

from __future__ import annotations

import contextlib
import dataclasses

from loco_megatron.config import Config


def sub_optimizers(optimizer) -> list:
    """The optimizers inside megatron's: a ChainedOptimizer (dense + expert; Muon + AdamW)
    lists its parts, a single optimizer is its own one part."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def megatron_config(config: Config):
    """megatron-core's OptimizerConfig of the run."""
    from megatron.core.optimizer import OptimizerConfig

    o = config.optimizer
    return OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=config.model.bf16,
        use_distributed_optimizer=config.megatron_distributed_optimizer,
        # A constant scale of 1 changes no number but turns on megatron's found-inf
        # check, so a NaN/Inf gradient (also one that LoCo carried) skips the step.
        loss_scale=1.0,
        muon_momentum=o.muon_momentum, muon_use_nesterov=o.muon_use_nesterov, muon_num_ns_steps=o.muon_num_ns_steps,
        muon_scale_mode=o.muon_scale_mode, muon_extra_scale_factor=o.muon_extra_scale_factor,
        muon_tp_mode=o.muon_tp_mode, muon_split_qkv=o.muon_split_qkv,
    )


def build_optimizer(config: Config, model_chunks: list, stats=None):
    """The run's optimizer over ``model_chunks``. ``stats``: the run's CommStats (Muon's
    parameter all-gather counts its bytes and time there)."""
    if config.optimizer.optimizer == "muon":
        return build_muon(config, model_chunks, stats)
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(megatron_config(config), model_chunks)


def muon_split(model_chunks: list) -> tuple[list, list]:
    """(Muon's, AdamW's) ``[(name, param)]`` of the trainable parameters, in model order.
    Muon takes the 2-D matrices of the transformer layers: megatron-core's rule (2-D and not
    the word embedding or output layer) without the learned position table, an embedding
    too. Marks as megatron-core's Muon does: ``is_qkv`` on the fused QKV matrices (split per
    query group), ``expert_tp`` on expert parameters (their TP group is the expert one).
    Each expert's matrices are parameters of their own (megatron's SequentialMLP)."""
    muon, adamw = [], []
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            parts = name.split(".")
            if "experts" in parts and "shared_experts" not in parts:
                p.expert_tp = True
            if name.endswith("linear_qkv.weight") and p.dim() == 2:
                p.is_qkv = True
            matrix = p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False)
            (muon if matrix and "embedding" not in parts else adamw).append((name, p))
    return muon, adamw


@contextlib.contextmanager
def _frozen(params: list):
    """``params`` without ``requires_grad`` meanwhile: megatron's optimizer factories skip
    them (megatron's own Muon builds its two halves this way)."""
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def build_muon(config: Config, model_chunks: list, stats=None):
    """Muon on :func:`muon_split`'s matrices and megatron's AdamW on the rest, chained in
    :class:`.layer_wise.LayerWise`: each data-parallel rank (of a DiLoCo replica) steps whole
    parameters of its share and all-gathers them. megatron-core's own builder
    (``get_megatron_muon_optimizer``) needs the emerging-optimizers package; this follows it."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    from loco_megatron.loco.hooks.param_groups import megatron_param_groups
    from loco_megatron.optimizer.layer_wise import LayerWise
    from loco_megatron.optimizer.muon import Muon

    o = config.optimizer
    mconfig = dataclasses.replace(megatron_config(config), bf16=False, loss_scale=None)
    muon_params, adamw_params = ([p for _, p in named] for named in muon_split(model_chunks))
    with _frozen(adamw_params):
        groups = megatron_param_groups(model_chunks, mconfig)
    t = model_chunks[0].config
    kv = t.kv_channels
    muon = Muon(groups, lr=o.lr, momentum=o.muon_momentum, nesterov=o.muon_use_nesterov, weight_decay=o.weight_decay,
                ns_steps=o.muon_num_ns_steps, scale_mode=o.muon_scale_mode,
                extra_scale_factor=o.muon_extra_scale_factor, split_qkv=o.muon_split_qkv,
                qkv_split_shapes=(t.num_attention_heads // t.num_query_groups * kv, kv, kv), tp_mode=o.muon_tp_mode,
                tp=ps.get_tensor_model_parallel_group(), expert_tp=ps.get_expert_tensor_parallel_group())
    with _frozen(muon_params):
        adamw = get_megatron_optimizer(mconfig, model_chunks)
    replicas = config.diloco.replicas_in_world > 1
    dealt = ProcessGroupCollection()
    dealt.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=replicas)
    dealt.expt_dp = ps.get_expert_data_parallel_group(partial_expert_data_parallel=replicas)
    return LayerWise([FP32Optimizer(muon, mconfig, None), *adamw.chained_optimizers],
                     dataclasses.replace(mconfig, bf16=config.model.bf16), dealt,
                     stats_group=ps.get_intra_distributed_optimizer_instance_group() if replicas else None, stats=stats)


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
