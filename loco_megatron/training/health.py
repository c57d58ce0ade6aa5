"""Divergence guard: stop a run whose steps keep being skipped for NaN/Inf gradients."""

from __future__ import annotations


class RunAborted(RuntimeError):
    """The run cannot usefully continue; the message is the one line to print."""

    agreed = True
    """Every rank raises it at the same step (from values all-reduced that step), so rank 0
    prints it (:func:`loco_megatron.error_report.report_error`)."""


class SkipGuard:
    """Counts consecutive skipped steps; raises RunAborted when ``limit`` is reached.

    ``skipped`` comes from megatron's found-inf check, which is all-reduced, so every
    rank raises at the same iteration (no extra collective). ``limit`` 0 disables it.
    The streak is checkpointed so a resume cannot reset it.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.consecutive = 0
        self.last_good = 0

    def update(self, iteration: int, skipped: bool) -> None:
        if not skipped:
            self.consecutive, self.last_good = 0, iteration
            return
        self.consecutive += 1
        if self.limit and self.consecutive >= self.limit:
            raise RunAborted(
                f"--max-skipped-consecutive: {self.consecutive} consecutive steps skipped for "
                f"NaN/Inf gradients (iterations {iteration - self.consecutive + 1}-{iteration}; last "
                f"good step {self.last_good}); stopping without saving, earlier checkpoints are kept")

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "last_good": self.last_good}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive, self.last_good = int(state["consecutive"]), int(state["last_good"])
