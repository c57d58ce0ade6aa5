"""One cycle of elastic DiLoCo as data: what each replica says of itself (:class:`Fingerprint`)
and what the cycle does, decided from the gathered fingerprints alone (:func:`plan`).

Every participant of a cycle gathers every participant's fingerprint, so every rank of every
replica computes the same :class:`Cycle` from the same rows: who is refused, whether the
replicas still wait for the others at the start of a run, whether they must agree on one
model first (their states differ at equal progress: a start, a whole-run restart), whether
an outer step is exchanged or withheld (fewer live replicas than --diloco-min-replicas),
and the batch split from here on. Pure: integers in, a plan out; no torch.distributed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import torch

from loco_megatron.diloco.elastic import split as batch_split
from loco_megatron.diloco.elastic.split import Member, Share

ITERATION_SHIFT = 20
"""torchft's step is ``iteration << ITERATION_SHIFT | outer steps``: it heals whoever is
behind in either."""


def progress(iteration: int, outer_steps: int) -> int:
    return (iteration << ITERATION_SHIFT) | (outer_steps % (1 << ITERATION_SHIFT))


def config_hash(parts: list) -> int:
    """A signed 63-bit hash of ``parts``' text (every replica computes it alike)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 1


PARTS = 32
"""Slots of :attr:`Fingerprint.parts`: one hash per setting every replica must share, so a
refusal names the setting that differs (more settings than slots: the last holds the rest)."""


def settings_parts(named: list[tuple[str, object]]) -> tuple[list[str], tuple[int, ...]]:
    """``(names, hashes)`` of the settings every replica must share (``named``: ``(what to
    call it in a refusal, its value)``), at most :data:`PARTS` of each."""
    if len(named) > PARTS:
        named = [*named[:PARTS - 1], ("the other shared settings", named[PARTS - 1:])]
    return [n for n, _ in named], tuple(config_hash([n, v]) for n, v in named)


INNER_OPTIMIZERS = ("adam", "muon")
"""--optimizer's choices, in the order :attr:`Fingerprint.inner` numbers them."""


@dataclasses.dataclass
class Fingerprint:
    """One participant of a cycle, as its lane host sends it (every field but ``state`` and
    ``healed`` is the same on every lane of a replica)."""

    replica: int
    config: int
    """:func:`config_hash` of what every replica must share."""
    iteration: int
    joining: bool
    """True: this replica asks from its start-up (it trained nothing since it started)."""
    healed: bool = False
    """This lane took a live replica's state in this cycle's quorum (it sends zeros)."""
    cycles: int = 0
    """Cycles this job opened before this one: of two jobs with one replica id, the one
    that was there first stays."""
    outer_steps: int = 0
    """Outer steps applied (after a heal: the source's)."""
    state: int = 0
    """:func:`~.agreement.state_hash` of this lane's agreed parameters, momentum and outer
    steps (after a heal: of what it took)."""
    split: int = 0
    """:func:`~.split.split_id` of the batch split it holds (0: none)."""
    offset: int = 0
    samples: int = 0
    """Its share of each step's global batch under that split (0: none)."""
    trained: int = 0
    """Samples it trained since the last outer step of the fragment exchanged now (the
    weight of its outer gradient in the mean)."""
    speed: int = 0
    """Samples per second it trained over the last interval, x 1000 (0: not measured)."""
    weight: int = 1000
    """--diloco-replica-weight x 1000."""
    lanes: int = 1
    """--diloco-outer-ranks (every replica must have the same)."""
    granule: int = 1
    """Its smallest batch share (micro batch x its data-parallel size)."""
    ready: bool = False
    """It has waited --diloco-quorum-timeout-s for the replicas expected: start without them."""
    world: int = 1
    """Ranks of its job."""
    live: int = 0
    """The replicas of its last cycle, as a bit mask (ids below 63)."""
    recheck: bool = False
    """It asks again because the last quorum missed a replica of the one before."""
    inner: int = 0
    """Its --optimizer, as an index into :data:`INNER_OPTIMIZERS` (every replica must train
    with the same: a refusal names it)."""
    synced: bool = False
    """The run's final cycle: the outer step due at this iteration committed here, so its
    fragments' local parameters are the agreed ones (with alpha 0) and need no final step."""

    parts: tuple = ()
    """:func:`settings_parts`' hashes: per shared setting, so a refusal names the one that differs."""

    FIELDS = ("replica", "config", "iteration", "joining", "healed", "cycles", "outer_steps", "state", "split",
              "offset", "samples", "trained", "speed", "weight", "lanes", "granule", "ready", "world", "live",
              "recheck", "inner", "synced")
    WIDTH = len(FIELDS) + PARTS
    """int64 entries of :meth:`tensor`."""

    def tensor(self) -> torch.Tensor:
        parts = list(self.parts) + [0] * (PARTS - len(self.parts))
        return torch.tensor([int(getattr(self, f)) for f in self.FIELDS] + parts, dtype=torch.int64)

    @classmethod
    def of(cls, row: torch.Tensor) -> "Fingerprint":
        numbers = [int(x) for x in row.tolist()]
        values = dict(zip(cls.FIELDS, numbers))
        for f in ("joining", "healed", "ready", "recheck", "synced"):
            values[f] = bool(values[f])
        parts = numbers[len(cls.FIELDS):]
        while parts and not parts[-1]:
            parts.pop()
        return cls(**values, parts=tuple(parts))

    def member(self) -> Member:
        """What the batch split needs of this participant."""
        return Member(self.replica, self.samples, self.speed / 1000, self.weight / 1000, self.granule, self.split)

    def same_but_state(self, other: "Fingerprint") -> bool:
        return dataclasses.replace(self, state=0) == dataclasses.replace(other, state=0)


WAIT, AGREE, OUTER, WITHHELD, NOTHING, REFUSE, RECHECK = \
    "wait", "agree", "outer", "withheld", "nothing", "refuse", "recheck"


@dataclasses.dataclass
class Cycle:
    """One cycle as every rank of every participant sees it."""

    world: int
    """Replicas taking part."""
    rank: int
    """This replica's place among them (torchft's participating rank)."""
    participants: list[Fingerprint]
    """In participating-rank order."""
    iteration: int
    action: str = NOTHING
    """:data:`WAIT` (the start of a run: more replicas are expected), :data:`AGREE` (take
    ``source``'s state: the states differ at equal progress), :data:`OUTER` (exchange the
    outer step of the fragments starting at ``iteration``), :data:`WITHHELD` (a sync
    point, but fewer contributors than --diloco-min-replicas: no exchange, the inner
    progress carries into the next outer step), :data:`NOTHING` (a cycle of joining
    replicas that agree), :data:`REFUSE` or :data:`RECHECK` (a replica of the last cycle is
    missing: ask the lighthouse once more before going on without it)."""
    source: int = -1
    """The replica whose state every participant takes (:data:`AGREE`)."""
    shares: Optional[dict] = None
    """The batch split from this cycle on, when it changes (replica id -> Share)."""
    refused: str = ""
    """Non-empty: a participant does not fit the run (the line that says why)."""
    refused_ranks: set = dataclasses.field(default_factory=set)
    """The participating ranks of the participants refused."""
    healed: Optional[dict] = None
    """The state this replica took from a live one (:meth:`~.coordinator.ElasticCoordinator.open`:
    the whole record on a lane host, its builtins elsewhere)."""
    synced: bool = False
    """The final cycle: whether the fragments synced at this iteration take no final step,
    for every participant alike (the most advanced contributor's :attr:`Fingerprint.synced`:
    one that missed the last commit heals to it)."""

    @property
    def contributors(self) -> int:
        """Participants whose outer gradient counts (not just healed: they send zeros)."""
        return sum(1 for p in self.participants if not p.healed)

    @property
    def replicas(self) -> list[int]:
        return sorted(p.replica for p in self.participants)

    @property
    def exchanging(self) -> bool:
        return self.action == OUTER

    def mine(self, replica: int) -> Optional[Fingerprint]:
        return next((p for p in self.participants if p.replica == replica), None)


def advanced(p: Fingerprint, index: int = 0) -> tuple:
    """How far on a participant is (the most advanced one is the run's reference): further
    in iterations, then in outer steps, then trained (not joining), then longest in the
    run, then the lowest replica id."""
    return p.iteration, p.outer_steps, not p.joining, p.cycles, -p.replica, -index


def refusal(ps: list[Fingerprint], global_batch: int, names: tuple = ()) -> tuple[str, set[int]]:
    """(the line, the participating ranks refused) for participants that do not fit the
    most advanced one (:func:`advanced`): another fingerprint hash (the line names the first
    setting of ``names`` whose part differs), inner optimizer or lane count, a replica id a
    more advanced participant already has, or a smallest share (micro batch x DP) that
    leaves no split of the global batch in whole shares with the others'. ('', empty) when
    all fit. Every rank computes the same from the same fingerprints."""
    ref = max(range(len(ps)), key=lambda i: advanced(ps[i], i))
    refused = {i for i, p in enumerate(ps) if p.config != ps[ref].config or p.lanes != ps[ref].lanes
               or p.inner != ps[ref].inner}
    if refused:
        bad = ps[min(refused)]
        if bad.inner != ps[ref].inner:
            return (f"--diloco-replica-id {bad.replica}: --optimizer {INNER_OPTIMIZERS[bad.inner]} differs from the "
                    f"run's {INNER_OPTIMIZERS[ps[ref].inner]} (replica {ps[ref].replica}'s; every replica trains "
                    f"with the same inner optimizer)", refused)
        if bad.lanes != ps[ref].lanes:
            return (f"--diloco-replica-id {bad.replica}: --diloco-outer-ranks {bad.lanes} differs from the run's "
                    f"{ps[ref].lanes} (replica {ps[ref].replica}'s; every replica must exchange over as many "
                    f"ranks)", refused)
        differ = [names[i] for i, (a, b) in enumerate(zip(bad.parts, ps[ref].parts)) if a != b and i < len(names)]
        if differ and len(bad.parts) == len(ps[ref].parts):
            verb = "differs" if len(differ) == 1 else "differ"
            return (f"--diloco-replica-id {bad.replica}: {' and '.join(differ[:3])} {verb} from the run's "
                    f"(replica {ps[ref].replica}'s; every replica must use the same)", refused)
        return (f"--diloco-replica-id {bad.replica}: its model shape or outer settings differ from the run's "
                f"(replica {ps[ref].replica}'s; another version of this program?)", refused)
    ids: dict[int, list[int]] = {}
    for i, p in enumerate(ps):
        ids.setdefault(p.replica, []).append(i)
    for replica, ranks in sorted(ids.items()):
        if len(ranks) > 1:
            keep = max(ranks, key=lambda i: advanced(ps[i], i))
            return (f"--diloco-replica-id {replica}: another live job already runs as replica {replica} (each "
                    f"replica id once)", set(ranks) - {keep})
    # Granules: take the participants from the most advanced down while their smallest
    # shares still split the batch; the first that does not is refused (it ends alone).
    kept: list[int] = []
    for i in sorted(range(len(ps)), key=lambda i: advanced(ps[i], i), reverse=True):
        try:
            batch_split.common_granule([ps[k].member() for k in kept + [i]], global_batch)
        except ValueError:
            others = sorted({ps[k].granule for k in kept})
            return (f"--diloco-replica-id {ps[i].replica}: its smallest batch share (micro batch x data-parallel "
                    f"size = {ps[i].granule} samples) and the run's ({', '.join(map(str, others))}) do not split "
                    f"--global-batch-size {global_batch} into whole shares for {len(kept) + 1} replicas", {i})
        kept.append(i)
    return "", set()


def plan(participants: list[Fingerprint], rank: int, expected: int, min_replicas: int, mode: str,
         global_batch: int, healed: Optional[dict] = None, names: tuple = ()) -> Cycle:
    """The cycle every participant runs, from the fingerprints of one lane (``rank``: this
    replica's place among them; ``expected``: --diloco-replicas; ``mode``:
    --diloco-batch-split; ``names``: what a refusal calls each of :attr:`Fingerprint.parts`)."""
    ps = participants
    iteration = max(p.iteration for p in ps)
    cycle = Cycle(len(ps), rank, ps, iteration, healed=healed)
    cycle.refused, cycle.refused_ranks = refusal(ps, global_batch, names)
    if cycle.refused:
        cycle.action = REFUSE
        return cycle
    exchanging = any(not p.joining for p in ps)
    if not exchanging and len(ps) < expected and not any(p.ready for p in ps):
        cycle.action = WAIT  # the start of a run (or a whole-run restart): the others are expected
        return cycle
    if exchanging and missing(ps) and not any(p.recheck for p in ps):
        # A quorum without a replica of the last one: dead, or not heartbeating to the
        # lighthouse yet (a restarted lighthouse knows only who has beaten since). Asking once
        # more keeps a live one from being left behind, and costs a dead one's peers a pause.
        cycle.action = RECHECK
        return cycle
    if len({p.state for p in ps}) > 1:
        cycle.action = AGREE  # (the source: the lowest replica id among the furthest in progress)
        cycle.source = max(ps, key=lambda p: (p.iteration, p.outer_steps, not p.joining, -p.replica)).replica
    elif exchanging:
        cycle.action = OUTER if cycle.contributors >= min_replicas else WITHHELD
    cycle.shares = batch_split.next_split(mode, [p.member() for p in ps], global_batch)
    contributors = [i for i, p in enumerate(ps) if not p.healed] or list(range(len(ps)))
    cycle.synced = ps[max(contributors, key=lambda i: advanced(ps[i], i))].synced
    return cycle


def live_mask(replicas: list[int]) -> int:
    """The :attr:`Fingerprint.live` bit mask of ``replicas`` (ids from 63 on are left out)."""
    return sum(1 << r for r in set(replicas) if r < 63)


def missing(ps: list[Fingerprint]) -> list[int]:
    """The replicas some participant saw in its last cycle that are not in this one."""
    seen = 0
    for p in ps:
        seen |= p.live
    present = live_mask([p.replica for p in ps])
    return [r for r in range(63) if seen >> r & 1 and not present >> r & 1]


def combine(lanes: list[Optional[Cycle]]) -> Optional[Cycle]:
    """The replica's cycle from its lanes' (lane hosts only; None where a lane failed): lane
    0's, agreeing first when any lane's states differ; None (the cycle is broken: discard
    it) when a lane failed or the lanes saw other participants (other than in their state)."""
    if not lanes or any(c is None for c in lanes):
        return None
    head = lanes[0]
    for other in lanes[1:]:
        if len(other.participants) != len(head.participants) or other.rank != head.rank or not all(
                a.same_but_state(b) for a, b in zip(head.participants, other.participants)):
            return None
    agree = [c for c in lanes if c.action == AGREE]
    if agree and head.action != AGREE and head.action != REFUSE:
        return dataclasses.replace(head, action=AGREE, source=agree[0].source)
    return head


def describe_shares(shares: dict[int, Share], members: list[Member], mode: str) -> str:
    """The batch split's line: ``replica 0 8, replica 1 4 samples per step (why)``."""
    members = sorted(members, key=lambda m: m.replica)
    if mode == "throughput" and all(m.speed > 0 for m in members):
        why = "measured " + ", ".join(f"{m.speed:.1f}" for m in members) + " samples/s"
    else:
        why = "weights " + ", ".join(f"{m.weight:g}" for m in members)
    return batch_split.describe(shares, why)
