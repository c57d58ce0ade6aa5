"""The start-up summary rank 0 prints once: model size, layout, batch, LoCo and the
gradient bytes per step it implies."""

from __future__ import annotations

from typing import Optional

from loco_megatron.config import Config
from loco_megatron.distributed import ParallelLayout
from loco_megatron.loco.kernel_choice import kernels_line
from loco_megatron.training.flops import parameter_count, training_flops_per_token


def _grad_buffer_bytes(chunks: list, config: Config) -> tuple[int, int]:
    """(elements, bytes) of this rank's gradient buffers, dense and expert, all chunks
    (Megatron-FSDP: of its parameter shards, what HSDP's cross-node reduction sends)."""
    numel = nbytes = 0
    if config.parallel.use_megatron_fsdp:
        numel = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                    for chunk in chunks for p in chunk.parameters())
        return numel, numel * (2 if config.parallel.grad_reduce_in_bf16 else 4)
    for chunk in chunks:
        for buf in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            numel += buf.grad_data.numel()
            nbytes += buf.grad_data.numel() * buf.grad_data.element_size()
    return numel, nbytes


def model_line(config: Config, vocab_size: int, on_rank0: str = "") -> str:
    """Whole-model size and FLOPs per token (``vocab_size``: the padded vocabulary)."""
    total = parameter_count(config.model, vocab_size)
    return (f"model: {total:,} parameters ({total / 1e9:.3f} B){on_rank0}; "
            f"{training_flops_per_token(config.model, vocab_size) / 1e9:.3f} GFLOP per training token")


def layout_line(config: Config, world_size: int, dp: int, expert_dp: int) -> str:
    """The dense grid, the expert grid (MoE: its own TP x EP x DP over the same ranks) and
    the memory options. ``expert_dp``: 0 for a dense model."""
    m, p = config.model, config.parallel
    experts = ""
    if m.num_experts is not None:
        experts = (f"; experts ETP {p.expert_tp} x EP {p.expert_model_parallel_size} x PP "
                   f"{p.pipeline_model_parallel_size} x expert DP {expert_dp}")
    return (f"layout: world {world_size} = TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} "
            f"x DP {dp} (VPP {p.virtual_pipeline_model_parallel_size or 1}, CP {p.context_parallel_size}){experts}, "
            f"sequence parallel {'on' if p.sequence_parallel else 'off'}, "
            f"recompute {m.recompute_granularity or 'none'}, {m.transformer_impl} layers")


def batch_line(config: Config, dp: int) -> str:
    d, m = config.data, config.model
    return (f"batch: micro {d.micro_batch_size} x {d.global_batch_size // (d.micro_batch_size * dp)} "
            f"micro batches x DP {dp} = global {d.global_batch_size} samples = "
            f"{d.global_batch_size * m.seq_length:,} tokens per step")


def loco_settings(config: Config) -> str:
    lc = config.loco
    return (f"LoCo: {lc.loco_bits}-bit {lc.loco_quantizer}/{lc.loco_scale}/rotation {lc.loco_rotation}/"
            f"{lc.loco_rounding}, block {lc.loco_block_size}, beta {lc.loco_beta}, error "
            f"{lc.loco_error_bits}-bit, reset every {lc.loco_reset_interval or 'never'}, warmup "
            f"{lc.loco_warmup_iters} steps")


def startup_summary(config: Config, layout: ParallelLayout, chunks: list, vocab_size: int,
                    kernels_why: Optional[str] = None) -> str:
    """Lines describing the run (for rank 0's console); ``chunks`` are this rank's DDP
    model chunks, so 'this rank' figures are rank 0's. ``kernels_why``: why the gradients'
    compression runs on torch where a fused path might have (see
    :func:`~loco_megatron.loco.kernel_choice.choose_kernels`)."""
    lc = config.loco
    here = sum(param.numel() for chunk in chunks for param in chunk.parameters())
    numel, raw = _grad_buffer_bytes(chunks, config)
    lines = [
        model_line(config, vocab_size, f", {here:,} on rank 0"),
        layout_line(config, layout.world_size, layout.dp_size, config.expert_data_parallel_size(layout.world_size)),
        batch_line(config, layout.dp_size),
    ]
    if lc.enabled:
        sent = numel * lc.loco_bits // 8 + 4 * -(-numel // lc.loco_block_size)
        lines.append(
            f"{loco_settings(config)}; rank 0 hands {sent / 2**20:.2f} MiB of codes + scales to its "
            f"gradient collectives per step instead of {raw / 2**20:.2f} MiB (x{sent / max(raw, 1):.3f})")
    else:
        lines.append(f"LoCo: off; rank 0 reduce-scatters {raw / 2**20:.2f} MiB of gradients per step")
    if lc.enabled or lc.param_gather_bits:
        popts = f"{lc.param_gather_bits}-bit {'/'.join(lc.param_gather_options().values())}"
        lines.append(kernels_line(lc.loco_kernels, lc.enabled, lc.param_gather_bits, kernels_why, popts))
    return "\n".join(lines)
