"""What a replica waits for between replicas, said while it waits.

A cycle can hold a replica for long: a quorum while the lighthouse is down or a replica of
the last cycle is missing, a collective while a peer is stalled inside it (up to
--diloco-exchange-timeout-s). :class:`WaitNotice` (the logging rank only) says so: once a
wait has lasted :attr:`WaitNotice.after_s`, one line naming what it waits for and whom,
from the lighthouse's status page (the replicas whose heartbeat stopped, or the
lighthouse not answering); again every :attr:`WaitNotice.every_s`; and one line when the
wait ends.

A thread reads the state the cycle publishes (its phase, iteration and participants) and
the status page; it only prints: nothing it sees decides a collective.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

STALE_S = 5.0
"""A replica whose last heartbeat reached the lighthouse longer ago than this is named as
not answering (torchft beats every 100 ms)."""

PHASES = {"quorum": "the quorum", "fingerprint": "the replicas' fingerprints", "go": "the go vote",
          "agreement": "the agreement on one model", "outer": "the outer exchange", "commit": "the commit vote"}
"""What each phase of a cycle (:attr:`~.coordinator.ElasticCoordinator.phase`) waits for, in words."""


class WaitNotice:
    """``log``: one line; ``state()``: ``(phase, iteration, participants)`` of what the cycle
    waits on now (participants: replica ids, those of the last cycle until this one's are
    known, [] before any); ``status()``: the
    lighthouse's :class:`~.lighthouse.Status` (ConfigError when it cannot be read)."""

    def __init__(self, log: Callable[[str], None], state: Callable[[], tuple], status: Callable[[], object],
                 after_s: float = 10.0, every_s: float = 60.0):
        self.log, self.state, self.status = log, state, status
        self.after_s, self.every_s = after_s, every_s
        self._lock = threading.Lock()
        self._since: Optional[float] = None
        self._said_at: Optional[float] = None
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "WaitNotice":
        with self._lock:
            self._since, self._said_at = time.monotonic(), None
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="diloco-waits", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            since, said, self._since = self._since, self._said_at, None
        if said is not None and since is not None:
            _, iteration, _ = self.state()
            self.log(f"DiLoCo: the wait at iteration {iteration} ended after {time.monotonic() - since:.1f} s")

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                since, said = self._since, self._said_at
            now = time.monotonic()
            if since is None or now - since < self.after_s or (said is not None and now - said < self.every_s):
                continue
            line = self.describe(now - since)
            with self._lock:
                if self._since != since:  # (it ended meanwhile)
                    continue
                self._said_at = now
            self.log(line)

    def describe(self, waited: float) -> str:
        """The line for a wait of ``waited`` seconds so far."""
        phase, iteration, participants = self.state()
        what = PHASES.get(phase, "the cycle")
        with_whom = f" among replicas {', '.join(map(str, participants))}" if participants else ""
        return f"DiLoCo: waiting {waited:.0f} s for {what} at iteration {iteration}{with_whom}: {self.whom(participants)}"

    def whom(self, participants: list[int]) -> str:
        """Who the wait is on, from the lighthouse's status page."""
        from loco_megatron.config import ConfigError

        try:
            status = self.status()
        except ConfigError as e:
            return f"the lighthouse does not answer ({str(e).split(': ', 1)[-1].split('; start', 1)[0]})"
        ages: dict[int, float] = {}
        for rid, age in status.heartbeats.items():
            name = rid.split(":")[0]
            if name.startswith("replica") and name[len("replica"):].isdigit():
                r = int(name[len("replica"):])
                ages[r] = min(age, ages.get(r, age))
        stale = sorted(r for r in (participants or ages) if ages.get(r, float("inf")) > STALE_S)
        if stale:
            return "; ".join(f"replica {r} " + (f"has not heartbeaten for {ages[r]:.0f} s" if r in ages
                                                else "has never heartbeaten") for r in stale) + \
                " (stalled, cut off or gone)"
        if not participants:
            return f"the lighthouse answers: {status.next_quorum}"
        return "every replica heartbeats (one is slow to reach this point of the cycle)"
