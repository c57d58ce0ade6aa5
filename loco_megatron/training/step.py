"""One training step and one evaluation pass on megatron-core's pipeline schedules."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Iterator, Optional

import torch


@dataclasses.dataclass
class StepResult:
    loss: Optional[torch.Tensor]
    """Mean LM loss over the step's micro batches (last pipeline stage only, else None)."""
    grad_norm: float
    """Global gradient norm before clipping (NaN when the step was skipped)."""
    skipped: bool
    """True when a NaN/Inf gradient made the optimizer skip the update."""


def _loss_func(loss_mask: torch.Tensor, poison: bool, output_tensor: torch.Tensor):
    """Token-mean LM loss of one micro batch; ``poison`` makes it NaN (fault injection)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    if poison:
        loss = loss * float("nan")
    # clone: the schedule divides the returned loss in place by the micro-batch count.
    return loss, {"lm loss": loss.detach().clone()}


def make_forward_step(device: torch.device, poison: bool = False):
    def forward_step(data_iterator: Iterator[dict], model):
        batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(_loss_func, batch["loss_mask"], poison)

    return forward_step


def _mean_loss(losses_reduced: list) -> Optional[torch.Tensor]:
    if not losses_reduced:  # not the last pipeline stage
        return None
    return torch.stack([d["lm loss"] for d in losses_reduced]).mean()


def per_chunk(micro_batches: Iterator[dict], num_chunks: int):
    """The schedule's data iterator: itself for one chunk; with virtual pipeline stages
    one iterator per chunk over the same micro batches (every chunk's forward reads each
    micro batch once: the first stage its tokens, the last its labels)."""
    if num_chunks == 1:
        return micro_batches
    batches = list(micro_batches)
    return [iter(batches) for _ in range(num_chunks)]


def train_step(model_chunks: list, optimizer, scheduler, micro_batches: Iterator[dict],
               num_microbatches: int, seq_length: int, micro_batch_size: int, device: torch.device,
               poison: bool = False, ranges=None) -> StepResult:
    """Forward/backward over all micro batches (grad sync overlapped inside), then step.
    ``ranges(name)`` returns a context manager marking a named profiler range (optional)."""
    from contextlib import nullcontext

    from megatron.core.pipeline_parallel import get_forward_backward_func

    ranges = ranges or (lambda name: nullcontext())
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=make_forward_step(device, poison),
        data_iterator=per_chunk(micro_batches, len(model_chunks)),
        model=model_chunks, num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size, forward_only=False)
    # finalize_model_grads (run by the schedule) has waited for every bucket's
    # reduce-scatter, so the distributed optimizer reads fully reduced shards here.
    with ranges("optimizer_step"):
        ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=1)
    return StepResult(_mean_loss(losses), float("nan") if grad_norm is None else float(grad_norm), not ok)


@torch.no_grad()
def evaluate(model_chunks: list, micro_batch_steps: list, num_microbatches: int, seq_length: int,
             micro_batch_size: int, device: torch.device) -> Optional[torch.Tensor]:
    """Mean validation loss over the given steps' micro batches (last stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model_chunks:
        chunk.eval()
    total, n = None, 0
    for micro_batches in micro_batch_steps:
        losses = get_forward_backward_func()(
            forward_step_func=make_forward_step(device),
            data_iterator=per_chunk(micro_batches, len(model_chunks)),
            model=model_chunks, num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, forward_only=True)
        loss = _mean_loss(losses)
        if loss is not None:
            total = loss if total is None else total + loss
            n += 1
    for chunk in model_chunks:
        chunk.train()
    return None if total is None else total / n
