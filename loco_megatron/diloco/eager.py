"""Eager updates (--diloco-eager; Kale et al., arXiv 2502.12996): the outer exchange of an
interval runs during the next one, so no replica waits for the link at its sync.

Per channel (one sub-optimizer's shard of one fragment, fp32 ``[N]``) a replica ``m`` of
weight ``w`` in the mean (``1/R`` for ``R`` equal replicas) keeps, besides the agreed
parameters ``A`` and momentum ``M`` that every replica holds alike (:class:`~.outer.OuterStep`):

* ``own``, ``own_m``: its own outer parameters and momentum (where its interval started);
* ``sent``: its outer gradients that no committed mean holds yet, and ``sent_w``, the
  weight their eager share was applied with.

At the sync that ends interval ``k`` of the channel's fragment, in this order:

1. ``d = own - local``: the replica's fresh outer gradient (interval ``k``);
2. the exchange started at the previous sync (interval ``k - 1``, its payload ``sent``)
   is finished: its mean ``g`` (the same bits on every replica); none at the first sync,
   or where that exchange is not in flight (dropped at a resume: see below);
3. ``payload = d``, plus ``sent`` when no exchange of it was in flight (nothing is lost:
   it goes out again with this one);
4. ``A, M <- Nesterov(A, M, g)`` (when a mean arrived): the agreed parameters run one
   interval behind, and hold every replica's training up to interval ``k - 1``;
5. ``own, own_m <- Nesterov(own, own_m, e)`` with the eager outer gradient
   (:func:`~.outer_math.eager_gradient`) ``e = g - sent_w * sent + w * payload``: the
   replica's own share of the mean that has not arrived stands in for it, and its share
   of the mean that did (applied eagerly one sync ago) is taken back out. With a mean and
   nothing carried this is the paper's ``g_{k-1} + (d_k - d_{k-1}) / R``;
6. ``local <- own``, ``sent <- payload``, ``sent_w <- w``, and the exchange of
   ``payload`` starts; it runs its second phase half an interval later and is applied at
   the next sync (:class:`~.schedule.FragmentSchedule` with ``eager``).

Nesterov is linear in its state and gradient, so ``own - A`` is the response of the outer
optimizer to a sequence whose running sum is the replica's share of what it sent last
(``w * payload``): its eager part, which stays bounded and is the only thing the replicas
differ by right after a sync. ``--diloco-eager-naive`` (the control the paper compares
with) sets ``w = 0``: ``own`` is then ``A`` bit for bit, a one-interval-stale outer step.

The run's final outer step (:meth:`EagerOuterStep.finish`) applies the exchange in flight
to copies of ``A`` and ``M``, then exchanges what the replicas trained since their last
sync (``own - local``, nothing where that sync is the last step), so every replica ends on
the parameters that hold all of every replica's training.

A checkpoint settles first: the exchange in flight is finished (not applied) and its mean
saved with the replica's own state (``own``, ``own_m``, ``sent``, ``sent_w``, per rank);
the resumed run applies it at the same sync as one that never stopped. A resume that
cannot take the saved mean (another schedule or shards) carries ``sent`` into the next
exchange instead (step 3), so no interval is lost or applied twice.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from loco_megatron.diloco.outer import OuterStep
from loco_megatron.diloco.outer_math import eager_gradient, nesterov_step


@dataclasses.dataclass
class EagerState:
    """One channel's own part (the module docstring): fp32 ``[N]`` tensors on its device."""

    own: torch.Tensor
    own_momentum: Optional[torch.Tensor]
    """None with --diloco-outer-momentum 0."""
    sent: torch.Tensor
    sent_weight: float = 0.0

    @classmethod
    def fresh(cls, agreed: torch.Tensor, momentum: Optional[torch.Tensor]) -> EagerState:
        """No eager part: ``own`` the agreed parameters, ``own_m`` the momentum, nothing sent."""
        return cls(agreed.clone(), None if momentum is None else momentum.clone(), torch.zeros_like(agreed))

    def state_dict(self) -> dict:
        momentum = None if self.own_momentum is None else self.own_momentum.clone()
        return {"own": self.own.clone(), "own_momentum": momentum, "sent": self.sent.clone(),
                "sent_weight": self.sent_weight}

    def load_state_dict(self, sd: dict) -> None:
        """ValueError when ``sd`` does not fit (another size, or momentum where none is kept)."""
        if sd["own"].numel() != self.own.numel() or (sd["own_momentum"] is None) != (self.own_momentum is None):
            raise ValueError(f"{sd['own'].numel()} elements (momentum {sd['own_momentum'] is not None}) saved, "
                             f"{self.own.numel()} (momentum {self.own_momentum is not None}) now")
        self.own.copy_(sd["own"])
        self.sent.copy_(sd["sent"])
        if self.own_momentum is not None:
            self.own_momentum.copy_(sd["own_momentum"])
        self.sent_weight = float(sd["sent_weight"])


class EagerOuterStep(OuterStep):
    """:class:`~.outer.OuterStep` with eager updates (the module docstring); ``naive``: the
    one-interval-delayed control (``w = 0``). The schedule must be eager (``tau`` 0, alpha 0)."""

    def __init__(self, *args, naive: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.schedule.eager and not self.schedule.delay and self.alpha == 0.0, "an eager schedule, alpha 0"
        self.naive = naive
        self.eager = {key: EagerState.fresh(a, self.momentum[key]) for key, a in self.agreed.items()}

    # -- the per-step driver -------------------------------------------------------------------
    def after_step(self, t: int) -> None:
        """Everything the schedule puts after the inner step of iteration ``t``: second
        phases, then at a sync (inside megatron's optimizer step) the eager step of the
        fragments syncing there."""
        self._second_phases(t)
        starts = self.schedule.starts(t)
        if not starts:
            return

        def update(sub: int) -> None:
            for key in self._keys(starts, sub):
                self._send(key, t, self._eager_step(key, self._arrived(key)))

        self._run_step(update)
        self.outer_steps += 1

    def _weight(self, key: str) -> float:
        """This replica's weight in the mean of ``key``'s next exchange."""
        return 0.0 if self.naive else self.outer_scale / self.channels[key][1].mean_over

    def _arrived(self, key: str) -> Optional[torch.Tensor]:
        """The mean of ``key``'s exchange in flight, finished here (None: none in flight)."""
        if key not in self.pending:
            return None
        mean = self._settled_mean(key)
        del self.pending[key]
        return mean

    def _eager_step(self, key: str, mean: Optional[torch.Tensor]) -> torch.Tensor:
        """Steps 1-5 of the module docstring and ``local <- own``; returns the payload (a new
        tensor, this replica's outer gradient to send, unscaled). ``mean`` None: no exchange
        of ``sent`` arrived (none in flight), so ``sent`` goes out again with this one."""
        views = self.channels[key][0]
        state = self.eager[key]
        payload = torch.empty_like(state.own)
        views.outer_gradient(state.own, payload)  # own - local
        if mean is None:
            payload.add_(state.sent)  # (zeros at the first sync: exact)
        weight = self._weight(key)
        step = torch.empty_like(payload)
        eager_gradient(step, mean, state.sent, state.sent_weight, payload, weight)
        if mean is not None:  # (nesterov_step overwrites its gradient: after eager_gradient read it)
            nesterov_step(self.agreed[key], self.momentum[key], mean, self.lr, self.mu)
        nesterov_step(state.own, state.own_momentum, step, self.lr, self.mu)
        state.sent.copy_(payload)
        state.sent_weight = weight
        views.take(state.own, 0.0)
        return payload

    def _send(self, key: str, t: int, payload: torch.Tensor) -> None:
        """Start ``key``'s exchange of ``payload`` (which it overwrites with the mean)."""
        if self.outer_scale != 1.0:  # (1.0: not even a multiply, so equal shares stay bit for bit)
            payload.mul_(self.outer_scale)
        self.pending[key] = (t, self.channels[key][1].start(payload))

    # -- the end of a run ----------------------------------------------------------------------
    def finish(self, t: int) -> dict:
        """The run's final outer step into :attr:`final` (the module docstring), on copies:
        the resumable state (agreed, momentum, own state, the settled exchanges, the error
        buffers) stays as a checkpoint of this step holds it. Returns ``{"exchanged":
        fragments that took a final exchange, "in_flight": exchanges in flight applied}``."""
        synced = set(self.schedule.starts(t))
        self.final = {}
        self.settle()
        resumable = dict(self.pending)
        exchanged = set()
        for key, (views, _, _, f) in self.channels.items():
            agreed = self.agreed[key].clone()
            momentum = self.momentum[key].clone() if self.momentum[key] is not None else None
            if key in resumable:
                nesterov_step(agreed, momentum, self._settled_mean(key), self.lr, self.mu)
            state = self.eager[key]
            if f in synced and key in resumable:  # (local is own: nothing trained since that exchange)
                self.final[key] = agreed
                continue
            delta = torch.empty_like(agreed)
            views.outer_gradient(state.own, delta)  # own - local: trained since the last sync
            if key not in resumable:
                delta.add_(state.sent)  # (not in flight: it goes out with the final one)
            if self.outer_scale != 1.0:
                delta.mul_(self.outer_scale)
            self._final_step(key, t, agreed, momentum, delta)
            self.final[key] = agreed
            exchanged.add(f)
        self.pending = resumable
        return {"exchanged": sorted(exchanged), "in_flight": len(resumable)}

    # -- checkpointing -------------------------------------------------------------------------
    def per_rank_state_dict(self) -> dict:
        """:meth:`OuterStep.per_rank_state_dict` and, per channel, the replica's own state."""
        return {**super().per_rank_state_dict(), "eager": {key: s.state_dict() for key, s in self.eager.items()}}

    def _load_per_rank(self, sd: Optional[dict], schedule: list) -> list[str]:
        """:meth:`OuterStep._load_per_rank`, then each channel's own state where its shards
        are the saved ones; elsewhere it starts without an eager part (``own`` the agreed
        parameters). A saved payload whose exchange is not taken back in flight goes out
        with the next one (the module docstring)."""
        notes = super()._load_per_rank(sd, schedule)
        saved = (sd or {}).get("eager") or {}
        for key, (views, *_rest) in self.channels.items():
            self.eager[key] = EagerState.fresh(self.agreed[key], self.momentum[key])
            if key not in saved or sd["shards"].get(key) != views.signature():
                continue
            try:
                self.eager[key].load_state_dict(saved[key])
            except ValueError as e:
                notes.append(f"the eager outer state starts afresh ({e})")
        if sd is not None and not saved:
            notes.append("the eager outer state starts afresh (the checkpoint has none: saved without --diloco-eager)")
        return notes

    def _agree_on_loaded(self) -> None:
        super()._agree_on_loaded()
        self.eager = {key: EagerState.fresh(a, self.momentum[key]) for key, a in self.agreed.items()}
