"""The outer step of elastic DiLoCo (:mod:`.elastic`): :class:`~.outer.OuterStep` driven by
torchft cycles instead of one world's program order.

At each of its sync points (the schedule's, as in one world) a replica opens a cycle:
the quorum, the fingerprints, a heal if it is behind; then the fragments that start at
the cycle's iteration are exchanged among the live replicas, over as many rows as there
are replicas (the channels are re-laid when that number changes), and the mean is over
the replicas that contributed. The cycle commits (every rank of every live replica saw
no failure) or is discarded: no outer update then, the error buffers as before the
exchange, the local parameters training on. With a delay tau the commit comes tau steps
after the start, where the single-world step applies. A replica starting (or restarting)
opens a cycle at once (:meth:`ElasticOuterStep.join`), which waits for the live replicas'
next sync point and heals it there.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from loco_megatron.config import ConfigError, brief
from loco_megatron.diloco import batch_split
from loco_megatron.diloco.batch_split import Share
from loco_megatron.diloco.elastic import Cycle, ElasticCoordinator, Fingerprint
from loco_megatron.diloco.exchange import OuterWork
from loco_megatron.diloco.outer import OuterStep
from loco_megatron.diloco.outer_math import nesterov_step
from loco_megatron.failures import RunAborted


class ElasticOuterStep(OuterStep):
    """``coordinator``: this rank's :class:`~.elastic.ElasticCoordinator`; ``replica``: its
    replica id; ``config_hash``: what every replica must share (:func:`.elastic.config_hash`);
    ``relay(key)``: a new channel for ``key`` laid over the current quorum (its error
    buffers at zero); ``split``: how the replicas share the global batch; the other
    arguments are :class:`OuterStep`'s. The trainer binds (:meth:`bind_progress`) what a
    heal sends and takes besides the outer state, and where this replica's batch share goes."""

    def __init__(self, *args, coordinator: ElasticCoordinator, replica: int, config_hash: int,
                 relay: Callable[[str], object], split: "SplitSettings", **kwargs):
        super().__init__(*args, **kwargs)
        self.coordinator, self.replica, self.config_hash = coordinator, replica, config_hash
        self._relay = relay
        self._progress: Callable[[], dict] = dict
        self._take_progress: Callable[[dict], None] = lambda state: None
        self._set_share: Callable[[int, int], None] = lambda offset, samples: None
        self.split = split
        self.share: Optional[Share] = split.initial
        """This replica's share of each step's global batch (None: not agreed yet)."""
        self.speed = 0.0
        """Samples per second over the last outer interval (0: not measured yet)."""
        self._train_s, self._interval_steps = 0.0, 0
        self.inner_steps = 0
        """Inner steps this job trained."""
        self._waited_s = 0.0
        self.waited_total_s = 0.0
        """Seconds this job spent at outer steps after its first (quorum, exchange, commit:
        in lockstep with a slower replica, mostly waiting for it)."""
        self.world = coordinator.expected
        """Replicas the channels are laid for (first: the replicas expected)."""
        self._laid = False
        """Whether a quorum laid the channels out yet."""
        self._snapshots: dict[str, dict] = {}
        """Error buffers of the channels exchanging in the open cycle, as before it (a
        discarded cycle puts them back)."""
        coordinator.heal_state = self.heal_state

    def bind_progress(self, progress: Callable[[], dict], take_progress: Callable[[dict], None],
                      set_share: Callable[[int, int], None]) -> None:
        """``progress()``: this replica's iteration and LR schedule position (a dict with
        ``iteration``); ``take_progress(state)`` sets them (and the data position) from a
        live replica's :meth:`heal_state`; ``set_share(offset, samples)``: the samples of
        each step's global batch this replica trains from the next step on."""
        self._progress, self._take_progress, self._set_share = progress, take_progress, set_share

    # -- what the replica trains and waits -----------------------------------------------------
    def count_step(self, seconds: float) -> None:
        """One inner step done, ``seconds`` of training (the speed the batch split measures)."""
        self._train_s += seconds
        self._interval_steps += 1
        self.inner_steps += 1

    def take_wait(self) -> float:
        """Seconds spent at outer steps since the last call (the log window's)."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited

    def _fingerprint(self, t: int, joining: bool) -> Fingerprint:
        """This replica's fingerprint; ends the speed measurement of the interval. Under
        ``throughput`` a collective over this job's ranks (every rank of a replica must put
        the same speed in, or its ranks would split the batch differently): the slowest
        rank's seconds count."""
        if self.split.mode == "throughput":
            seconds = self.split.slowest(self._train_s)
            if self._interval_steps and seconds > 0 and self.share is not None:
                self.speed = self._interval_steps * self.share.samples / seconds
        self._train_s, self._interval_steps = 0.0, 0
        return Fingerprint(self.replica, self.config_hash, t, joining,
                           samples=self.share.samples if self.share is not None else 0,
                           speed=round(self.speed * 1000), weight=round(self.split.weight * 1000),
                           lanes=self.coordinator.lanes, granule=self.split.granule)

    def _reweigh(self, cycle: Cycle) -> None:
        """The factor of this replica's outer gradient in this cycle (the mean over the
        contributors weighted by the samples each trained since the last outer step), then
        the batch split from the cycle's iteration on."""
        contributors = {p.replica: p.samples for p in cycle.participants if not p.healed}
        self.outer_scale = batch_split.mean_factors(contributors).get(self.replica, 1.0)
        members = [p.member() for p in cycle.participants]
        try:
            shares = batch_split.next_split(self.split.mode, members, self.split.global_batch)
        except ValueError as e:  # (every replica computes the same: all of them end with this line)
            error = ConfigError(f"--diloco-batch-split {self.split.mode}: {e}")
            error.agreed = True
            raise error from None
        if shares is None:
            return
        self.share = shares[self.replica]
        self._set_share(self.share.offset, self.share.samples)
        gathering = not cycle.exchanging and cycle.iteration == 0 and cycle.world < self.coordinator.expected
        if gathering:  # (the start of a run: more replicas are expected before the first step)
            return
        members.sort(key=lambda m: m.replica)
        if self.split.mode == "throughput" and all(m.speed > 0 for m in members):
            why = "measured " + ", ".join(f"{m.speed:.1f}" for m in members) + " samples/s"
        else:
            why = "weights " + ", ".join(f"{m.weight:g}" for m in members)
        self._log(f"DiLoCo: batch split from iteration {cycle.iteration}: {batch_split.describe(shares, why)}")

    # -- what a live replica sends one that heals ---------------------------------------------
    def heal_state(self) -> dict:
        """Per lane host (lane j of every replica holds the same elements, whatever the
        layouts): the lane's agreed parameters and momentum (by reference: they change only
        after the cycle commits), the outer step count, the iteration and the LR schedule's
        position."""
        return {**self._progress(), "outer_steps": self.outer_steps,
                "agreed": self.agreed, "momentum": self.momentum if self.mu else None}

    def _heal(self, cycle: Cycle) -> None:
        """Take a live replica's state: on lane hosts the agreed parameters and momentum of
        the lane (sent by the same lane's host there), on every rank the progress; then
        every rank's shards take the agreed parameters (a scatter over the replica)."""
        state = cycle.healed
        if self.coordinator.lane is not None:
            mine = {k: a.numel() for k, a in self.agreed.items()}
            theirs = {k: a.numel() for k, a in state["agreed"].items()}
            if mine != theirs:  # (the fingerprints match, so this is a bug, not bad input)
                raise RunAborted(f"DiLoCo: the state healed from a live replica does not fit this one's lanes "
                                 f"({theirs} there, {mine} here)")
            for key, a in self.agreed.items():
                a.copy_(state["agreed"][key])
                if self.momentum[key] is not None:
                    if state["momentum"] is None:
                        self.momentum[key].zero_()
                    else:
                        self.momentum[key].copy_(state["momentum"][key])
        dropped = len(self.pending)
        self.pending, self._snapshots = {}, {}
        had_errors = any(ch.comp1 is not None for _, ch, _, _ in self.channels.values())
        for _, channel, _, _ in self.channels.values():
            channel.reset()
        self.outer_steps = int(state["outer_steps"])
        self._take_all(self.agreed)  # local <- agreed, bit for bit, on every rank of the replica
        source = max(cycle.participants, key=lambda p: (p.iteration, not p.joining, -p.replica)).replica
        nbytes = sum(a.numel() * 4 * (2 if self.mu else 1) for a in self.agreed.values())
        self._log(f"DiLoCo: healed from replica {source} over torchft's transport: the agreed parameters and outer "
                  f"momentum ({nbytes / 2**20:.2f} MiB in lane 0), iteration {state['iteration']} and the LR "
                  f"schedule's position")
        if had_errors or dropped:
            self._log(f"DiLoCo: the outer error buffers start at zero"
                      + (f" and the {dropped} outer exchange(s) in flight are dropped" if dropped else ""))
        self._take_progress(state)

    def _take_all(self, tensors: dict) -> None:
        """Every rank's shards <- ``tensors`` (per channel, this rank's lane), then a megatron
        optimizer step with nothing to step, which copies the main parameters into the model
        and all-gathers them in the replica. The scatter runs before that step, not inside
        it: a rank whose sub-optimizer holds no parameters (a stub) never enters the step's
        update, and the scatter is a collective over all of the replica's ranks."""
        for key, (views, _, _, _) in self.channels.items():
            views.take(tensors[key], 0.0)
        self._run_step(lambda sub: None)

    def _agree_initial(self, cycle: Cycle) -> None:
        """The start of a run (every participant at iteration 0, none trained): replicas of
        other layouts initialise their weights differently (megatron seeds each TP rank's
        slice of its own), so they all take the lowest replica id's agreed parameters (a sum
        over the lane in which the others put zeros: exact), and their shards with them."""
        first = min(p.replica for p in cycle.participants)
        if self.coordinator.lane is not None:
            for a in self.agreed.values():
                if self.replica != first:
                    a.zero_()
                if a.numel():
                    self.coordinator.ops.all_reduce(a)
        self._take_all(self.agreed)

    def lane_blocks(self, key: str) -> list[tuple]:
        """For a checkpoint in model space: channel ``key``'s lane as blocks
        (:meth:`.lanes.Space.lane_blocks`; none off the hosts)."""
        mover = self.channels[key][0].mover
        return mover.space.lane_blocks(mover.lane) if mover.lane is not None else []

    def _agree_on_loaded(self) -> None:
        """Outer state afresh from the loaded model (the lanes read from the shards; a
        replica behind the others is healed at its first cycle anyway)."""
        for key, (views, channel, _, _) in self.channels.items():
            views.read(self.agreed[key])
            if self.momentum[key] is not None:
                self.momentum[key].zero_()
            channel.reset()
        self.pending = {}

    # -- the cycles ----------------------------------------------------------------------------
    def join(self, t: int) -> None:
        """At start-up (every rank of the job, before the first step): the first cycle,
        which waits for the live replicas' next sync point and heals this replica if it is
        behind. At the start of a run (every replica in the quorum at iteration 0, none
        training yet) the starting replicas wait, a cycle per second, until the replicas
        expected are there or --diloco-quorum-timeout-s has passed, so that replicas
        started together train together from the first step (a replica restarting later
        asks once: the live ones take it in at their next outer step)."""
        deadline = time.monotonic() + self.coordinator.quorum_timeout.total_seconds()
        said = False
        while True:
            cycle = self._cycle(t, joining=True)
            if cycle is None:  # discarded (a participant was refused): ask again until the deadline
                # (also while this replica has no batch share yet: it would train on samples
                # another replica's share may hold)
                if (t == 0 or self.share is None) and time.monotonic() < deadline:
                    time.sleep(1.0)
                    continue
                return
            starting = not cycle.exchanging and all(p.iteration == 0 for p in cycle.participants)
            if not starting or cycle.world >= self.coordinator.expected or time.monotonic() > deadline:
                return
            if not said:
                self._log(f"DiLoCo: waiting for the {self.coordinator.expected} replicas expected "
                          f"({cycle.world} here: {', '.join(map(str, cycle.replicas))})")
                said = True
            time.sleep(1.0)

    def after_step(self, t: int) -> None:
        """Everything the schedule puts after the inner step of iteration ``t``."""
        sched = self.schedule
        self._every_step()
        if sched.delay >= 2:
            for key in self._keys(sched.second_phase(t)):
                work = self.pending.get(key, (t, None))[1]
                if isinstance(work, OuterWork):
                    work.second_phase()
        applying = [k for k in self._keys(sched.applies(t) if sched.delay else []) if k in self.pending]
        start = time.perf_counter()
        if applying:
            self._close(applying)
        if sched.starts(t):
            self._cycle(t, joining=False)
        waited = time.perf_counter() - start
        self._waited_s += waited
        self.waited_total_s += waited

    def _cycle(self, t: int, joining: bool) -> Optional[Cycle]:
        """One cycle (see the module docstring); the cycle, or None when it was discarded."""
        mine = self._fingerprint(t, joining)
        try:
            cycle = self.coordinator.open(mine, self.outer_steps)
        except TimeoutError:
            raise RunAborted(f"DiLoCo: no quorum of replicas formed within --diloco-quorum-timeout-s "
                             f"({self.coordinator.quorum_timeout.total_seconds():.0f} s) at iteration {t}; is the "
                             f"lighthouse {self.coordinator.lighthouse} up and are the other replicas running?") from None
        if self.coordinator.refused_here(cycle):  # (before any healed state is applied: it may not fit)
            error = ConfigError(cycle.refused)
            error.agreed = True  # every rank of this replica refuses alike: rank 0 says it
            raise error
        if cycle.healed is not None:
            self._heal(cycle)
        if cycle.refused:  # another participant does not fit: it leaves; this cycle is discarded
            self._log(f"DiLoCo: {cycle.refused}; that replica is refused, the outer step at iteration "
                      f"{cycle.iteration} is skipped")
            self.coordinator.discard(RuntimeError(cycle.refused))
            self.coordinator.commit()
            return None
        self._follow(cycle)
        self._reweigh(cycle)
        if not cycle.exchanging:
            if cycle.world > 1 and all(p.iteration == 0 and p.joining for p in cycle.participants):
                self._agree_initial(cycle)
            self.coordinator.commit()
            return cycle
        keys = self._keys(self.schedule.starts(cycle.iteration))
        for key in keys:
            channel = self.channels[key][1]
            channel.mean_over = max(cycle.contributors, 1)
            self._snapshots[key] = channel.state_dict()
            self._start(key, cycle.iteration)
        if not self.schedule.delay:
            self._close(keys)
        return cycle

    def _follow(self, cycle: Cycle) -> None:
        """The channels over this cycle's replicas: re-laid when their number changed, and
        this replica's row (its place among them) wherever it is now."""
        if cycle.world != self.world:
            self._lay_out(cycle.world, cycle.iteration)
        self._laid = True
        for _, channel, _, _ in self.channels.values():
            channel.rank = cycle.rank

    def _lay_out(self, world: int, iteration: int) -> None:
        """Channels laid over ``world`` replicas (their rows are per replica): fresh ones,
        error buffers at zero, nothing of the old layout in flight."""
        before, first = self.world, not self._laid
        had_errors = any(ch.comp1 is not None for _, ch, _, _ in self.channels.values())
        for key, (views, _, sub, frag) in list(self.channels.items()):
            self.channels[key] = (views, self._relay(key), sub, frag)
        self.world = world
        # (the first quorum only fixes what the channels were laid for at start-up, and
        # before the first step the replicas gathering at the start have nothing to re-lay)
        if not first and iteration > 0:
            self._log(f"DiLoCo: {world} replica(s) take part (were {before}): the outer exchange is re-laid for "
                      f"{world}" + (", its error buffers start at zero" if had_errors else ""))

    def _close(self, keys: list[str]) -> None:
        """Finish the cycle's exchanges and commit it: apply their means (as one world's
        step would) or discard them (error buffers put back, the local parameters as they
        are). The decision is the same on every rank of this replica, so its optimizer step
        (the replica's own all-gather) runs on all of them or none."""
        for key in keys:
            self._settled_mean_work(key)
        committed = self.coordinator.commit()
        if committed:
            for key in keys:  # (the scatter of each before megatron's step: see _take_all)
                self._apply(key)
            self._run_step(lambda sub: None)
            self.outer_steps += 1
        else:
            for key in keys:
                self.pending.pop(key, None)
                self.channels[key][1].load_state_dict(self._snapshots[key])
            why = self.coordinator.errored()
            reason = brief(why.original_exception) if why else "fewer live replicas than --diloco-min-replicas"
            self._log(f"DiLoCo: the outer step was discarded ({reason}); the replicas train on and the next one "
                      f"goes on")
        for key in keys:
            self._snapshots.pop(key, None)

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
        """The last step ``t``: the cycle in flight is committed or discarded; then, when
        ``exchange`` (the run reached --train-iters, where every live replica ends), one
        more cycle over every fragment whose mean gives :attr:`final` on copies (the
        checkpoint keeps the state before it). Without ``exchange`` (this replica stops
        alone: the others train on) :attr:`final` is the agreed parameters."""
        in_flight = [k for k in self.pending]
        if in_flight:
            self._close(in_flight)
        self.final = {key: a.clone() for key, a in self.agreed.items()}
        if not exchange:
            return {"exchanged": [], "in_flight": len(in_flight)}
        sched = self.schedule
        synced = set(sched.applies(t) if sched.delay else sched.starts(t)) if self.alpha == 0.0 else set()
        keys = [k for k, (_, _, _, f) in self.channels.items() if f not in synced]
        if not keys:  # every fragment just synced: the agreed parameters are every replica's already
            return {"exchanged": [], "in_flight": len(in_flight)}
        mine = self._fingerprint(t, joining=False)
        cycle = self.coordinator.open(mine, self.outer_steps)
        if cycle.healed is not None or cycle.refused or not cycle.exchanging:
            self.coordinator.commit()
            return {"exchanged": [], "in_flight": len(in_flight)}
        self._follow(cycle)
        contributors = {p.replica: p.samples for p in cycle.participants if not p.healed}
        scale = batch_split.mean_factors(contributors).get(self.replica, 1.0)
        results = {}
        for key in keys:
            views, channel, _, _ = self.channels[key]
            errors = channel.state_dict()
            delta = torch.empty_like(self.agreed[key])
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
        committed = self.coordinator.commit()
        for key, (mean, errors) in results.items():
            self.channels[key][1].load_state_dict(errors)  # a resume finds them as before
            if committed:
                momentum = self.momentum[key].clone() if self.momentum[key] is not None else None
                nesterov_step(self.final[key], momentum, mean, self.lr, self.mu)
        return {"exchanged": self._fragments(list(results)) if committed else [], "in_flight": len(in_flight)}

    def take_final(self) -> None:
        """Every replica takes :attr:`final` (see :meth:`OuterStep.take_final`), scattered
        from the lanes."""
        assert self.final is not None, "finish() first"
        self._take_all(self.final)

    # -- checkpointing ---------------------------------------------------------------------------
    def common_state(self) -> dict:
        return {**super().common_state(), "elastic": self.coordinator.state_dict()}

    def load_state_dict(self, sd: Optional[dict]) -> None:
        """As :meth:`OuterStep.load_state_dict`, decided alike on every rank of the job: a
        rank hosting no lane loads nothing (a checkpoint may give it no outer state at all),
        so whether the lanes start afresh (a collective over the replica) is the lane hosts'
        verdict, and the outer-step count is rank 0's."""
        import torch.distributed as dist

        host = self.coordinator.lane is not None
        fits = not host or (sd is not None and set(sd["agreed"]) == set(self.channels)
                            and all(sd["agreed"][k].numel() == a.numel() for k, a in self.agreed.items()))
        verdict = torch.tensor([int(fits)])
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.coordinator.control)
        if not verdict.item():
            self._agree_on_loaded()
            self._log("DiLoCo: the checkpoint's outer state does not fit this run's lanes; the outer step starts "
                      "afresh from this replica's loaded parameters (a replica behind the others heals from them)")
        elif sd is not None:
            super().load_state_dict(sd)
        count = [self.outer_steps]
        dist.broadcast_object_list(count, src=0, group=self.coordinator.control)
        self.outer_steps = int(count[0])
        self.coordinator.load_state_dict((sd or {}).get("elastic"))


@dataclasses.dataclass
class SplitSettings:
    """How the replicas share each step's global batch (:mod:`.batch_split`)."""

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
    collective over the job; called at each outer step under ``throughput`` only)."""
