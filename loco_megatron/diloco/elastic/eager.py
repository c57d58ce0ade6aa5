"""Eager updates in elastic DiLoCo (--diloco-eager with --diloco-lighthouse): the eager step
of :mod:`loco_megatron.diloco.eager` driven by torchft cycles, one fragment.

A cycle opened at a sync carries the exchange of that interval's payload and closes at the
next sync, ``H`` steps later, where its commit vote decides for every participant alike.
At each sync, in this order, the same on every rank of every replica:

1. the replica's fresh outer gradient, ``A + E - local`` (gathered from the lanes: the
   agreed parameters are those of the last commit);
2. the open cycle closes: committed, its mean steps the agreed parameters and momentum
   (nothing else: the error buffers, the outer step count and each fragment's last
   commit move with it, as today's); discarded, they stay as before it and the payload it
   carried goes out again with this sync's (the replica trained alone: its eager part
   stays, nothing of the failed mean is applied);
3. the eager part steps with the correction (its share of the payload applied ahead, its
   share of the committed one taken back out), the replica trains on from ``A + E``;
4. the next cycle opens; an outer step (:data:`~.cycle.OUTER`) sends the payload, weighted
   by the samples the replica trained as every outer gradient is. A heal or an agreement
   in it hands the replica the agreed parameters and momentum (the replica-state record):
   it has no eager part and nothing sent then, its training since replaced. No exchange
   is in flight there (2 closed it), so the record carries no pending state; a withheld
   step leaves the payload unsent, so it goes out with the next.

The replica's weight in the mean of the payload it sends is known only once the cycle that
sends it is planned: step 3 applies the share at the weight of its last exchange (at the
start, ``1 / --diloco-replicas``), and takes back exactly what it applied.

A checkpoint holds no exchange in flight (:mod:`.saved`): the agreed state of the last
commit, the error buffers as before the open cycle, and the replica's eager part and the
payload in flight; a resume sends that payload again with its next one.
"""

from __future__ import annotations

import time

import torch

from loco_megatron.diloco.eager import EagerSteps
from loco_megatron.diloco.elastic.step import ElasticOuterStep
from loco_megatron.diloco.outer_math import nesterov_step


class ElasticEagerStep(EagerSteps, ElasticOuterStep):
    """:class:`~.step.ElasticOuterStep` with eager updates (the module docstring); ``naive``:
    the one-interval-delayed control. One fragment, an eager schedule, alpha 0."""

    def __init__(self, *args, naive: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.schedule.eager and self.schedule.fragments == 1 and self.alpha == 0.0, "eager, F 1, alpha 0"
        self.naive = naive
        self._fresh_eager()
        self._outgoing: dict[str, torch.Tensor] = {}
        """The payloads this sync's cycle sends (step 4)."""
        self._landed: set[str] = set()
        """Channels whose last cycle committed at this sync (their payload is in the mean)."""
        self._sent_weight = {key: 1.0 / self.rules.expected for key in self.channels}
        """Per channel, this replica's weight in the mean of its last exchange."""

    def _weight(self, key: str) -> float:
        return 0.0 if self.naive else self._sent_weight[key]

    def after_step(self, t: int) -> None:
        """Second phases; at a sync, steps 1-4 of the module docstring."""
        self._second_phases(t)
        keys = self._keys(self.schedule.starts(t))
        if not keys:
            return
        start = time.perf_counter()
        fresh = {key: self._payload(key, True) for key in keys}
        self._landed = set()
        if self._open is not None and self._open.closes_at == t:
            self._close_outer()
        for key in keys:  # (scattered before megatron's step: see ReplicaStep._take_all)
            payload = fresh[key]
            if key not in self._landed:
                payload.add_(self.eager[key].sent)
            self._eager_step(key, payload, self._weight(key))
            self._outgoing[key] = payload
        self._run_step(lambda sub: None)
        self._cycle(t, joining=False)
        self._outgoing = {}
        waited = time.perf_counter() - start
        self._waited_s += waited
        self.waited_total_s += waited

    def _close_outer(self) -> bool:
        """As :meth:`ElasticOuterStep._close_outer`; a commit steps the agreed state only
        (:meth:`_apply`) and marks the fragments' last commit at the cycle's own iteration
        (their training up to it is in the agreed parameters)."""
        cycle, keys = self._open.cycle, list(self._open.keys)
        committed = super()._close_outer()
        if committed:
            self._landed |= set(keys)
            for f in self._fragments(keys):
                self._synced_at[f] = cycle.iteration
        return committed

    def _apply(self, key: str) -> None:
        """A committed mean steps the agreed parameters and momentum (the replica's own step
        follows at the sync: :meth:`after_step`)."""
        mean = self._settled_mean(key)
        del self.pending[key]
        nesterov_step(self.agreed[key], self.momentum[key], mean, self.lr, self.mu)

    def _start(self, key: str, t: int, zeros: bool = False) -> None:
        """Send ``key``'s payload in the cycle planned now (a healed replica sends zeros); a
        replica that joins at par takes its eager step here, with what it never sent."""
        views, channel, _, _ = self.channels[key]
        self._sent_weight[key] = self.outer_scale / channel.mean_over
        if zeros:
            return super()._start(key, t, zeros=True)
        payload = self._outgoing.pop(key, None)
        if payload is None:  # (joining: no sync step ran; local moves, megatron's step follows in join)
            payload = self._payload(key, False)
            self._eager_step(key, payload, self._weight(key))
            self._joined_step = True
        if self.outer_scale != 1.0:
            payload = payload * self.outer_scale
        self.pending[key] = (t, channel.start(payload))

    def join(self, t: int) -> None:
        self._joined_step = False
        super().join(t)
        if self._joined_step:
            self._run_step(lambda sub: None)

    def _restart_outer(self, outer_steps: int, healed: bool = False) -> None:
        """A heal or an agreement: no eager part, nothing sent or to send."""
        super()._restart_outer(outer_steps, healed)
        self._fresh_eager()
        self._outgoing, self._landed = {}, set()

    # -- the end of a run ----------------------------------------------------------------------
    def finish(self, t: int, exchange: bool = True) -> dict:
        """:meth:`~.final.EndOfRun.finish`, whose final outer step exchanges what the replica
        trained since its last sync and every payload no committed mean holds."""
        self._final_fresh = {key: self._payload(key, True) for key in self.channels}
        self._landed = set()
        try:
            return super().finish(t, exchange)
        finally:
            self._final_fresh = {}

    def _final_delta(self, key: str, out) -> None:
        out.copy_(self._final_fresh[key])
        if key not in self._landed:
            out.add_(self.eager[key].sent)

    def _agree_on_loaded(self) -> None:
        super()._agree_on_loaded()
        self._outgoing, self._landed = {}, set()
