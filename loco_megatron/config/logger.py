"""Logging, metrics and profiling settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config.base import require


@dataclasses.dataclass
class LoggingConfig:
    log_interval: int = 10
    """Print and record metrics every this many steps."""
    metrics_jsonl: Optional[str] = None
    """Append one JSON object per logged iteration to this file."""
    wandb_project: Optional[str] = None
    """Log to this wandb project (offline without an API key or with WANDB_MODE=offline)."""
    wandb_exp_name: Optional[str] = None
    """wandb run name."""
    wandb_save_dir: Optional[str] = None
    """Directory for wandb's local files."""
    wandb_group: Optional[str] = None
    """wandb group, to compare runs side by side."""
    wandb_tags: Optional[str] = None
    """Comma-separated wandb tags."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one device for train/mfu (default: the dense bf16 peak of known NVIDIA
    GPUs; no MFU on CPU unless given)."""
    tensorboard_dir: Optional[str] = None
    """Also write every logged scalar to TensorBoard event files in this directory."""
    profile: bool = False
    """Record a torch.profiler trace (Chrome/Perfetto JSON) of steps --profile-step-start
    to --profile-step-end on --profile-ranks, with named ranges (NVTX ranges too on CUDA)."""
    profile_step_start: int = 3
    """First profiled iteration (1-based)."""
    profile_step_end: int = 4
    """Last profiled iteration."""
    profile_ranks: str = "0"
    """Comma-separated global ranks to profile."""
    profile_dir: str = "profile"
    """Where traces go: PROFILE_DIR/trace_rank{R}.json."""

    def __post_init__(self):
        require(self.log_interval > 0, "log_interval", "must be positive")
        if self.peak_tflops is not None:
            require(self.peak_tflops > 0, "peak_tflops", "must be positive")
        require(1 <= self.profile_step_start <= self.profile_step_end, "profile_step_end",
                 "must be >= --profile-step-start >= 1")
        ranks = self.profile_ranks.split(",")
        require(all(r.strip().isdigit() for r in ranks), "profile_ranks",
                 f"{self.profile_ranks!r} is not a comma-separated list of ranks")

    def profiled_ranks(self) -> set[int]:
        return {int(r) for r in self.profile_ranks.split(",")}
