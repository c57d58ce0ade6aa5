"""Labels of a run's training variant, from its flat config (the ``config`` record of a
metrics file, or wandb's run config), so that runs are compared like with like.

:func:`describe` is the short label of the communication scheme (``LoCo 4-bit + params
4-bit``); :func:`variant` adds everything else that changes the numbers a dashboard
compares: two-hop, the quantiser options, the error-feedback ablations and the dtype.
Runs that differ in any of these are never averaged together (wandb groups by it).
"""

from __future__ import annotations

from loco_megatron.config.diloco import default_outer_lr

__all__ = ["describe", "variant"]


def describe(config: dict) -> str:
    """Human label of a run's gradient sync (and compressed parameter gather, and DiLoCo)."""
    label = _describe_grads(config)
    pbits = config.get("param_gather_bits", 0)
    label = f"{label} + params {pbits}-bit" if pbits else label
    return label + _describe_diloco(config)


def _describe_diloco(config: dict) -> str:
    """`` + DiLoCo 2x H32 outer LoCo 4-bit`` (F, tau, alpha, eager and the ablations where set), or ""."""
    replicas = config.get("diloco_replicas", 0)
    if not replicas:
        return ""
    bits = config.get("diloco_outer_bits", 0)
    outer = "fp32" if not bits else (f"{bits}-bit, no error feedback" if config.get("diloco_outer_error_feedback")
                                     is False else f"LoCo {bits}-bit")
    if config.get("diloco_outer_topk"):
        outer = (f"SparseLoCo top {config['diloco_outer_topk']}/{config.get('diloco_outer_chunk', 4096)} "
                 f"{f'{bits}-bit' if bits else 'fp32'}"
                 + (", no error feedback" if config.get("diloco_outer_error_feedback") is False else "")
                 + (", mean over all replicas" if config.get("diloco_outer_topk_mean") == "all" else ""))
    label = f" + DiLoCo {replicas}x H{config.get('diloco_inner_steps')}"
    fragments, tau = config.get("diloco_fragments", 1), config.get("diloco_sync_delay", 0)
    if fragments > 1 or tau:
        label += f" F{fragments} tau{tau} alpha{config.get('diloco_mixing_factor')}"
    if config.get("diloco_eager"):
        label += " naive delay" if config.get("diloco_eager_naive") else " eager"
    return f"{label} outer {outer}"


def _describe_grads(config: dict) -> str:
    bits = config.get("loco_bits", 0)
    if bits:
        # loco_no_error_feedback: the option's name in metrics files written before the rename
        if config.get("loco_error_feedback") is False or config.get("loco_no_error_feedback"):
            return f"{bits}-bit, no error feedback"
        if config.get("loco_beta", 0.8) == 0:
            return f"{bits}-bit error feedback (beta 0)"
        return f"LoCo {bits}-bit"
    return "bf16 reduce-scatter" if config.get("grad_reduce_in_bf16") else "fp32 reduce-scatter"


def variant(config: dict) -> str:
    """``describe`` plus two-hop, quantiser options and dtype, e.g. ``LoCo 2-bit
    (uniform/mse/hadamard/nearest) + two-hop intra 8-bit | bf16``."""
    label = _describe_grads(config)
    if config.get("loco_bits", 0):
        opts = [config.get(f"loco_{k}") for k in ("quantizer", "scale", "rotation", "rounding")]
        if any(opts):
            label += f" ({'/'.join(str(o) for o in opts)})"
        if config.get("loco_hierarchical"):
            label += f" + two-hop intra {config.get('loco_intra_node_bits', 8)}-bit"
    pbits = config.get("param_gather_bits", 0)
    if pbits:
        label += f" + params {pbits}-bit"
    label += _describe_diloco(config)
    # (the defaults: DiLoCo's measured LR with momentum 0.9, SparseLoCo's SGD at LR 1)
    h = config.get("diloco_inner_steps", 32)
    default = (1.0, 0.0) if config.get("diloco_outer_topk") else (default_outer_lr(h), 0.9)
    if config.get("diloco_replicas") and (config.get("diloco_outer_lr", default[0]),
                                          config.get("diloco_outer_momentum", default[1])) != default:
        label += f" (lr {config.get('diloco_outer_lr')}, momentum {config.get('diloco_outer_momentum')})"
    return f"{label} | {'bf16' if config.get('bf16') else 'fp32'}"
