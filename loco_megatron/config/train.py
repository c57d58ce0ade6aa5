"""Training loop settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config.base import require


@dataclasses.dataclass
class TrainConfig:
    train_iters: int = 200
    """Optimizer steps to run."""
    eval_interval: int = 50
    """Evaluate on the validation split every this many steps (0 = never)."""
    eval_iters: int = 4
    """Validation batches (global batches) per evaluation."""
    seed: int = 1234
    """Random seed for weights, data order and dropout."""
    distributed_timeout_minutes: int = 10
    """Timeout of collectives; a dead rank fails the run after this long."""
    heartbeat_timeout_seconds: int = 120
    """During training every rank beats through the job's TCP store every few seconds (a
    thread); one silent this long (stopped, frozen, its node or network gone) ends the run
    with one line naming it, long before the collectives' timeout (at most half of it; 0 = off)."""
    stop_file: Optional[str] = None
    """When this file exists, save a checkpoint after the current step and exit 0 (the Slurm
    templates' signal handler creates it before requeueing the job)."""
    inject_nan: Optional[str] = None
    """Fault injection for tests and drills: 'ITER:RANK' makes RANK's loss (so its gradient) NaN at
    iteration ITER as the console numbers it (1 = the first step); 'A-B:RANK' for A..B, 'A-:RANK' from A on."""
    max_skipped_consecutive: int = 20
    """Abort (non-zero exit, no save) after this many consecutive steps skipped for NaN/Inf
    gradients; earlier checkpoints are kept (0 = never abort)."""

    def __post_init__(self):
        require(self.train_iters > 0, "train_iters", "must be positive")
        require(self.eval_interval >= 0, "eval_interval", "must be >= 0")
        require(self.eval_iters >= 0, "eval_iters", "must be >= 0")
        require(self.distributed_timeout_minutes > 0, "distributed_timeout_minutes", "must be positive")
        require(self.heartbeat_timeout_seconds >= 0, "heartbeat_timeout_seconds", "must be >= 0 (0 = off)")
        require(self.max_skipped_consecutive >= 0, "max_skipped_consecutive", "must be >= 0")
        if self.inject_nan is not None:
            require(self._nan_range() is not None, "inject_nan",
                     f"'{self.inject_nan}' is not ITER:RANK, FIRST-LAST:RANK or FIRST-:RANK")

    def _nan_range(self) -> Optional[tuple[int, float, int]]:
        """(first, last, rank) of --inject-nan, None when malformed."""
        its, _, rank = (self.inject_nan or "").partition(":")
        first, dash, last = its.partition("-")
        if not (first.isdigit() and rank.isdigit() and (last.isdigit() or not last)):
            return None
        end = int(last) if last else float("inf") if dash else int(first)
        return int(first), end, int(rank)

    def nan_poisoned(self, iteration: int, rank: int) -> bool:
        """Whether ``rank``'s loss is made NaN at ``iteration`` (numbered as printed, from 1)."""
        if self.inject_nan is None:
            return False
        first, last, nan_rank = self._nan_range()
        return rank == nan_rank and first <= iteration <= last
