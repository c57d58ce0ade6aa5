"""The outer step of elastic DiLoCo: :class:`~loco_megatron.diloco.outer.OuterStep` driven by
torchft cycles (:mod:`.coordinator`) instead of one world's program order.

At each of its sync points (the schedule's, as in one world) a replica opens a cycle; the
plan (:func:`.cycle.plan`) says what it does, the same on every participant:

* a heal (torchft's, in the quorum) is taken at once: it is a committed state of the run;
* the batch split changes when the quorum passed the go vote (its membership is known to
  every participant alike), from the next step on;
* an agreement (:mod:`.agreement`), an outer step (the fragments starting at the cycle's
  iteration, among the live replicas, over as many rows as there are contributors, the
  mean weighted by the samples each trained) reaches the agreed parameters, the momentum
  and the error buffers only when the cycle commits on every lane of the replica and the
  commit vote of the participants says yes; a discarded one leaves them as before and the
  local parameters train on (their progress goes into the next outer step).

With a delay tau the commit comes tau steps after the start, where the single-world step
applies. A replica starting (or restarting) joins first (:meth:`ElasticOuterStep.join`):
it asks until it trains on a model the others share.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from loco_megatron.config import ConfigError
from loco_megatron.diloco.elastic import split as batch_split
from loco_megatron.diloco.elastic.agreement import adopt, state_hash
from loco_megatron.diloco.elastic.coordinator import ElasticCoordinator
from loco_megatron.diloco.elastic.cycle import (AGREE, OUTER, RECHECK, REFUSE, WAIT, WITHHELD, Cycle, Fingerprint,
                                                describe_shares, live_mask, missing, plan)
from loco_megatron.diloco.elastic.split import Share
from loco_megatron.diloco.exchange import OuterWork
from loco_megatron.diloco.outer import OuterStep
from loco_megatron.diloco.outer_math import nesterov_step
from loco_megatron.failures import RunAborted

RECHECK_S = 5.0
"""Seconds before asking again for a quorum that missed a replica of the last cycle: long
enough for a live replica's heartbeat to reach a lighthouse that just restarted."""


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
class Rules:
    """What the plan needs besides the fingerprints."""

    expected: int
    """--diloco-replicas."""
    min_replicas: int
    """--diloco-min-replicas."""
    world: int
    """This job's ranks."""


class ElasticOuterStep(OuterStep):
    """``coordinator``: this rank's :class:`~.coordinator.ElasticCoordinator`; ``replica``: its
    replica id; ``config_hash``: what every replica must share (:func:`.cycle.config_hash`);
    ``relay(key)``: a new channel for ``key`` laid over the current quorum (its error
    buffers at zero); ``split``: how the replicas share the global batch; ``rules``: the
    plan's settings; the other arguments are :class:`OuterStep`'s. The trainer binds
    (:meth:`bind_progress`) what a heal sends and takes besides the outer state, and where
    this replica's batch share goes."""

    def __init__(self, *args, coordinator: ElasticCoordinator, replica: int, config_hash: int,
                 relay: Callable[[str], object], split: SplitSettings, rules: Rules, **kwargs):
        super().__init__(*args, **kwargs)
        self.coordinator, self.replica, self.config_hash = coordinator, replica, config_hash
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
        self._open: Optional[Cycle] = None
        """The cycle whose outer step is in flight (tau > 0), closed where it applies."""
        self.unfinished = ""
        """After :meth:`finish`: non-empty when the run has no agreed final model (the line why)."""
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
        step's global batch this replica trains from the next step on."""
        self._progress, self._take_progress, self._set_share = progress, take_progress, set_share

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
                           world=self.rules.world, live=live_mask(self.coordinator.live), recheck=recheck)

    def _lane_fingerprint(self, common: Fingerprint, healed: Optional[dict]) -> Fingerprint:
        """``common`` with this lane's state (after a heal: what it took, and the source's
        progress and split)."""
        if healed is None:
            return dataclasses.replace(common, state=state_hash(self.agreed, self.momentum, self.outer_steps))
        shares = healed.get("shares")
        share = (shares or {}).get(self.replica, Share(0, 0)) if self.split.mode != "fixed" else self.share
        return dataclasses.replace(
            common, iteration=int(healed["iteration"]), outer_steps=int(healed["outer_steps"]), healed=True,
            state=state_hash(healed["agreed"], healed["momentum"] or {}, int(healed["outer_steps"])),
            split=int(healed.get("split", 0)), offset=share.offset if share else 0,
            samples=share.samples if share else 0, trained=0)

    def _plan(self, participants: list[Fingerprint], rank: int, healed: Optional[dict]) -> Cycle:
        return plan(participants, rank, self.rules.expected, self.rules.min_replicas, self.split.mode,
                    self.split.global_batch, healed)

    # -- what a live replica sends one that heals ---------------------------------------------
    def heal_state(self) -> dict:
        """Per lane host (lane j of every replica holds the same elements, whatever the
        layouts): the lane's agreed parameters and momentum (by reference: they change only
        when the cycle closes), the outer step count, the iteration, the LR schedule's
        position, the batch split and who sent it."""
        return {**self._progress(), "outer_steps": self.outer_steps, "replica": self.replica,
                "split": self.split_id, "shares": self._shares, "agreed": self.agreed,
                "momentum": self.momentum if self.mu else None}

    def _heal(self, cycle: Cycle) -> None:
        """Take a live replica's state (a committed state of the run: taken at once): on lane
        hosts the agreed parameters and momentum of the lane, on every rank the progress and
        the split; then every rank's shards take the agreed parameters."""
        state = cycle.healed
        if self.coordinator.lane is not None:
            mine = {k: a.numel() for k, a in self.agreed.items()}
            theirs = {k: a.numel() for k, a in state["agreed"].items()}
            if mine != theirs:  # (the fingerprints match, so this is a bug, not bad input)
                raise RunAborted(f"DiLoCo: the state healed from a live replica does not fit this one's lanes "
                                 f"({theirs} there, {mine} here)")
            self._adopt(state["agreed"], state["momentum"])
        kept = self.inner_steps > 0
        self._restart_outer(int(state["outer_steps"]))
        if self.split.mode != "fixed":
            shares = state.get("shares")
            self._take_split(shares, int(state.get("split", 0)) if shares else 0)
        nbytes = sum(a.numel() * 4 * (2 if self.mu else 1) for a in self.agreed.values())
        self._log(f"DiLoCo: healed from replica {state['replica']} over torchft's transport: the agreed parameters "
                  f"and outer momentum ({nbytes / 2**20:.2f} MiB in lane 0), iteration {state['iteration']} and "
                  f"the LR schedule's position")
        self._take_progress(state, kept)

    def _adopt(self, agreed: dict, momentum: Optional[dict]) -> None:
        """This lane's agreed parameters and momentum <- ``agreed``/``momentum`` (momentum None: zero)."""
        for key, a in self.agreed.items():
            a.copy_(agreed[key])
            if self.momentum[key] is not None:
                if momentum is None or momentum.get(key) is None:
                    self.momentum[key].zero_()
                else:
                    self.momentum[key].copy_(momentum[key])

    def _restart_outer(self, outer_steps: int) -> None:
        """After the agreed state changed hands (a heal, an agreement): nothing in flight, error
        buffers at zero, the local parameters the agreed ones, every fragment's interval anew."""
        dropped = len(self.pending)
        had_errors = any(ch.comp1 is not None for _, ch, _, _ in self.channels.values())
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

    def lane_blocks(self, key: str) -> list[tuple]:
        """For a checkpoint in model space: channel ``key``'s lane as blocks
        (:meth:`.lanes.Space.lane_blocks`; none off the hosts)."""
        mover = self.channels[key][0].mover
        return mover.space.lane_blocks(mover.lane) if mover.lane is not None else []

    # -- the cycles ----------------------------------------------------------------------------
    def join(self, t: int) -> None:
        """At start-up (every rank of the job, before the first step): cycles until this
        replica trains on a model the others share. A live replica at its next sync point
        heals it (or takes it in at par); replicas that all start (a run's start, or every
        job restarted from its checkpoint) wait, a cycle a second, until the replicas
        expected are there or this one has waited --diloco-quorum-timeout-s (rank 0's clock
        decides, for every rank), then agree on one model. A cycle that fails (or an
        agreement that does not commit) is asked again, for as long again at most."""
        limit = self.coordinator.quorum_timeout.total_seconds()
        started = failing = time.monotonic()
        said = False
        while True:
            now = time.monotonic()
            ready, give_up = self.coordinator.decide((now - started > limit, now - failing > limit))
            cycle, committed = self._cycle(self._iteration(), joining=True, ready=ready)
            if cycle is not None and cycle.action != WAIT and (cycle.action != AGREE or committed):
                # (the go vote passed: this replica holds a share of the split every participant
                # took, on a model they share; an outer step discarded, or in flight under a
                # delay, leaves it so)
                return
            if cycle is not None and cycle.action == WAIT:
                failing = time.monotonic()
                if not said:
                    self._log(f"DiLoCo: waiting for the {self.rules.expected} replicas expected ({cycle.world} "
                              f"here: {', '.join(map(str, cycle.replicas))})")
                    said = True
            elif give_up:
                raise RunAborted(f"DiLoCo: replica {self.replica} could not join the run within "
                                 f"--diloco-quorum-timeout-s ({limit:.0f} s): {self.coordinator.errored()}")
            time.sleep(1.0)

    def after_step(self, t: int) -> None:
        """Everything the schedule puts after the inner step of iteration ``t``."""
        sched = self.schedule
        self._second_phases(t)
        applying = [k for k in self._keys(sched.applies(t) if sched.delay else []) if k in self.pending]
        start = time.perf_counter()
        if applying:
            self._close_outer(applying)
        if sched.starts(t):
            self._cycle(t, joining=False)
        waited = time.perf_counter() - start
        self._waited_s += waited
        self.waited_total_s += waited

    def _cycle(self, t: int, joining: bool, ready: bool = False) -> tuple[Optional[Cycle], bool]:
        """One cycle (the module docstring): ``(cycle, committed)``, the cycle None when none
        went through the go vote. At a sync point a cycle that failed before the go vote is
        asked again (a second after; five when it missed a replica of the last cycle) until
        it goes through or has failed for --diloco-quorum-timeout-s (then the run ends in one
        line): the replicas train on only after a cycle whose membership and batch split
        every participant confirmed. A joining replica's loop (:meth:`join`) asks again
        itself. A delayed outer step returns ``committed`` False with the cycle open
        (:attr:`_open`)."""
        recheck, started = False, time.monotonic()
        limit = self.coordinator.quorum_timeout.total_seconds()
        while True:
            cycle, committed, again = self._attempt(t, joining, ready, recheck)
            if again is None or (joining and again != RECHECK):
                return cycle, committed
            recheck = recheck or again == RECHECK
            if self.coordinator.decide(time.monotonic() - started > limit):  # (rank 0's clock, for every rank)
                raise RunAborted(f"DiLoCo: the cycle at iteration {t} kept failing for --diloco-quorum-timeout-s "
                                 f"({limit:.0f} s): {self.coordinator.errored()}")
            time.sleep(RECHECK_S if again == RECHECK else 1.0)

    def _attempt(self, t: int, joining: bool, ready: bool, recheck: bool) -> tuple[Optional[Cycle], bool, Optional[str]]:
        """One try at a cycle: ``(cycle, committed, again)``; ``again``: why to ask again
        (:data:`.cycle.RECHECK`, "failed", "refused"), None when the cycle went through."""
        common = self._common(t, joining, ready, recheck)
        cycle = self.coordinator.open(t, self.outer_steps, lambda healed: self._lane_fingerprint(common, healed),
                                      self._plan)
        if cycle is None:
            self.coordinator.close(False)
            if not joining:
                self._log(f"DiLoCo: the cycle at iteration {t} failed ({self.coordinator.errored()}); it is asked "
                          f"again")
            return None, False, "failed"
        if cycle.action == REFUSE:
            if self.coordinator.refused_here(cycle):  # (before any healed state is applied: it may not fit)
                error = ConfigError(cycle.refused)
                error.agreed = True  # every rank of this replica refuses alike: rank 0 says it
                raise error
            self._log(f"DiLoCo: {cycle.refused}; that replica is refused, the cycle at iteration {cycle.iteration} "
                      f"is asked again without it")
            self.coordinator.close(False, refused=True)
            return None, False, "refused"
        if cycle.healed is not None:
            self._heal(cycle)
        if cycle.action == WAIT:
            return cycle, self.coordinator.close(True), None
        if cycle.action == RECHECK:
            gone = ", ".join(map(str, missing(cycle.participants)))
            self._log(f"DiLoCo: replica(s) {gone} of the last cycle missing from the quorum at iteration {t}; asking "
                      f"the lighthouse again in {RECHECK_S:.0f} s")
            self.coordinator.close(True)
            return cycle, False, RECHECK
        self.coordinator.say_membership(cycle)
        self._resplit(cycle)
        if cycle.action == AGREE:
            return cycle, self._agree(cycle), None
        if cycle.action == WITHHELD:
            self._log(f"DiLoCo: the outer step at iteration {cycle.iteration} is withheld ({cycle.contributors} "
                      f"live replica(s), --diloco-min-replicas {self.rules.min_replicas}): the replicas train on "
                      f"and their progress goes into the next outer step")
        if cycle.action != OUTER:
            return cycle, self.coordinator.close(True), None
        keys = self._keys(self.schedule.starts(cycle.iteration))
        self._follow(cycle)
        contributors = {p.replica: p.trained for p in cycle.participants if not p.healed}
        self.outer_scale = batch_split.mean_factors(contributors).get(self.replica, 1.0)
        healed = cycle.healed is not None
        self.coordinator.phase = "outer"
        for key in keys:
            channel = self.channels[key][1]
            channel.mean_over = max(cycle.contributors, 1)
            self._snapshots[key] = (channel, channel.state_dict())
            self._start(key, cycle.iteration, zeros=healed)
        self._open = cycle
        if self.schedule.delay:
            return cycle, False, None
        return cycle, self._close_outer(keys), None

    def _start(self, key: str, t: int, zeros: bool = False) -> None:
        if not zeros:
            return super()._start(key, t)
        # A replica that just healed sends zeros (its gradient is not counted in the mean).
        views, channel, _, _ = self.channels[key]
        self.pending[key] = (t, channel.start(torch.zeros(views.numel, dtype=torch.float32,
                                                          device=self.agreed[key].device)))

    def _resplit(self, cycle: Cycle) -> None:
        """The batch split from the next step on (every participant the same: the go vote passed)."""
        if cycle.shares is None:
            return
        self._take_split(cycle.shares, batch_split.split_id(cycle.shares))
        self._log(f"DiLoCo: batch split from iteration {cycle.iteration}: "
                  f"{describe_shares(cycle.shares, [p.member() for p in cycle.participants], self.split.mode)}")

    def _agree(self, cycle: Cycle) -> bool:
        """Every participant takes the source's state (:func:`.agreement.adopt`), if the cycle commits."""
        taken = None
        if self.coordinator.lane is not None:
            self.coordinator.phase = "agreement"
            taken = adopt(self.agreed, self.momentum, cycle.source == self.replica,
                          lambda t: self.coordinator.ops.all_reduce(t))
        committed = self.coordinator.close(True)
        if not committed:
            self._log(f"DiLoCo: the replicas' agreement on one model at iteration {cycle.iteration} was discarded "
                      f"({self.coordinator.errored()}); it is asked again")
            return False
        if taken is not None:
            self._adopt(*taken)
        self._restart_outer(self.outer_steps)
        start = cycle.iteration == 0 and all(p.joining for p in cycle.participants)
        self._log(f"DiLoCo: replicas {', '.join(map(str, cycle.replicas))} " +
                  (f"start from replica {cycle.source}'s initial weights" if start else
                   f"held other models at iteration {cycle.iteration} (a restart from checkpoints of other moments); "
                   f"every replica takes replica {cycle.source}'s"))
        return True

    def _follow(self, cycle: Cycle) -> None:
        """The channels over this cycle's contributors: re-laid when they changed (their rows
        are per replica), and this replica's row (its place among them)."""
        contributors = tuple(p.replica for p in cycle.participants)
        if contributors != self._laid_for:
            for key, (views, _, sub, frag) in list(self.channels.items()):
                self.channels[key] = (views, self._relay(key), sub, frag)
            self._laid_for = contributors
        for _, channel, _, _ in self.channels.values():
            channel.rank = cycle.rank

    def _close_outer(self, keys: list[str]) -> bool:
        """Finish the open cycle's exchanges and close it: apply their means (as one world's
        step would) when it commits, else put the channels back as they were and keep the
        local parameters as they are. The decision is the same on every rank of this
        replica, so its optimizer step (the replica's own all-gather) runs on all of them or none."""
        cycle, self._open = self._open, None
        for key in keys:
            self._settled_mean_work(key)
        committed = self.coordinator.close(True)
        if committed:
            for key in keys:  # (the scatter of each before megatron's step: see _take_all)
                self._apply(key)
            self._run_step(lambda sub: None)
            self.outer_steps += 1
            for f in self._fragments(keys):
                self._since[f] = self.samples_trained
                self._synced_at[f] = self._iteration()
            self.coordinator.committed += 1
            mine = cycle.mine(self.replica) if cycle is not None else None
            self.coordinator.took_part += int(mine is not None and not mine.healed)
        else:
            for key in keys:
                self.pending.pop(key, None)
                channel, errors = self._snapshots[key]
                views, _, sub, frag = self.channels[key]
                channel.load_state_dict(errors)
                self.channels[key] = (views, channel, sub, frag)
            self._laid_for = ()  # (the channels put back may be laid for other contributors)
            self._log(f"DiLoCo: the outer step was discarded ({self.coordinator.errored()}); the replicas train on "
                      f"and the next one goes on")
        for key in keys:
            self._snapshots.pop(key, None)
        return committed

    def _fragments(self, keys: list[str]) -> list[int]:
        return sorted({self.channels[k][3] for k in keys})

    def _settled_mean_work(self, key: str) -> None:
        """Finish ``key``'s exchange (its mean then in :attr:`pending`)."""
        t, work = self.pending[key]
        if isinstance(work, OuterWork):
            work.wait()
            self._record(work)
            self.pending[key] = (t, work.delta)

    # -- the end of a run ----------------------------------------------------------------------
    def finish(self, t: int, exchange: bool = True) -> dict:
        """The last step ``t``: the cycle in flight is closed; then, when ``exchange`` (the
        run reached --train-iters, where every live replica ends), one more cycle over every
        fragment not just synced, whose mean gives :attr:`final` on copies (the checkpoint
        keeps the state before it). Without ``exchange`` (this replica stops alone: the
        others train on) :attr:`final` is the agreed parameters. No final model
        (:attr:`final` None, :attr:`unfinished` says why) when the final outer step is
        withheld (fewer live replicas than --diloco-min-replicas) or no outer step ever
        committed (the agreed parameters would be the initial weights)."""
        in_flight = [k for k in self.pending]
        if in_flight:
            self._close_outer(in_flight)
        self.final = {key: a.clone() for key, a in self.agreed.items()}
        exchanged = self._final_cycle(t) if exchange else []
        if not exchanged and self.outer_steps == 0 and not self.unfinished:
            self.unfinished = (f"DiLoCo: replica {self.replica} ends at iteration {t} with no outer step committed: "
                               f"the run has no agreed model (only the initial one)")
        if self.unfinished:
            self.final = None
        return {"exchanged": exchanged, "in_flight": len(in_flight)}

    def _final_cycle(self, t: int) -> list[int]:
        """The final outer step over every fragment whose local parameters are not the agreed
        ones (all but those committed at ``t`` itself with alpha 0), into :attr:`final`;
        returns the fragments exchanged ([]: none committed)."""
        keys = [k for k, (_, _, _, f) in self.channels.items() if self.alpha or self._synced_at.get(f) != t]
        if not keys:
            return []
        common = self._common(t, False, False)
        common.trained = max(self.samples_trained - self._since[self.channels[k][3]] for k in keys)
        cycle = self.coordinator.open(t, self.outer_steps, lambda healed: self._lane_fingerprint(common, healed),
                                      self._plan)
        if cycle is not None and cycle.action == REFUSE:
            self.coordinator.close(False, refused=True)
            return []
        if cycle is not None and cycle.healed is not None:
            self._heal(cycle)  # (behind at the very end: it sends zeros and ends on the run's final model)
            self.final = {key: a.clone() for key, a in self.agreed.items()}
        if cycle is None or cycle.action != OUTER:
            self.coordinator.close(cycle is not None)
            if cycle is not None and cycle.action == WITHHELD:
                self.unfinished = (f"DiLoCo: the final outer step at iteration {t} is withheld ({cycle.contributors} "
                                   f"live replica(s), --diloco-min-replicas {self.rules.min_replicas}): the run has "
                                   f"no agreed final model")
            elif self.outer_steps:
                self._log(f"DiLoCo: the final outer step at iteration {t} was not taken "
                          f"({self.coordinator.errored() if cycle is None else cycle.action}); every replica ends "
                          f"on the agreed model of its last committed outer step")
            return []
        self._follow(cycle)
        contributors = {p.replica: p.trained for p in cycle.participants if not p.healed}
        scale = batch_split.mean_factors(contributors).get(self.replica, 1.0)
        zeros = cycle.healed is not None
        results = {}
        self.coordinator.phase = "outer"
        for key in keys:
            views, channel, _, _ = self.channels[key]
            errors = channel.state_dict()
            delta = torch.zeros_like(self.agreed[key])
            if not zeros:
                views.outer_gradient(self.agreed[key], delta)
            if scale != 1.0:
                delta.mul_(scale)
            channel.mean_over = max(cycle.contributors, 1)
            work = channel.start(delta)
            if isinstance(work, OuterWork):
                work.wait()
                self._record(work)
                results[key] = (torch.where(work.finite, delta, torch.zeros((), device=delta.device)), errors)
            else:  # (no lane here: nothing to exchange)
                results[key] = (work, errors)
        committed = self.coordinator.close(True)
        for key, (mean, errors) in results.items():
            self.channels[key][1].load_state_dict(errors)  # a resume finds them as before
            if committed:
                momentum = self.momentum[key].clone() if self.momentum[key] is not None else None
                nesterov_step(self.final[key], momentum, mean, self.lr, self.mu)
        if not committed:
            self._log(f"DiLoCo: the final outer step at iteration {t} was discarded ({self.coordinator.errored()}); "
                      f"every replica ends on the agreed model of its last committed outer step")
            return []
        return self._fragments(list(results))

    def take_final(self) -> None:
        """Every replica takes :attr:`final` (see :meth:`OuterStep.take_final`), scattered
        from the lanes (nothing when the run has no final model: it keeps its own)."""
        if self.final is not None:
            self._take_all(self.final)

    # -- checkpointing ---------------------------------------------------------------------------
    def common_state(self) -> dict:
        return {**super().common_state(), "elastic": {
            **self.coordinator.state_dict(), "samples_trained": self.samples_trained,
            "since": {str(f): n for f, n in self._since.items()}, "split": self.split_id,
            "shares": {str(r): [s.offset, s.samples] for r, s in (self._shares or {}).items()}}}

    def load_state_dict(self, sd: Optional[dict]) -> None:
        """As :meth:`OuterStep.load_state_dict`, decided alike on every rank of the job: a
        rank hosting no lane loads nothing (a checkpoint may give it no outer state at all),
        so whether the lanes start afresh is the lane hosts' verdict, and the outer-step
        count and the split are rank 0's. A state that does not fit starts from this
        replica's loaded parameters: the replicas' states then differ, and the first cycle
        makes them agree on one (:mod:`.agreement`)."""
        import torch.distributed as dist

        host = self.coordinator.lane is not None
        fits = not host or (sd is not None and set(sd["agreed"]) == set(self.channels)
                            and all(sd["agreed"][k].numel() == a.numel() for k, a in self.agreed.items()))
        verdict = torch.tensor([int(fits)])
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.coordinator.control)
        if not verdict.item():
            self._agree_on_loaded()
            self._log("DiLoCo: the checkpoint's outer state does not fit this run's lanes; the outer step starts "
                      "afresh from this replica's loaded parameters (the replicas agree on one model at the first "
                      "outer step)")
        elif sd is not None:
            super().load_state_dict(sd)
        elastic = self.coordinator.decide([self.outer_steps, (sd or {}).get("elastic")])
        self.outer_steps = int(elastic[0])
        saved = elastic[1] or {}
        self.coordinator.load_state_dict(saved)
        if saved.get("shares") and self.split.mode != "fixed":
            shares = {int(r): Share(int(o), int(n)) for r, (o, n) in saved["shares"].items()}
            self._take_split(shares, int(saved.get("split", 0)))
        self.samples_trained = int(saved.get("samples_trained", 0))
        self._since = {f: int(saved.get("since", {}).get(str(f), self.samples_trained)) for f in self._since}

    def _agree_on_loaded(self) -> None:
        """Outer state afresh from the loaded model (the lanes read from the shards)."""
        for key, (views, channel, _, _) in self.channels.items():
            views.read(self.agreed[key])
            if self.momentum[key] is not None:
                self.momentum[key].zero_()
            channel.reset()
        self.pending = {}
