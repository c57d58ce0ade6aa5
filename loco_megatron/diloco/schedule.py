"""When each fragment's outer exchange starts, reaches its second phase and is applied.

Pure program-order arithmetic on the iteration number, the same on every rank: nothing
here looks at a handle or a clock, so every rank issues the same collectives on each
outer group in the same order.

Fragment ``f`` of ``F`` (``H`` inner steps between two syncs of one fragment, delay
``tau``) syncs at the iterations ``t >= o_f`` with ``t = o_f (mod H)``, where
``o_f = (f + 1) * H // F``: with ``F = 1`` at ``H, 2H, ...``; with ``F = 4, H = 32`` the
fragments sync at 8, 16, 24, 32, then 40, ... so their traffic is spread over the
interval. An exchange started at ``t`` (after the inner step of iteration ``t``) runs
its second phase at ``t + min(tau, 1)`` and is applied at ``t + tau``.

Eager updates (``eager``): an exchange started at a fragment's sync ``t`` runs through the
next interval: its second phase at ``t + max(1, H // 2)`` (each phase then has half the
interval to cross the link), and it is applied at the fragment's next sync ``t + H``,
together with the outer step of the interval that ends there.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FragmentSchedule:
    inner_steps: int
    """H."""
    fragments: int = 1
    """F."""
    delay: int = 0
    """tau."""
    eager: bool = False
    """Eager updates: each exchange is applied at the fragment's next sync (``tau`` is 0)."""

    @property
    def lag(self) -> int:
        """Steps from an exchange's start to its apply: ``H`` (eager) or ``tau``."""
        return self.inner_steps if self.eager else self.delay

    @property
    def phase_gap(self) -> int:
        """Steps from an exchange's start to its second phase."""
        return max(1, self.inner_steps // 2) if self.eager else min(self.delay, 1)

    @property
    def split_phases(self) -> bool:
        """Whether the second phase runs at a step of its own, before the apply step."""
        return self.lag > self.phase_gap

    def updates(self, t: int) -> list[int]:
        """Fragments whose parameters take an outer step at ``t``: where an exchange is
        applied (``tau > 0``), at every sync (eager: the first one applies no mean yet)."""
        return self.applies(t) if self.delay else self.starts(t)

    def as_list(self) -> list[int]:
        """The schedule as a checkpoint's common state keeps it: ``[H, F, tau]``, and a fourth
        entry 1 under eager updates (a checkpoint of an older version, or of a run without
        them, reads alike; ``FragmentSchedule(*the_list)`` is the schedule again)."""
        return [self.inner_steps, self.fragments, self.delay, *([1] if self.eager else [])]

    def offset(self, f: int) -> int:
        """``o_f``: the first iteration fragment ``f`` syncs at (1 ... H)."""
        return (f + 1) * self.inner_steps // self.fragments

    def _syncs(self, f: int, t: int) -> bool:
        o = self.offset(f)
        return t >= o and (t - o) % self.inner_steps == 0

    def starts(self, t: int) -> list[int]:
        """Fragments whose exchange starts after the inner step of iteration ``t``."""
        return [f for f in range(self.fragments) if self._syncs(f, t)]

    def second_phase(self, t: int) -> list[int]:
        """Fragments whose exchange (started at ``t -`` :attr:`phase_gap`) enters its second phase at ``t``."""
        return self.starts(t - self.phase_gap) if t - self.phase_gap > 0 else []

    def applies(self, t: int) -> list[int]:
        """Fragments whose exchange (started at ``t -`` :attr:`lag`) is applied at ``t``."""
        return self.starts(t - self.lag) if t - self.lag > 0 else []

    def in_flight(self, t: int) -> list[tuple[int, int]]:
        """``(fragment, start iteration)`` of exchanges started at or before ``t`` and
        applied after it (what a checkpoint at ``t`` must carry; eager: every fragment that
        synced, its latest)."""
        out = []
        for s in range(max(1, t - self.lag + 1), t + 1):
            out += [(f, s) for f in self.starts(s)]
        return out


def describe_schedule(saved: list) -> str:
    """``H 4, F 2, tau 1`` (and ``, eager``) of :meth:`FragmentSchedule.as_list`'s list."""
    return f"H {saved[0]}, F {saved[1]}, tau {saved[2]}" + (", eager" if len(saved) > 3 and saved[3] else "")
