"""The start-up summary rank 0 prints once: model size, layout, batch, LoCo and the
gradient bytes per step it implies."""

from __future__ import annotations

from loco_megatron.config import Config
from loco_megatron.distributed import ParallelLayout
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


def startup_summary(config: Config, layout: ParallelLayout, chunks: list, vocab_size: int) -> str:
    """Lines describing the run (for rank 0's console); ``chunks`` are this rank's DDP
    model chunks, so 'this rank' figures are rank 0's."""
    m, p, d, lc = config.model, config.parallel, config.data, config.loco
    total = parameter_count(m, vocab_size)
    here = sum(param.numel() for chunk in chunks for param in chunk.parameters())
    tokens = d.global_batch_size * m.seq_length
    numel, raw = _grad_buffer_bytes(chunks, config)
    lines = [
        f"model: {total:,} parameters ({total / 1e9:.3f} B), {here:,} on rank 0; "
        f"{training_flops_per_token(m, vocab_size) / 1e9:.3f} GFLOP per training token",
        f"layout: world {layout.world_size} = TP {p.tensor_model_parallel_size} x PP {layout.pp_size} "
        f"x DP {layout.dp_size} (VPP {p.virtual_pipeline_model_parallel_size or 1}, "
        f"EP {p.expert_model_parallel_size}, CP {p.context_parallel_size}), "
        f"sequence parallel {'on' if p.sequence_parallel else 'off'}, "
        f"recompute {m.recompute_granularity or 'none'}",
        f"batch: micro {d.micro_batch_size} x {d.global_batch_size // (d.micro_batch_size * layout.dp_size)} "
        f"micro batches x DP {layout.dp_size} = global {d.global_batch_size} samples = {tokens:,} tokens per step",
    ]
    if lc.enabled:
        sent = numel * lc.loco_bits // 8 + 4 * -(-numel // lc.loco_block_size)
        lines.append(
            f"LoCo: {lc.loco_bits}-bit {lc.loco_quantizer}/{lc.loco_scale}/rotation {lc.loco_rotation}/"
            f"{lc.loco_rounding}, block {lc.loco_block_size}, beta {lc.loco_beta}, error "
            f"{lc.loco_error_bits}-bit, reset every {lc.loco_reset_interval or 'never'}, warmup "
            f"{lc.loco_warmup_iters} steps; rank 0 hands {sent / 2**20:.2f} MiB of codes + scales to its "
            f"gradient collectives per step instead of {raw / 2**20:.2f} MiB (x{sent / max(raw, 1):.3f})")
    else:
        lines.append(f"LoCo: off; rank 0 reduce-scatters {raw / 2**20:.2f} MiB of gradients per step")
    return "\n".join(lines)
