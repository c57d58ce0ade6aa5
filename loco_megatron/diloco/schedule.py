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
        """Fragments whose exchange (started at ``t - min(tau, 1)``) enters its second phase at ``t``."""
        return self.starts(t - min(self.delay, 1)) if t - min(self.delay, 1) > 0 else []

    def applies(self, t: int) -> list[int]:
        """Fragments whose exchange (started at ``t - tau``) is applied at ``t``."""
        return self.starts(t - self.delay) if t - self.delay > 0 else []

    def in_flight(self, t: int) -> list[tuple[int, int]]:
        """``(fragment, start iteration)`` of exchanges started at or before ``t`` and
        applied after it (what a checkpoint at ``t`` must carry)."""
        out = []
        for s in range(max(1, t - self.delay + 1), t + 1):
            out += [(f, s) for f in self.starts(s)]
        return out
