"""Divergence guard: stop a run whose steps keep being skipped for NaN/Inf gradients."""

from __future__ import annotations

from typing import Optional

from loco_megatron.failures import RunAborted  # noqa: F401 (the trainer's and pretrain_gpt.py's import)


class SkipGuard:
    """Counts consecutive skipped steps; raises RunAborted when ``limit`` is reached.

    ``skipped`` comes from megatron's found-inf check, which is all-reduced, so every
    rank raises at the same iteration (no extra collective). ``limit`` 0 disables it.
    The streak is checkpointed so a resume cannot reset it. ``defer`` (DiLoCo with several
    replicas, whose found-inf checks are each replica's own): record the line in
    :attr:`abort` instead of raising; the replicas agree on it at an outer step and all
    raise there together.
    """

    def __init__(self, limit: int, defer: bool = False):
        self.limit, self.defer = limit, defer
        self.consecutive = 0
        self.last_good = 0
        self.abort: Optional[str] = None
        """With ``defer``: the line to stop with, once the limit was reached."""

    def update(self, iteration: int, skipped: bool) -> None:
        if not skipped:
            self.consecutive, self.last_good = 0, iteration
            return
        self.consecutive += 1
        if self.limit and self.consecutive >= self.limit and self.abort is None:
            line = (f"--max-skipped-consecutive: {self.consecutive} consecutive steps skipped for "
                    f"NaN/Inf gradients (iterations {iteration - self.consecutive + 1}-{iteration}; last "
                    f"good step {self.last_good}); stopping without saving, earlier checkpoints are kept")
            if not self.defer:
                raise RunAborted(line)
            self.abort = line

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "last_good": self.last_good}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive, self.last_good = int(state["consecutive"]), int(state["last_good"])
