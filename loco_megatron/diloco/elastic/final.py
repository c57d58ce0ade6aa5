"""The end of an elastic replica's run: the exchange in flight closed, then the run's final
outer step (:meth:`EndOfRun.finish`), which every replica opens and whose fragments the
most advanced one decides for all, into the model every replica ends on."""

from __future__ import annotations

import torch

from loco_megatron.diloco.elastic import split as batch_split
from loco_megatron.diloco.elastic.cycle import OUTER, REFUSE, WITHHELD
from loco_megatron.diloco.exchange import OuterWork
from loco_megatron.diloco.outer_math import nesterov_step


class EndOfRun:
    """A mixin of :class:`~.step.ElasticOuterStep` (its cycles, coordinator and channels)."""

    def finish(self, t: int, exchange: bool = True) -> dict:
        """The last step ``t``: the cycle in flight is closed; then, when ``exchange`` (the
        run reached --train-iters, where every live replica ends), one more cycle over every
        fragment not just synced, whose mean gives :attr:`final` on copies (the checkpoint
        keeps the state before it). Without ``exchange`` (this replica stops alone: the
        others train on) :attr:`final` is the agreed parameters. No final model
        (:attr:`final` None, :attr:`unfinished` says why) when the final outer step is
        withheld (fewer live replicas than --diloco-min-replicas) or no outer step ever
        committed (the agreed parameters would be the initial weights)."""
        in_flight = list(self._open.keys) if self._open is not None else []
        if in_flight:
            self._close_outer()
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
        returns the fragments exchanged ([]: none committed). Every replica opens it, and
        which fragments it exchanges is one decision for all (:attr:`.cycle.Cycle.synced`):
        a replica that missed the commit at ``t`` would otherwise exchange another set than
        the others and end on another model."""
        if self._ended_without_this_replica(False):
            return []
        due = set(self.schedule.applies(t) if self.schedule.delay else self.schedule.starts(t))
        synced = self.alpha == 0.0 and bool(due) and all(self._synced_at.get(f) == t for f in due)
        common = self._common(t, False, False)
        common.synced = synced
        mine = [k for k, (_, _, _, f) in self.channels.items() if not (synced and f in due)]
        common.trained = max((self.samples_trained - self._since[self.channels[k][3]] for k in mine), default=0)
        with self.coordinator.waiting:
            return self._final_exchange(t, due, common)

    def _final_exchange(self, t: int, due: set, common) -> list[int]:
        """:meth:`_final_cycle` from its cycle on."""
        cycle = self.coordinator.open(t, self.outer_steps, lambda healed: self._lane_fingerprint(common, healed),
                                      self._plan, self._accept)
        if cycle is not None and cycle.action == REFUSE:
            self.coordinator.close(False, refused=True)
            return []
        if cycle is not None and cycle.healed is not None:
            self._heal(cycle)  # (behind at the very end: it sends zeros and ends on the run's final model)
            self.final = {key: a.clone() for key, a in self.agreed.items()}
        keys = [k for k, (_, _, _, f) in self.channels.items() if not (cycle is not None and cycle.synced and f in due)]
        if cycle is not None and cycle.action == OUTER and not keys:  # (every fragment final already, for all)
            self.coordinator.close(True)
            return []
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
            channel = self.channels[key][1]
            errors = channel.state_dict()
            delta = torch.zeros_like(self.agreed[key])
            if not zeros:
                self._final_delta(key, delta)
            if scale != 1.0:
                delta.mul_(scale)
            channel.mean_over = max(cycle.contributors, 1)
            if hasattr(channel, "weight"):  # (SparseLoCo's payload carries it: ReplicaStep._start)
                channel.weight = scale
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

    def _final_delta(self, key: str, out) -> None:
        """``out`` <- what this replica trained that no committed outer step holds:
        ``agreed - local`` (a collective over the replica where the views are lanes)."""
        self.channels[key][0].outer_gradient(self.agreed[key], out)

    def take_final(self) -> None:
        """Every replica takes :attr:`final` (see :meth:`OuterStep.take_final`), scattered
        from the lanes (nothing when the run has no final model: it keeps its own)."""
        if self.final is not None:
            self._take_all(self.final)
