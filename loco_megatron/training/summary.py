"""What rank 0 prints about the run as a whole: the start-up summary (model size, layout,
batch, LoCo and the gradient bytes per step it implies, memory) and the end-of-run summary
(iterations, tokens, time, final losses, bytes sent, the last checkpoint)."""

from __future__ import annotations

import pathlib
import time
from typing import Optional

import torch

from loco_megatron.checkpoint import files
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
    """The dense grid, the expert grid (MoE: its own TP x EP x DP over the same ranks), the
    Megatron-FSDP sharding and the memory options. ``expert_dp``: 0 for a dense model."""
    m, p = config.model, config.parallel
    grids = ""  # the expert grid and the FSDP sharding, where they apply
    if m.num_experts is not None:
        grids = (f"; experts ETP {p.expert_tp} x EP {p.expert_model_parallel_size} x PP "
                 f"{p.pipeline_model_parallel_size} x expert DP {expert_dp}")
    if p.use_megatron_fsdp:
        n = p.num_distributed_optimizer_instances
        grids += (f"; Megatron-FSDP {p.data_parallel_sharding_strategy} over {dp // n} ranks"
                  + (f", replicated x{n} (HSDP)" if n > 1 else ""))
    replicas = config.diloco.replicas_in_world
    dp_part = f"DP {dp}" + (f" ({replicas} DiLoCo replicas x DP {dp // replicas})" if replicas > 1 else "")
    return (f"layout: world {world_size} = TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} "
            f"x {dp_part} (VPP {p.virtual_pipeline_model_parallel_size or 1}, CP {p.context_parallel_size}){grids}, "
            f"sequence parallel {'on' if p.sequence_parallel else 'off'}, "
            f"recompute {m.recompute_granularity or 'none'}, {m.transformer_impl} layers")


def batch_line(config: Config, dp: int) -> str:
    """``dp``: this job's data-parallel size. An elastic DiLoCo job is one replica of
    ``--diloco-replicas`` and trains on its share of the global batch."""
    d, m = config.data, config.model
    jobs = config.diloco.diloco_replicas if config.diloco.elastic else 1
    if jobs > 1 and config.diloco.diloco_batch_split != "fixed":
        return (f"batch: global {d.global_batch_size} samples = {d.global_batch_size * m.seq_length:,} tokens per step "
                f"over {jobs} replica jobs, shared by {config.diloco.diloco_batch_split} "
                f"(--diloco-batch-split: the shares are agreed at the first outer step)")
    samples = d.global_batch_size // jobs
    head = f"batch: micro {d.micro_batch_size} x {samples // (d.micro_batch_size * dp)} micro batches x DP {dp} = "
    if jobs == 1:
        return f"{head}global {samples} samples = {samples * m.seq_length:,} tokens per step"
    return (f"{head}{samples} samples = {samples * m.seq_length:,} tokens per step in this replica job (global "
            f"{d.global_batch_size} over {jobs} replica jobs)")


def loco_settings(config: Config) -> str:
    lc = config.loco
    return (f"LoCo: {lc.loco_bits}-bit {lc.loco_quantizer}/{lc.loco_scale}/rotation {lc.loco_rotation}/"
            f"{lc.loco_rounding}, block {lc.loco_block_size}, beta {lc.loco_beta}, error "
            f"{lc.loco_error_bits}-bit, reset every {lc.loco_reset_interval or 'never'}, warmup "
            f"{lc.loco_warmup_iters} steps")


def loco_compresses_nothing(config: Config, gradients: str = "gradients") -> str:
    """The LoCo line of a run (or dry run) in which no data-parallel group has more than one
    rank: LoCo is on, but nothing leaves a rank, so nothing is compressed."""
    return (f"{loco_settings(config)}; no data-parallel group of more than one rank here, so nothing is "
            f"compressed: {gradients} are synced exactly")


def startup_summary(config: Config, layout: ParallelLayout, chunks: list, vocab_size: int,
                    kernels_why: Optional[str] = None, compressed: Optional[int] = None) -> str:
    """Lines describing the run (for rank 0's console); ``chunks`` are this rank's DDP
    model chunks, so 'this rank' figures are rank 0's. ``kernels_why``: why the gradients'
    compression runs on torch where a fused path might have (see
    :func:`~loco_megatron.loco.kernel_choice.choose_kernels`). ``compressed``: the gradient
    elements LoCo compresses on rank 0 (its hook's ``memory_report()["params"]``; None: all);
    0 (no data-parallel group of more than one rank) makes the LoCo line say so instead of
    promising compressed bytes."""
    lc = config.loco
    here = sum(param.numel() for chunk in chunks for param in chunk.parameters())
    numel, raw = _grad_buffer_bytes(chunks, config)
    lines = [
        model_line(config, vocab_size, f", {here:,} on rank 0"),
        layout_line(config, layout.world_size, layout.dp_size, config.expert_data_parallel_size(layout.world_size)),
        batch_line(config, layout.dp_size),
    ]
    if lc.enabled and compressed == 0:
        lines.append(loco_compresses_nothing(config, f"gradients ({raw / 2**20:.2f} MiB on rank 0)"))
    elif lc.enabled:
        sent = numel * lc.loco_bits // 8 + 4 * -(-numel // lc.loco_block_size)
        gathered = ""
        if not config.megatron_distributed_optimizer and not config.parallel.use_megatron_fsdp:
            # Every rank needs every reduced gradient: its reduced row goes to the others at the buffer's dtype.
            row = raw // max(layout.dp_size // max(config.diloco.replicas_in_world, 1), 1)
            gathered = f" and {row / 2**20:.2f} MiB of reduced gradients (the all-gather of an all-reduce)"
            sent += row
        lines.append(
            f"{loco_settings(config)}; rank 0 hands {sent / 2**20:.2f} MiB of codes + scales{gathered} to its "
            f"gradient collectives per step instead of {raw / 2**20:.2f} MiB (x{sent / max(raw, 1):.3f})")
    elif layout.dp_size // max(config.diloco.replicas_in_world, 1) == 1:
        inside = " inside a DiLoCo replica" if config.diloco.diloco_replicas > 1 else ""
        lines.append(f"LoCo: off; no data-parallel group of more than one rank{inside}: no gradients are "
                     f"reduced between ranks at each step")
    else:
        verb = "reduce-scatters" if config.megatron_distributed_optimizer else "all-reduces"
        lines.append(f"LoCo: off; rank 0 {verb} {raw / 2**20:.2f} MiB of gradients per step")
    if config.optimizer.optimizer != "adam":  # (what --dry-run prints for every optimizer)
        from loco_megatron.training.memory_estimate import estimate, optimizer_line

        lines.append(optimizer_line(config, estimate(config, layout.world_size, vocab_size)))
    if lc.enabled or lc.param_gather_bits:
        popts = f"{lc.param_gather_bits}-bit {'/'.join(lc.param_gather_options().values())}"
        lines.append(kernels_line(lc.loco_kernels, lc.enabled, lc.param_gather_bits, kernels_why, popts))
    return "\n".join(lines)


def memory_line(grad_sync, param_sync) -> str:
    """One start-up line: what LoCo (``grad_sync``) and the compressed parameter gather
    (``param_sync``) keep and need at most on this rank ("" when neither is on)."""
    parts = []
    if hasattr(grad_sync, "memory_report") and grad_sync.memory_report()["params"]:
        # (nothing compressed here: the start-up summary's LoCo line says so)
        parts.append(loco_memory_part(grad_sync.memory_report()))
    if hasattr(param_sync, "memory_report"):
        mem = param_sync.memory_report()
        if mem["params"]:
            per = lambda b: b / mem["params"]  # noqa: E731
            parts.append(f"param gather memory on rank 0: agreed copy {mem['persistent'] / 2**20:.1f} MiB "
                         f"({per(mem['persistent']):.3f} B/param), transient up to {mem['transient'] / 2**20:.1f} MiB "
                         f"({per(mem['transient']):.3f} B/param) for {mem['params']:,} parameter elements")
        else:
            parts.append("param gather: no data-parallel group of more than one rank here: parameters are exact")
    return "; ".join(parts)


def loco_memory_part(mem: dict) -> str:
    """What LoCo keeps and needs at most on rank 0 (``mem["params"]`` > 0 compressed elements)."""
    per = lambda b: b / mem["params"]  # noqa: E731
    return (f"LoCo memory on rank 0: error buffers {mem['persistent'] / 2**20:.1f} MiB "
            f"({per(mem['persistent']):.3f} B/param), transient up to {mem['transient'] / 2**20:.1f} MiB "
            f"({per(mem['transient']):.3f} B/param) for {mem['params']:,} gradient elements")


BYTE_KEYS = ("comm/grad_bytes_sent", "comm/grad_bytes_uncompressed", "comm/param_bytes_sent",
             "comm/param_bytes_uncompressed", "comm/outer_bytes_sent", "comm/outer_bytes_uncompressed",
             "comm/outer_bytes_bf16_every_step")
"""The per-step byte counts of :meth:`loco_megatron.metrics.comm.CommStats.take` summed for the summary."""


class RunTotals:
    """This run's sums for the end-of-run summary: this rank's bytes handed to gradient and
    parameter collectives (host floats, from the per-step comm figures the trainer takes
    anyway), and the last logged train and eval loss (already reduced across ranks)."""

    def __init__(self, start_iteration: int, start_tokens: int, start_train_s: float):
        self.start_iteration, self.start_tokens, self.start_train_s = start_iteration, start_tokens, start_train_s
        self.bytes = dict.fromkeys(BYTE_KEYS, 0.0)
        self.losses: dict[str, tuple[int, float]] = {}
        """``train/lm_loss`` / ``eval/lm_loss`` -> (iteration, value) of the last one logged."""

    def add_step(self, comm: dict) -> None:
        for key in BYTE_KEYS:
            self.bytes[key] += comm.get(key, 0.0)

    def note(self, iteration: int, metrics: dict) -> None:
        for key in ("train/lm_loss", "eval/lm_loss"):
            if key in metrics:
                self.losses[key] = (iteration, metrics[key])

    def across_ranks(self, state, device: torch.device, started_at: float) -> dict:
        """Collective (every rank, once, at the end): the ``summary/...`` figures, bytes summed
        over all ranks. ``state``: the trainer's counters; ``started_at``: process start (epoch s)."""
        import torch.distributed as dist

        sums = torch.tensor([self.bytes[k] for k in BYTE_KEYS], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        out = {"summary/first_iteration": self.start_iteration, "summary/iteration": state.iteration,
               "summary/tokens": state.tokens_seen - self.start_tokens, "summary/tokens_total": state.tokens_seen,
               "summary/wall_s": time.time() - started_at, "summary/train_step_s": state.train_time_s - self.start_train_s}
        out.update({f"summary/{k[len('comm/'):]}": v for k, v in zip(BYTE_KEYS, sums.tolist())})
        for key, (iteration, value) in self.losses.items():
            name = key.split("/")[0]
            out[f"summary/{name}_loss"], out[f"summary/{name}_loss_iteration"] = value, iteration
        return out


def last_checkpoint(save_root: Optional[pathlib.Path]) -> Optional[pathlib.Path]:
    """The committed checkpoint ``--save``'s ``latest`` file names, None when there is none."""
    latest = save_root / files.LATEST if save_root is not None else None
    if latest is None or not latest.is_file() or not latest.read_text().strip().isdigit():
        return None
    path = files.iter_dir(save_root, int(latest.read_text().strip()))
    return path if path.is_dir() else None


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def outer_line(s: dict, world_size: int) -> str:
    """DiLoCo: what crossed between the replicas, against an fp32 all-reduce of the same
    outer gradients and against a bf16 all-reduce of the gradients between the replicas
    at every step (half the fp32 bytes of one exchange of the whole model, per step)."""
    sent, fp32 = s["summary/outer_bytes_sent"], s["summary/outer_bytes_uncompressed"]
    steps = max(s["summary/iteration"] - s["summary/first_iteration"], 1)
    every_step = s.get("summary/outer_bytes_bf16_every_step", 0.0)
    versus = f"; a bf16 all-reduce between the replicas at every step: {_mib(every_step)} (x{sent / every_step:.4f})" \
        if every_step else ""
    return (f"  between replicas (DiLoCo outer exchanges): {_mib(sent)}, {_mib(sent / steps)} per step over {steps} "
            f"steps, instead of {_mib(fp32)} as fp32 all-reduces (x{sent / fp32:.3f}){versus}; all {world_size} "
            f"ranks together")


def end_summary(s: dict, save_root: Optional[pathlib.Path], world_size: int) -> str:
    """The end-of-run block for rank 0's console from :meth:`RunTotals.across_ranks`'s figures."""
    ran = s["summary/iteration"] - s["summary/first_iteration"]
    resumed = f" (resumed at {s['summary/first_iteration']})" if s["summary/first_iteration"] else ""
    lines = [f"run summary: {ran} iteration{'' if ran == 1 else 's'} this run, now at iteration {s['summary/iteration']}{resumed}; "
             f"{s['summary/tokens']:,} tokens ({s['summary/tokens_total']:,} in all); wall time "
             f"{s['summary/wall_s']:.1f} s, of it {s['summary/train_step_s']:.1f} s in training steps"]
    losses = [f"{name} {s[f'summary/{name}_loss']:.4f} (iteration {s[f'summary/{name}_loss_iteration']})"
              for name in ("train", "eval") if f"summary/{name}_loss" in s]
    lines.append("  final loss: " + ("; ".join(losses) if losses else "none logged"))
    for what, key in (("gradients sent", "grad"), ("parameters all-gathered", "param")):
        sent, raw = s[f"summary/{key}_bytes_sent"], s[f"summary/{key}_bytes_uncompressed"]
        if raw:
            lines.append(f"  {what}: {_mib(sent)} instead of {_mib(raw)} uncompressed "
                         f"(x{sent / raw:.3f}), all {world_size} ranks together")
    if s.get("summary/outer_bytes_uncompressed"):
        lines.append(outer_line(s, world_size))
    ckpt = last_checkpoint(save_root)
    lines.append(f"  last checkpoint: {ckpt}" if ckpt else
                 "  last checkpoint: none saved" + ("" if save_root else " (no --save)"))
    return "\n".join(lines)
