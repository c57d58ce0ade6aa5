"""One elastic replica's outer state between cycles: the outer step's state
(:class:`~loco_megatron.diloco.outer.OuterStep`'s agreed parameters, momentum and channels,
here over lanes), its batch share and the split it belongs to, the samples it trained,
what it says of itself in a cycle (its fingerprint), how it takes another replica's state
(a heal, an agreement), and its checkpoint. :class:`~.step.ElasticOuterStep` drives it
through the cycles."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from loco_megatron.diloco.elastic.agreement import state_hash
from loco_megatron.diloco.elastic.coordinator import ElasticCoordinator
from loco_megatron.diloco.elastic.cycle import INNER_OPTIMIZERS, Cycle, Fingerprint, live_mask, plan
from loco_megatron.diloco.elastic.record import ReplicaRecord
from loco_megatron.diloco.elastic.split import Share
from loco_megatron.diloco.outer import OuterStep


@dataclasses.dataclass
class SplitSettings:
    """How the replicas share each step's global batch (:mod:`.split`)."""

    mode: str
    """--diloco-batch-split."""
    global_batch: int
    granule: int
    """The smallest share (:func:`loco_megatron.config.run.batch_granule`)."""
    weight: float
    """--diloco-replica-weight."""
    initial: Optional[Share]
    """This replica's share before any outer step: fixed's, or None (agreed at the first)."""
    slowest: Callable[[float], float] = float
    """``slowest(seconds)``: the largest of every rank of this job's ``seconds`` (a
    collective over the job; called at each cycle under ``throughput`` only)."""


@dataclasses.dataclass
class OpenCycle:
    """A cycle whose outer exchanges are in flight (``tau > 0``): closed (committed or
    discarded on every participant) at iteration :attr:`closes_at`, by program order."""

    cycle: Cycle
    keys: list[str]
    """The channels exchanging."""
    closes_at: int


@dataclasses.dataclass
class Rules:
    """What the plan needs besides the fingerprints."""

    expected: int
    """--diloco-replicas."""
    min_replicas: int
    """--diloco-min-replicas."""
    world: int
    """This job's ranks."""
    optimizer: str = "adam"
    """--optimizer (the inner optimizer: every replica's must be the same)."""
    train_iters: int = 0
    """--train-iters (0: never read the lighthouse for a run that ended without this replica)."""


class ReplicaStep(OuterStep):
    """The state of :class:`~.step.ElasticOuterStep` (see the module docstring); its
    arguments are that class's."""

    def __init__(self, *args, coordinator: ElasticCoordinator, replica: int, config_hash: int,
                 relay: Callable[[str, int], object], split: SplitSettings, rules: Rules,
                 settings: tuple = ((), ()), **kwargs):
        super().__init__(*args, **kwargs)
        self.coordinator, self.replica, self.config_hash = coordinator, replica, config_hash
        self.settings = settings
        """:func:`.cycle.settings_parts` of what every replica must share (names, hashes)."""
        self.rules = rules
        self._relay = relay
        self._progress: Callable[[], dict] = dict
        self._take_progress: Callable[[dict, bool], None] = lambda state, kept: None
        self._set_share: Callable[[int, int], None] = lambda offset, samples: None
        self.split = split
        self.share: Optional[Share] = split.initial
        """This replica's share of each step's global batch (None: not agreed yet)."""
        self.split_id = 0
        """:func:`.split.split_id` of the split :attr:`share` belongs to (0: none / fixed)."""
        self.speed = 0.0
        """Samples per second over the last outer interval (0: not measured yet)."""
        self._train_s, self._interval_steps = 0.0, 0
        self.inner_steps = 0
        """Inner steps this job trained."""
        self.samples_trained = 0
        """Samples this replica trained (its shares of the steps it took; kept in checkpoints)."""
        self._since = {f: 0 for f in {frag for _, _, _, frag in self.channels.values()}}
        """Per fragment, :attr:`samples_trained` at its last outer step (what its next outer
        gradient was trained on is the difference)."""
        self._waited_s = 0.0
        self.waited_total_s = 0.0
        """Seconds this job spent at outer steps after its first (quorum, exchange, commit:
        in lockstep with a slower replica, mostly waiting for it)."""
        self._laid_for: tuple = ()
        """The contributors the channels are laid out for (their rows are per replica)."""
        self._snapshots: dict[str, tuple] = {}
        """Channels exchanging in the open cycle: (the channel, its error buffers) as before
        it; a discarded cycle puts them back."""
        self._open: Optional[OpenCycle] = None
        """The cycle whose outer step is in flight, closed where it applies (tau later)."""
        self.unfinished = ""
        """After :meth:`finish`: non-empty when the run has no agreed final model (the line why)."""
        self.ended = False
        """The run reached --train-iters without this replica (:attr:`unfinished` says so): it
        stops, and its checkpoint is its own training, never the run's model."""
        self._shares: Optional[dict] = None
        """The split :attr:`split_id` names (replica id -> Share), or None."""
        self._synced_at: dict[int, int] = {}
        """Per fragment, the iteration its last outer step committed at."""
        coordinator.heal_state = self.heal_state

    def bind_progress(self, progress: Callable[[], dict], take_progress: Callable[[dict, bool], None],
                      set_share: Callable[[int, int], None]) -> None:
        """``progress()``: this replica's iteration and LR schedule position (a dict with
        ``iteration``); ``take_progress(state, kept)`` sets them (and the data position) from
        a live replica's :meth:`heal_state` (``kept``: this job trained before, so its inner
        optimizer state is its own); ``set_share(offset, samples)``: the samples of each
        step's global batch this replica trains from the next step on (called at once with
        the share the replica holds: a resumed one's comes from its checkpoint's record,
        which the data iterator does not keep)."""
        self._progress, self._take_progress, self._set_share = progress, take_progress, set_share
        if self.share is not None:
            set_share(self.share.offset, self.share.samples)

    # -- what the replica trains and waits -----------------------------------------------------
    def count_step(self, seconds: float) -> None:
        """One inner step done, ``seconds`` of training (the speed the batch split measures)."""
        self._train_s += seconds
        self._interval_steps += 1
        self.inner_steps += 1
        self.samples_trained += self.share.samples if self.share is not None else self.split.global_batch

    def take_wait(self) -> float:
        """Seconds spent at outer steps since the last call (the log window's)."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited

    def _iteration(self) -> int:
        return int(self._progress().get("iteration", 0))

    # -- the fingerprint -------------------------------------------------------------------------
    def _common(self, t: int, joining: bool, ready: bool, recheck: bool = False) -> Fingerprint:
        """This replica's fingerprint but its lane's state (every rank: under ``throughput``
        a collective over the job, so every rank of a replica puts the same speed in);
        ends the interval's speed measurement."""
        if self.split.mode == "throughput":
            seconds = self.split.slowest(self._train_s)
            if self._interval_steps and seconds > 0 and self.share is not None:
                self.speed = self._interval_steps * self.share.samples / seconds
        self._train_s, self._interval_steps = 0.0, 0
        frags = self.schedule.starts(t)
        trained = self.samples_trained - self._since[frags[0]] if frags else 0
        share = self.share or Share(0, 0)
        return Fingerprint(self.replica, self.config_hash, t, joining, outer_steps=self.outer_steps,
                           split=self.split_id, offset=share.offset, samples=share.samples, trained=trained,
                           speed=round(self.speed * 1000), weight=round(self.split.weight * 1000),
                           lanes=self.coordinator.lanes, granule=self.split.granule, ready=ready,
                           world=self.rules.world, live=live_mask(self.coordinator.live), recheck=recheck,
                           inner=INNER_OPTIMIZERS.index(self.rules.optimizer), parts=tuple(self.settings[1]))

    def _lane_fingerprint(self, common: Fingerprint, healed: Optional[dict]) -> Fingerprint:
        """``common`` with this lane's state (after a heal: what it took, and the source's
        progress and split)."""
        if healed is None:
            return dataclasses.replace(common, state=state_hash(self.agreed, self.momentum, self.outer_steps))
        record = ReplicaRecord.received(healed)  # (ValueError: the cycle fails on every rank)
        mine = {k: a.numel() for k, a in self.agreed.items()}
        theirs = {k: a.numel() for k, a in (record.agreed or {}).items()}
        if mine != theirs:  # (the config hashes match, so a bug, not bad input: the cycle fails everywhere)
            raise ValueError(f"the state healed from a live replica does not fit this one's lanes ({theirs} there, "
                             f"{mine} here)")
        share = (record.share_of(self.replica) or Share(0, 0)) if self.split.mode != "fixed" else self.share
        return dataclasses.replace(
            common, iteration=record.iteration, outer_steps=record.outer_steps, healed=True,
            state=state_hash(record.agreed, record.momentum or {}, record.outer_steps),
            split=record.split, offset=share.offset if share else 0, samples=share.samples if share else 0,
            trained=0)

    def _plan(self, participants: list[Fingerprint], rank: int, healed: Optional[dict]) -> Cycle:
        return plan(participants, rank, self.rules.expected, self.rules.min_replicas, self.split.mode,
                    self.split.global_batch, healed, tuple(self.settings[0]))

    # -- the replica-state record (a heal, a resume) ------------------------------------------
    def record(self, tensors: bool = False) -> ReplicaRecord:
        """This replica's :class:`~.record.ReplicaRecord` (``tensors``: with the lane's agreed
        parameters and momentum, by reference: they change only when a cycle closes)."""
        assert self._open is None, "a record is taken between cycles"
        return ReplicaRecord(self.replica, self._progress(), self.outer_steps, self.split_id, self._shares,
                             self._laid_for, dict(self._synced_at),
                             self.agreed if tensors else None, self.momentum if tensors and self.mu else None)

    def heal_state(self) -> dict:
        """What torchft sends the lane host of a replica that heals (lane j of every replica
        holds the same elements, whatever the layouts): the whole record with this lane's
        tensors."""
        return self.record(tensors=True).transport()

    def _accept(self, cycle: Cycle) -> str:
        """'' when every rank of this replica can apply ``cycle``'s healed record, else the
        line why not (the go vote fails on every rank: the replica heals at the next cycle
        or ends, but never with some ranks on another split)."""
        if cycle.healed is None:
            return ""
        try:
            record = ReplicaRecord.received(cycle.healed)
        except ValueError as e:
            return f"the state healed from a live replica cannot be applied here ({e})"
        share = record.share_of(self.replica) if self.split.mode != "fixed" else None
        # (a share this layout cannot train is replaced by the cycle's re-split, which
        # :func:`.split.held_by_all` asks for: the healed fingerprint carries its granule)
        if share is not None and not self._whole(share) and cycle.shares is None:
            return (f"the healed batch share ({share.offset}, {share.samples}) is not whole shares of "
                    f"{self.split.granule} samples in a global batch of {self.split.global_batch}")
        return ""

    def _whole(self, share: Share) -> bool:
        """Whether this layout can train ``share``: whole shares of its granule (micro batch
        x data-parallel size), inside the global batch."""
        return (share.samples > 0 and share.samples % self.split.granule == 0
                and 0 <= share.offset <= self.split.global_batch - share.samples)

    def _heal(self, cycle: Cycle) -> None:
        """Take a live replica's record (a committed state of the run: taken at once): on lane
        hosts the agreed parameters and momentum of the lane, on every rank every other field
        (the progress, the outer step count, the split and this replica's share); then every
        rank's shards take the agreed parameters."""
        record = ReplicaRecord.received(cycle.healed)  # (:meth:`_accept` passed on every rank)
        if self.coordinator.lane is not None:  # (its lanes' sizes were checked in the fingerprint)
            self._adopt(record.agreed, record.momentum)
        kept = self.inner_steps > 0
        nbytes = sum(a.numel() * 4 * (2 if self.mu else 1) for a in self.agreed.values())
        self._log(f"DiLoCo: healed from replica {record.source} over torchft's transport: the agreed parameters "
                  f"and outer momentum ({nbytes / 2**20:.2f} MiB in lane 0), iteration {record.iteration}, the LR "
                  f"schedule's position and the batch split")
        self._restart_outer(record.outer_steps, healed=True)
        self._synced_at = dict(record.synced_at)
        if self.split.mode != "fixed":
            mine = record.share_of(self.replica)
            if mine is None or self._whole(mine):
                self._take_split(record.shares, record.split if record.shares else 0)
            else:  # (made for this replica's old layout: the cycle's re-split follows at once)
                self._take_split(None, 0)
        self._take_progress(record.progress, kept)

    def _adopt(self, agreed: dict, momentum: Optional[dict]) -> None:
        """This lane's agreed parameters and momentum <- ``agreed``/``momentum`` (momentum None: zero)."""
        for key, a in self.agreed.items():
            a.copy_(agreed[key])
            if self.momentum[key] is not None:
                if momentum is None or momentum.get(key) is None:
                    self.momentum[key].zero_()
                else:
                    self.momentum[key].copy_(momentum[key])

    def _start(self, key: str, t: int) -> None:
        # (a SparseLoCo payload carries the factor its gradient is scaled by: a mean over an
        # entry's senders renormalises by their weights)
        channel = self.channels[key][1]
        if hasattr(channel, "weight"):
            channel.weight = self.outer_scale
        super()._start(key, t)

    def _holds_errors(self) -> bool:
        """Whether the channels may hold outer error buffers worth announcing when they are
        reset: a compressed exchange (its compressor) after at least one outer step."""
        return self.outer_steps > 0 and any(ch.comp1 is not None for _, ch, _, _ in self.channels.values())

    def _restart_outer(self, outer_steps: int, healed: bool = False) -> None:
        """After the agreed state changed hands (a heal, an agreement): nothing in flight, error
        buffers at zero, the local parameters the agreed ones, every fragment's interval anew.
        A heal says so also before this job's first outer step where the buffers are the
        replica's own (SparseLoCo's: a restarted replica heals without them)."""
        dropped = len(self.pending)
        had_errors = self._holds_errors() or healed and any(
            getattr(ch, "world_independent", False) and ch.comp1 is not None for _, ch, _, _ in self.channels.values())
        self.pending, self._snapshots, self._open = {}, {}, None
        for _, channel, _, _ in self.channels.values():
            channel.reset()
        self.outer_steps = outer_steps
        self._since = dict.fromkeys(self._since, self.samples_trained)
        self._take_all(self.agreed)  # local <- agreed, bit for bit, on every rank of the replica
        if had_errors or dropped:
            self._log("DiLoCo: the outer error buffers start at zero"
                      + (f" and the {dropped} outer exchange(s) in flight are dropped" if dropped else ""))

    def _take_all(self, tensors: dict) -> None:
        """Every rank's shards <- ``tensors`` (per channel, this rank's lane), then a megatron
        optimizer step with nothing to step, which copies the main parameters into the model
        and all-gathers them in the replica. The scatter runs before that step, not inside
        it: a rank whose sub-optimizer holds no parameters (a stub) never enters the step's
        update, and the scatter is a collective over all of the replica's ranks."""
        for key, (views, _, _, _) in self.channels.items():
            views.take(tensors[key], 0.0)
        self._run_step(lambda sub: None)

    def _take_split(self, shares: Optional[dict], ident: int) -> None:
        self._shares, self.split_id = shares, ident
        share = (shares or {}).get(self.replica)
        self.share = share
        if share is not None:
            self._set_share(share.offset, share.samples)

    def _fragments(self, keys: list[str]) -> list[int]:
        return sorted({self.channels[k][3] for k in keys})

    def lane_blocks(self, key: str) -> list[tuple]:
        """For a checkpoint in model space: channel ``key``'s lane as blocks
        (:meth:`.lanes.Space.lane_blocks`; none off the hosts)."""
        mover = self.channels[key][0].mover
        return mover.space.lane_blocks(mover.lane) if mover.lane is not None else []
