"""How elastic DiLoCo's replicas share each step's global batch (--diloco-batch-split).

Every step of the run trains one global batch of ``G`` samples (``--global-batch-size``):
step ``t`` owns samples ``t*G ... (t+1)*G - 1`` of the sample stream, and each live replica
trains one contiguous :class:`Share` of them. Shares are disjoint and cover the batch, so
no sample is trained twice or skipped while the replicas stay; a share changes only at an
outer step that commits, on every replica at once (every replica computes it from the same
gathered fingerprints), so the stream of each replica stays its own.

A split names the replica set it was made for: :func:`split_id` of its shares, which every
replica carries in its fingerprint with its own share. The shares are kept only when every
member holds the same split and their shares tile the batch (the split was made for exactly
these replicas); a replica that comes, goes or returns with a split of its own (one that
missed a re-split while it was away) makes every replica split again.

* ``fixed``: replica ``r`` of ``R`` trains ``G/R`` samples at offset ``r*G/R`` (lockstep:
  a slower replica holds the others at each outer step).
* ``weight``: the live replicas share ``G`` in proportion to --diloco-replica-weight.
* ``throughput``: in proportion to each replica's measured samples per second over the
  last outer interval (a replica not measured yet counts at the mean of those measured),
  re-split when the predicted idle share of the most idle replica falls by more than
  :data:`MIN_GAIN`, or when the replicas change.

Every replica takes the same H inner steps, so with shares in proportion to speed the
outer steps find them all arriving together. The outer mean is weighted by the samples
each replica trained (:func:`mean_factors`), so it stays the mean over the samples.

Pure functions of integers and floats: no torch, no collectives.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Optional

MODES = ("fixed", "weight", "throughput")

MIN_GAIN = 0.05
"""A throughput re-split must lower the predicted idle share of the most idle replica by
more than this (measured speeds are noisy: a split that changes every outer step would
move the replicas' batch sizes for no gain)."""


@dataclasses.dataclass(frozen=True)
class Share:
    """Samples ``offset ... offset + samples - 1`` of each step's global batch."""

    offset: int
    samples: int


@dataclasses.dataclass(frozen=True)
class Member:
    """One live replica as the outer step's fingerprints give it."""

    replica: int
    samples: int
    """Its share's samples per step in the interval that just ended (0: none yet)."""
    speed: float
    """Samples per second it trained over that interval (0: not measured)."""
    weight: float
    """--diloco-replica-weight."""
    granule: int = 1
    """Its smallest share (micro batch x its data-parallel size; replicas' layouts differ)."""
    split: int = 0
    """:func:`split_id` of the split it holds (0: none)."""


def common_granule(members: list[Member], global_batch: int) -> int:
    """The smallest share every member's step can take (the least common multiple of
    theirs); ValueError when it leaves the global batch without one for each."""
    granule = math.lcm(*(m.granule for m in members))
    if global_batch % granule or global_batch // granule < len(members):
        raise ValueError(f"the replicas' smallest shares ({', '.join(str(m.granule) for m in members)} samples: micro "
                         f"batch x data-parallel size) do not split --global-batch-size {global_batch} into "
                         f"{len(members)} whole shares")
    return granule


def fixed_share(replica: int, replicas: int, global_batch: int) -> Share:
    """``fixed``: replica ``replica`` of ``replicas``, as one world's data-parallel split."""
    samples = global_batch // replicas
    return Share(replica * samples, samples)


def split(replicas: list[int], rates: list[float], global_batch: int, granule: int) -> dict[int, Share]:
    """``global_batch`` shared in proportion to ``rates`` (one per replica of ``replicas``),
    in whole ``granule``s (micro batch x data-parallel size: what a replica's step can take),
    at least one each; largest remainders first, ties to the lower replica id. Offsets
    follow the replica ids in ascending order."""
    order = sorted(range(len(replicas)), key=lambda i: replicas[i])
    units = global_batch // granule
    if units < len(replicas):
        raise ValueError(f"{global_batch} samples in granules of {granule} cannot give {len(replicas)} replicas one each")
    total = sum(rates)
    exact = [units * r / total if total > 0 else units / len(rates) for r in rates]
    got = [max(1, int(e)) for e in exact]
    # largest remainders: add where the most is owed, take back where the most is over-given
    # (never below one granule); ties go to the lower replica id
    while sum(got) < units:
        i = max(range(len(got)), key=lambda k: (exact[k] - got[k], -replicas[k]))
        got[i] += 1
    while sum(got) > units:
        i = max((k for k in range(len(got)) if got[k] > 1), key=lambda k: (got[k] - exact[k], -replicas[k]))
        got[i] -= 1
    shares, offset = {}, 0
    for i in order:
        shares[replicas[i]] = Share(offset, got[i] * granule)
        offset += got[i] * granule
    return shares


def idle_share(samples: list[int], speeds: list[float]) -> float:
    """Predicted share of a step that the most idle replica waits: ``1 - fastest / slowest``
    step time, step time = samples / speed."""
    times = [s / v for s, v in zip(samples, speeds)]
    return 1.0 - min(times) / max(times) if max(times) > 0 else 0.0


def rates_of(mode: str, members: list[Member]) -> list[float]:
    """What ``mode`` shares the batch in proportion to: the weights, or the measured speeds
    (unmeasured replicas at the mean of the measured ones; none measured: the weights)."""
    if mode == "throughput":
        measured = [m.speed for m in members if m.speed > 0]
        if measured:
            mean = sum(measured) / len(measured)
            return [m.speed if m.speed > 0 else mean for m in members]
    return [m.weight for m in members]


def split_id(shares: dict[int, Share]) -> int:
    """A positive 63-bit name of a split: its replicas and their shares (0 means none)."""
    text = repr(sorted((r, s.offset, s.samples) for r, s in shares.items())).encode()
    return (int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1) or 1


def held_by_all(members: list[Member], global_batch: int) -> bool:
    """Whether the members hold one split made for exactly them: the same :func:`split_id`
    everywhere, a share for each, the shares summing to the batch (a split tiles the batch
    among its replicas, so these shares are all of it), each whole shares of its member's
    granule (a replica healed or restarted in another layout may hold a share its new
    layout cannot train)."""
    held = {m.split for m in members}
    return len(held) == 1 and 0 not in held and min(m.samples for m in members) > 0 \
        and sum(m.samples for m in members) == global_batch and all(m.samples % m.granule == 0 for m in members)


def next_split(mode: str, members: list[Member], global_batch: int) -> Optional[dict[int, Share]]:
    """The shares from this outer step on, or None to keep the current ones. ``members``:
    every live replica (the same list, in the same order, on every replica). The current
    shares are kept when the members hold one split made for exactly them
    (:func:`held_by_all`) and, in ``throughput`` mode, a re-split would not gain more than
    :data:`MIN_GAIN`. Shares are whole :func:`common_granule`s."""
    if mode == "fixed":
        return None
    members = sorted(members, key=lambda m: m.replica)
    granule = common_granule(members, global_batch)
    rates = rates_of(mode, members)
    target = split([m.replica for m in members], rates, global_batch, granule)
    current = [m.samples for m in members]
    if not held_by_all(members, global_batch):
        return target  # a replica came, went or returns with another split: share the whole batch again
    if mode == "weight" or [target[m.replica].samples for m in members] == current:
        return None
    speeds = [m.speed for m in members]
    if min(speeds) <= 0:  # (a throughput re-split needs every replica measured)
        return None
    gain = idle_share(current, speeds) - idle_share([target[m.replica].samples for m in members], speeds)
    return target if gain > MIN_GAIN else None


def mean_factors(samples: dict[int, int]) -> dict[int, float]:
    """Per contributing replica (id -> samples per step in the interval): the factor its
    outer gradient is scaled by so that the channel's plain mean over the ``C`` contributors
    is the mean weighted by samples: ``samples_r * C / sum(samples)``. Exactly 1.0 when the
    shares are equal (``fixed``: the exchange is bit for bit as without a split)."""
    total = sum(samples.values())
    if total == 0:
        return {r: 1.0 for r in samples}
    c = len(samples)
    return {r: 1.0 if s * c == total else s * c / total for r, s in samples.items()}


def describe(shares: dict[int, Share], why: str) -> str:
    """``replica 0 8, replica 1 4 samples per step (why)``."""
    return ", ".join(f"replica {r} {s.samples}" for r, s in sorted(shares.items())) + f" samples per step ({why})"
