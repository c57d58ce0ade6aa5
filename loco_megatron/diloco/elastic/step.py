"""The outer step of elastic DiLoCo: :class:`~loco_megatron.diloco.outer.OuterStep` driven by
torchft cycles (:mod:`.coordinator`) instead of one world's program order.

At each of its sync points (the schedule's, as in one world) a replica opens a cycle; the
plan (:func:`.cycle.plan`) says what it does, the same on every participant:

* a cycle that fails before the go vote (a quorum error, a lost fingerprint, a replica of
  the last cycle missing) is asked again: the replicas train on only on a membership and
  a batch split every participant confirmed;
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

import time
from typing import Optional

import torch

from loco_megatron.config import ConfigError
from loco_megatron.diloco.elastic import split as batch_split
from loco_megatron.diloco.elastic.agreement import adopt
from loco_megatron.diloco.elastic.cycle import (AGREE, OUTER, RECHECK, REFUSE, WAIT, WITHHELD, Cycle, describe_shares,
                                                missing)
from loco_megatron.diloco.elastic.final import EndOfRun
from loco_megatron.diloco.elastic.replica import OpenCycle
from loco_megatron.diloco.elastic.saved import ReplicaCheckpoint
from loco_megatron.diloco.exchange import OuterWork
from loco_megatron.failures import RunAborted

class ElasticOuterStep(EndOfRun, ReplicaCheckpoint):
    """``coordinator``: this rank's :class:`~.coordinator.ElasticCoordinator`; ``replica``: its
    replica id; ``config_hash``: what every replica must share (:func:`.cycle.config_hash`);
    ``relay(key, world)``: a new channel for ``key`` laid for ``world`` replicas (its error
    buffers at zero); ``split``: how the replicas share the global batch; ``rules``: the
    plan's settings; the other arguments are :class:`OuterStep`'s. The trainer binds
    (:meth:`bind_progress`) what a heal sends and takes besides the outer state, and where
    this replica's batch share goes."""

    recheck_s = 5.0
    """Seconds before asking again for a quorum that missed a replica of the last cycle: long
    enough for a live replica's heartbeat to reach a lighthouse that just restarted."""
    retry_s = 1.0
    """Seconds before asking again after a cycle that failed before its go vote (and between
    a joining replica's cycles)."""

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
            time.sleep(self.retry_s)

    def after_step(self, t: int) -> None:
        """Everything the schedule puts after the inner step of iteration ``t``."""
        sched = self.schedule
        self._second_phases(t)
        start = time.perf_counter()
        if self._open is not None and self._open.closes_at == t:  # (program order: tau after its start)
            self._close_outer()
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
        line; it counts from the end of the first failed attempt): the replicas train on
        only after a cycle whose membership and batch split every participant confirmed. A
        joining replica's loop (:meth:`join`) asks again itself. A delayed outer step
        returns ``committed`` False with the cycle open (:attr:`_open`)."""
        recheck, started = False, None
        limit = self.coordinator.quorum_timeout.total_seconds()
        while True:
            if self._ended_without_this_replica(joining):
                return None, False
            t = max(t, self._iteration())  # (a heal in an attempt asked again moved this replica on)
            with self.coordinator.waiting:  # (a line while it waits long on other replicas, and when it ends)
                cycle, committed, again = self._attempt(t, joining, ready, recheck)
            if again is None or (joining and again != RECHECK):
                return cycle, committed
            recheck = recheck or again == RECHECK
            # The timeout counts from the end of the first failed attempt: an attempt that
            # waited --diloco-exchange-timeout-s on a peer stalled inside the cycle does not
            # eat it, so the live replicas ask again and go on without that peer.
            started = time.monotonic() if started is None else started
            if self.coordinator.decide(time.monotonic() - started > limit):  # (rank 0's clock, for every rank)
                raise RunAborted(f"DiLoCo: the cycle at iteration {t} kept failing for --diloco-quorum-timeout-s "
                                 f"({limit:.0f} s): {self.coordinator.errored()}")
            time.sleep(self.recheck_s if again == RECHECK else self.retry_s)

    def _ended_without_this_replica(self, joining: bool) -> bool:
        """Before each cycle (every rank, rank 0 reads the lighthouse): whether the run reached
        --train-iters in a quorum this replica was not in (it was stalled, or cut off, while
        the others finished). It then ends (:attr:`ended`): a cycle of its own would make it
        the run's only replica, and its final model another than the one the run ended on.
        A joining replica ends at once (RunAborted: it trained nothing in this job)."""
        if not self.rules.train_iters:
            return False
        line = self.coordinator.run_ended(self.rules.train_iters)
        if not line:
            return False
        if joining:
            raise RunAborted(line)
        self.ended, self.unfinished = True, line
        self._log(line)
        return True

    def _attempt(self, t: int, joining: bool, ready: bool, recheck: bool) -> tuple[Optional[Cycle], bool, Optional[str]]:
        """One try at a cycle: ``(cycle, committed, again)``; ``again``: why to ask again
        (:data:`.cycle.RECHECK`, "failed", "refused"), None when the cycle went through."""
        common = self._common(t, joining, ready, recheck)
        cycle = self.coordinator.open(t, self.outer_steps, lambda healed: self._lane_fingerprint(common, healed),
                                      self._plan, self._accept)
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
                      f"the lighthouse again in {self.recheck_s:g} s")
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
        self._open = OpenCycle(cycle, keys, cycle.iteration + self.schedule.lag)
        if self.schedule.lag:  # (closed where it applies: tau later, or at the next sync under eager updates)
            return cycle, False, None
        return cycle, self._close_outer(), None

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
        """The channels over this cycle's participants: re-laid when they are not the ones
        the channels are laid for (their rows are per replica: a row each, in participating
        order), and only then; and this replica's row (its place among them). A discarded
        cycle leaves the channels laid for its participants (its error buffers restored), so
        the next cycle of the same replicas keeps them."""
        contributors = tuple(p.replica for p in cycle.participants)
        if contributors != self._laid_for:
            had_errors = self._holds_errors()
            were = len(self._laid_for)
            if self._lay(contributors) and had_errors:  # (fresh channels: their error buffers at zero)
                self._log(f"DiLoCo: {len(contributors)} replica(s) take part{f' (were {were})' if were else ''}: the "
                          f"outer exchange is re-laid for them, its error buffers start at zero")
        for _, channel, _, _ in self.channels.values():
            channel.rank = cycle.rank

    def _close_outer(self) -> bool:
        """Finish the open cycle's exchanges and close it: apply their means (as one world's
        step would) when it commits, else put the channels back as they were and keep the
        local parameters as they are. The decision is the same on every rank of this
        replica, so its optimizer step (the replica's own all-gather) runs on all of them or none."""
        cycle, keys, self._open = self._open.cycle, self._open.keys, None
        with self.coordinator.waiting:
            self.coordinator.phase = "outer"
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
            mine = cycle.mine(self.replica)
            self.coordinator.took_part += int(mine is not None and not mine.healed)
        else:
            for key in keys:
                self.pending.pop(key, None)
                channel, errors = self._snapshots[key]
                views, _, sub, frag = self.channels[key]
                channel.load_state_dict(errors)
                self.channels[key] = (views, channel, sub, frag)
            self._log(f"DiLoCo: the outer step was discarded ({self.coordinator.errored()}); the replicas train on "
                      f"and the next one goes on")
        for key in keys:
            self._snapshots.pop(key, None)
        return committed

    def _settled_mean_work(self, key: str) -> None:
        """Finish ``key``'s exchange (its mean then in :attr:`pending`)."""
        t, work = self.pending[key]
        if isinstance(work, OuterWork):
            work.wait()
            self._record(work)
            self.pending[key] = (t, work.delta)
