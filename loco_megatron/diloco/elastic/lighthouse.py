"""The torchft Lighthouse as the replicas see it before and between quorums: its status page.

``torchft_lighthouse`` serves ``/status`` (HTML): the quorum id, why the next quorum is or
is not ready, the previous quorum's members (replica id, step, world size) and the replicas
heartbeating with the age of their last beat. A replica reads it at start-up (one line
within seconds when the address is not a torchft lighthouse, or when the run it would join
has already reached --train-iters) and when a quorum does not form (to say what failed).
torchft's step is :func:`~.cycle.progress` (iteration and outer steps), so a member's step
says its iteration.
"""

from __future__ import annotations

import dataclasses
import html
import re
import time
import urllib.error
import urllib.request
from typing import Optional

from loco_megatron.config import ConfigError
from loco_megatron.diloco.elastic.cycle import ITERATION_SHIFT


@dataclasses.dataclass
class Member:
    replica_id: str
    """torchft's id: ``replica<R>:<uuid>`` (one uuid per job start)."""
    step: int
    world_size: int
    """Lanes (torchft's replica group size: --diloco-outer-ranks)."""

    @property
    def iteration(self) -> int:
        return self.step >> ITERATION_SHIFT


@dataclasses.dataclass
class Status:
    quorum_id: int
    next_quorum: str
    """The lighthouse's own words on the next quorum ("New quorum not ready, ...")."""
    members: list[Member]
    """The previous quorum's (empty before the first quorum, or after a restart)."""
    heartbeats: dict[str, float]
    """replica id -> seconds since its last heartbeat (every replica ever seen)."""

    def last_iteration(self) -> Optional[int]:
        """The furthest iteration a member of the previous quorum asked at (None: no quorum yet)."""
        return max((m.iteration for m in self.members), default=None)


TRIES = 3
"""Reads of the status page before a failure to reach it counts (a second apart)."""

_MEMBER = re.compile(r"<b>\s*([^<]+?)\s*</b>\s*<br/>\s*Step:\s*(-?\d+)\s*<br/>.*?World size:\s*(\d+)", re.S)
_BEAT = re.compile(r"<li class=\"heartbeat[^\"]*\">\s*([^:<]+:[^:<]+):\s*seen\s*([0-9.e+-]+)s ago", re.S)


def parse_status(page: str) -> Optional[Status]:
    """The status page's contents, None when ``page`` is not a torchft lighthouse's."""
    quorum = re.search(r"Current quorum_id:\s*(-?\d+)", page)
    nxt = re.search(r"Next quorum status:\s*([^<\n]*)", page)
    if quorum is None or nxt is None or "<h2>Heartbeats</h2>" not in page:
        return None
    prev = page.split("<h3>Previous Quorum</h3>", 1)[-1].split("<h2>Heartbeats</h2>", 1)[0]
    members = [Member(html.unescape(r), int(s), int(w)) for r, s, w in _MEMBER.findall(prev)]
    beats = {html.unescape(r).strip(): float(a) for r, a in _BEAT.findall(page)}
    return Status(int(quorum.group(1)), html.unescape(nxt.group(1)).strip(), members, beats)


def _silent(e: BaseException) -> bool:
    """Whether ``e`` is a reply that timed out on a connection the listener accepted (urllib
    wraps a failed connect in URLError, not the wait for the reply): a torchft lighthouse
    answers its status page at once, so such a listener is not one."""
    return isinstance(e, TimeoutError)


def _fetch(url: str, timeout_s: float, tries: int = TRIES) -> str:
    """``url``'s text; a connection that fails is tried again (a lighthouse under load may
    reset one without being down), ``tries`` times in all; a listener that accepts and says
    nothing within ``timeout_s`` is not asked again."""
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as reply:
                return reply.read(1 << 20).decode("utf-8", "replace")
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, OSError) as e:
            if attempt + 1 == tries or _silent(e):
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def read_status(address: str, timeout_s: float = 10.0, tries: int = TRIES) -> Status:
    """The lighthouse's status; ConfigError (one line) when nothing answers at ``address``
    or what answers is not a torchft lighthouse."""
    url = address.rstrip("/") + "/status"
    try:
        page = _fetch(url, timeout_s, tries)
    except urllib.error.HTTPError as e:
        raise ConfigError(f"--diloco-lighthouse: {address} answers, but not as a torchft lighthouse ({url}: HTTP "
                          f"{e.code}); start one with torchft_lighthouse --min_replicas 1 --bind [::]:PORT") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        if _silent(e):
            raise ConfigError(f"--diloco-lighthouse: {address} accepts connections but does not answer as a torchft "
                              f"lighthouse (no status page within {timeout_s:g} s); start one with torchft_lighthouse "
                              f"--min_replicas 1 --bind [::]:PORT") from None
        raise ConfigError(f"--diloco-lighthouse: {address} cannot be reached ({reason}); start it with "
                          f"torchft_lighthouse --min_replicas 1 --bind [::]:PORT (docs/diloco.md)") from None
    status = parse_status(page)
    if status is None:
        raise ConfigError(f"--diloco-lighthouse: {address} answers, but not as a torchft lighthouse ({url} is not "
                          f"its status page); start one with torchft_lighthouse --min_replicas 1 --bind [::]:PORT")
    return status


def check_lighthouse(address: str, train_iters: int, timeout_s: float = 10.0) -> Status:
    """At start-up, before any set-up: ConfigError (one line) unless a torchft lighthouse
    answers at ``address`` and the run it coordinates has not reached ``train_iters`` yet
    (its previous quorum asked at an iteration before it)."""
    status = read_status(address, timeout_s)
    last = status.last_iteration()
    if last is not None and last >= train_iters:
        raise ConfigError(f"--diloco-lighthouse: the run at {address} has already reached iteration {last} (its last "
                          f"quorum), and --train-iters is {train_iters}: nothing is left to train (a new run needs a "
                          f"new lighthouse; --train-iters above {last} extends this one)")
    return status


def ended_without(address: str, replica: int, train_iters: int) -> str:
    """The line a replica ends with when the run it belongs to reached ``train_iters`` in a
    quorum it was not in (the lighthouse's previous quorum: its peers finished the run, or
    took its final outer step, without it; this replica's training since is its own, not
    the run's), '' otherwise or when the status page cannot be read now (an outage: the
    cycle itself finds it)."""
    try:
        status = read_status(address, timeout_s=5.0, tries=1)
    except ConfigError:
        return ""
    last = status.last_iteration()
    names = sorted({m.replica_id.split(":")[0] for m in status.members})
    if last is None or last < train_iters or f"replica{replica}" in names:
        return ""
    return (f"DiLoCo: the run reached --train-iters {train_iters} without replica {replica} (the lighthouse's last "
            f"quorum: {', '.join(names)} at iteration {last}): replica {replica} ends here; its training since its "
            f"last outer step is its own, not the run's model")


def describe_outage(address: str) -> str:
    """Why no quorum formed, in words, from the lighthouse's status page (or its absence)."""
    try:
        status = read_status(address, timeout_s=5.0)
    except ConfigError as e:
        return str(e).split(": ", 1)[1].split("; start", 1)[0]
    live = sorted(r.split(":")[0] for r, age in status.heartbeats.items() if age < 30)
    return (f"the lighthouse answers: {status.next_quorum}; heartbeating in the last 30 s: "
            f"{', '.join(live) if live else 'none'}")
