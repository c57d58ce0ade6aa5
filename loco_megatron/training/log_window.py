"""The log window: per-step figures accumulated on the device, reduced across ranks only
at the log interval (every rank joins each reduction, in the same order), then logged.

Collectives here: one all-reduce of the loss over DP (and PP), the comm means and maxima
over the world, LoCo's error sums, and with --param-gather-bits the parameter-error sums,
always in this order, on every rank, once per log interval. Under DiLoCo every one of them
runs inside the replica (its data-parallel ranks, its ranks): no log window waits on the
link between replicas, and rank 0 logs replica 0's figures."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from loco_megatron.distributed import ParallelLayout
from loco_megatron.loco.hooks import ParamGatherHook
from loco_megatron.metrics.comm import CommStats, loco_metrics, param_metrics
from loco_megatron.metrics.logger import MetricsLogger
from loco_megatron.training.state import TrainerState, peak_memory_bytes

def reduce_for_logging(value: torch.Tensor, layout: ParallelLayout) -> float:
    """Mean over the data-parallel ranks (of the replica, under DiLoCo) of a last-stage
    value, delivered to every stage."""
    from megatron.core import parallel_state as ps

    value = value.detach().float().clone()
    dist.all_reduce(value, group=layout.inner_dp_group())
    value /= layout.inner_dp_size
    if layout.pp_size > 1:  # non-last stages contribute zeros
        dist.all_reduce(value, group=ps.get_pipeline_model_parallel_group())
    return value.item()


def param_sums_across_ranks(window: dict, device, group=None) -> torch.Tensor:
    """--param-gather-bits: the window's ``(||agreed-main||^2, ||main||^2, non-finite)``
    sums over the ranks of ``group`` (None: all; every rank joins; zeros where nothing
    was gathered)."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    if window["param"] is not None:
        sums += window["param"].to(device=device, dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    return sums


def comm_across_ranks(comm: dict, loco_sums, steps: int, device, group=None) -> dict:
    """Per-step means of this rank's comm figures -> mean and max over the ranks of
    ``group`` (None: all); LoCo's error sums -> one RMS and one relative error over every
    such rank, bucket and step."""
    if not comm:
        return {}
    keys = sorted(comm)
    local = torch.tensor([comm[k] / steps for k in keys], dtype=torch.float64, device=device)
    mean, top = local.clone(), local.clone()
    dist.all_reduce(mean, group=group)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    mean /= dist.get_world_size(group)
    out = {k: mean[i].item() for i, k in enumerate(keys)}
    out.update({f"{k}_max": top[i].item() for i, k in enumerate(keys)})
    raw = out["comm/grad_bytes_uncompressed"]
    out["comm/compression_ratio"] = out["comm/grad_bytes_sent"] / raw if raw else 1.0
    del out["comm/compression_ratio_max"]
    raw = out["comm/param_bytes_uncompressed"]
    out["comm/param_compression_ratio"] = out["comm/param_bytes_sent"] / raw if raw else 1.0
    # Achieved bandwidth: bytes a rank handed to its gradient and parameter collectives
    # over the time they were in flight, in Gbit/s (mean rank). Overlapping buckets' times
    # add up, so this is a lower bound on the link's rate.
    busy = out.get("comm/grad_sync_total_s", 0.0) + out.get("comm/param_gather_s", 0.0)
    sent = out["comm/grad_bytes_sent"] + out["comm/param_bytes_sent"]
    out["comm/busbw_gbps"] = sent * 8 / busy / 1e9 if busy > 0 else 0.0
    # Every rank joins the reduction (zeros where nothing was compressed this window).
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    if loco_sums is not None:
        sums += loco_sums.to(device=device, dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    if sums[3] > 0:
        out.update(loco_metrics(sums))
    return out


def outer_metrics(outer, device, group=None) -> dict:
    """Collective (every rank of ``group``): ``diloco/outer_steps`` and
    ``diloco/nonfinite_means`` (outer means replaced by zero since the last window, summed
    over the replica's ranks: every replica decodes the same means)."""
    bad = outer.take_nonfinite().to(device=device, dtype=torch.float64)
    dist.all_reduce(bad, group=group)
    out = {"diloco/outer_steps": float(outer.outer_steps), "diloco/nonfinite_means": bad.item()}
    coordinator = getattr(outer, "coordinator", None)
    if coordinator is not None:  # elastic: the replicas of the last quorum
        out["diloco/live_replicas"] = float(coordinator.live_replicas)
    return out


def accumulate(window: dict, result, comm: dict, loco_sums) -> None:
    if result.loss is not None and not result.skipped:
        window["loss"] += result.loss
    window["steps"] += 1
    window["skipped"] += int(result.skipped)
    if not result.skipped:
        window["grad_norm"] = result.grad_norm
    for k, v in comm.items():
        window["comm"][k] = window["comm"].get(k, 0.0) + v
    if loco_sums is not None:  # stays on the device until the log interval
        window["loco"] = loco_sums if window["loco"] is None else window["loco"] + loco_sums


def accumulate_param(window: dict, comm_stats: CommStats) -> None:
    sums = comm_stats.take_param_sums()
    if sums is not None:  # stays on the device until the log interval
        window["param"] = sums if window["param"] is None else window["param"] + sums


def log_window(window: dict, state: TrainerState, optimizer, layout: ParallelLayout, device,
                tokens_per_step: int, logger: MetricsLogger, total_iters: int, throughput,
                gathers_params: bool, comm_stats: CommStats, outer=None) -> dict:
    """Reduce the interval's figures across ranks (only here, not every step) and log.
    ``comm_stats``: its intervals are resolved here (:meth:`CommStats.take_seconds`);
    ``outer``: DiLoCo's outer step (``diloco/`` metrics), None without it."""
    for k, v in comm_stats.take_seconds().items():
        window["comm"][k] = window["comm"].get(k, 0.0) + v
    steps = window["steps"]
    counted = max(steps - window["skipped"], 1)
    elapsed = time.perf_counter() - window["t0"]
    loss = reduce_for_logging(window["loss"] / counted, layout)  # collective: every window
    metrics = {
        # A window whose every step was skipped has no loss and no gradient norm (not 0.0,
        # which reads as converged / vanished gradients): the keys are left out.
        **({"train/lm_loss": loss} if steps > window["skipped"] else {}),
        **({"train/grad_norm": window["grad_norm"]} if window["grad_norm"] is not None else {}),
        "train/lr": optimizer.param_groups[0]["lr"],
        "train/step_s": elapsed / steps,
        # (this job's tokens: under elastic DiLoCo's batch split its share may change in a window)
        "train/tokens_per_s": window.get("tokens", tokens_per_step * steps) / elapsed,
        "train/skipped_iters": state.skipped_iters + window["skipped"],
        "train/tokens_seen": state.tokens_seen,
        "mem/peak_bytes": peak_memory_bytes(device),
    }
    metrics.update(throughput.metrics(metrics["train/tokens_per_s"]))
    state.skipped_iters += window["skipped"]
    group = layout.replica_group()
    metrics.update(comm_across_ranks(window["comm"], window["loco"], steps, device, group))
    if gathers_params:
        sums = param_sums_across_ranks(window, device, group)
        ParamGatherHook.check_finite(sums[2].item(), state.iteration)
        if sums[1] > 0:
            metrics.update(param_metrics(sums))
    if outer is not None:
        metrics.update(outer_metrics(outer, device, group))
        taken = outer.outer_steps - window["outer_steps"]
        if taken:  # per outer step of this window: what the iteration line shows
            metrics["diloco/window_outer_steps"] = float(taken)
            metrics["diloco/outer_step_bytes_sent"] = metrics["comm/outer_bytes_sent"] * steps / taken
            metrics["diloco/outer_step_exposed_s"] = metrics["comm/outer_exposed_s"] * steps / taken
        take_wait = getattr(outer, "take_wait", None)
        if take_wait is not None:  # elastic: this job's time at outer steps (rank 0's), and its batch share
            waited = take_wait()
            metrics["diloco/outer_wait_s"] = waited
            metrics["diloco/outer_wait_share"] = waited / elapsed
            metrics["diloco/share_samples"] = float(outer.share.samples if outer.share is not None else 0)
    logger.log(state.iteration, metrics, total_iters)
    window.update(loss=torch.zeros((), device=device), steps=0, tokens=0, t0=time.perf_counter(), skipped=0, comm={},
                  loco=None, param=None, grad_norm=None, outer_steps=outer.outer_steps if outer is not None else 0)
    return metrics

