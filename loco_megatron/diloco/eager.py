"""Eager updates (--diloco-eager; Kale et al., arXiv 2502.12996): the outer exchange of an
interval runs during the next one, so no replica waits for the link at its sync.

Per channel (one sub-optimizer's shard of one fragment, fp32 ``[N]``) a replica of weight
``w`` in the mean (``1/R`` for ``R`` equal replicas) keeps, besides the agreed parameters
``A`` and momentum ``M`` that every replica holds alike (:class:`~.outer.OuterStep`):

* ``E``, ``E_m``: its *eager part*, the offset of its own outer parameters from the agreed
  ones (``own = A + E``: where its interval started) and of its own outer momentum;
* ``sent``: its outer gradients that no committed mean holds yet, and ``sent_w``, the
  weight their share was applied ahead with.

At the sync that ends interval ``k`` of the channel's fragment, in this order:

1. ``payload = (A + E) - local``: the replica's fresh outer gradient (interval ``k``), plus
   ``sent`` when no exchange of it arrived (none in flight: the first sync, a resume that
   could not take the saved exchange, an elastic cycle discarded): it goes out again;
2. ``A, M <- Nesterov(A, M, g)`` with the mean ``g`` of the exchange started at the
   previous sync, when it arrived (the same bits on every replica): the agreed parameters
   run one interval behind and hold every replica's training up to interval ``k - 1``;
3. ``E, E_m <- Nesterov(E, E_m, c)`` with the eager correction
   (:func:`~.outer_math.eager_correction`) ``c = w * payload - sent_w * sent``: the
   replica's share of the mean still on the wire is applied ahead, and its share of the
   mean that arrived (applied ahead one sync ago) is taken back out;
4. ``local <- A + E``, ``sent <- payload``, ``sent_w <- w``; the exchange of ``payload``
   starts, runs its second phase half an interval later and is applied at the next sync
   (:class:`~.schedule.FragmentSchedule` with ``eager``).

Nesterov SGD is linear in its state and gradient, so ``own`` follows the paper's update,
``own, own_m <- Nesterov(own, own_m, g + c)`` = ``g_{k-1} + (d_k - d_{k-1}) / R``, up to
rounding, and ``E`` is the outer optimizer's response to inputs whose running sum is
``w * sent``: bounded, and the only thing the replicas differ by right after a sync. Where
no mean arrives, ``A`` and ``M`` stay as they are (nothing of it, not even its momentum,
is applied) and the replica's own share stays in ``E``. ``--diloco-eager-naive`` (the
paper's control) sets ``w = 0``: ``E`` stays zero, every replica on ``A`` bit for bit.

The run's final outer step (:meth:`EagerOuterStep.finish`) applies the exchange in flight
to copies of ``A`` and ``M``, then exchanges what the replicas trained since their last
sync (``A + E - local``, nothing where that sync is the last step), so every replica ends
on the parameters that hold all of every replica's training.

A checkpoint settles first: the exchange in flight is finished (not applied) and its mean
saved with the replica's own state (``E``, ``E_m``, ``sent``, ``sent_w``, per rank); the
resumed run applies it at the same sync as one that never stopped.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from loco_megatron.diloco.outer import OuterStep
from loco_megatron.diloco.outer_math import eager_correction, nesterov_step


@dataclasses.dataclass
class EagerState:
    """One channel's own part (the module docstring): fp32 ``[N]`` tensors on its device."""

    offset: torch.Tensor
    """``E``: this replica's outer parameters minus the agreed ones."""
    offset_momentum: Optional[torch.Tensor]
    """``E_m`` (None with --diloco-outer-momentum 0)."""
    sent: torch.Tensor
    sent_weight: float = 0.0

    @classmethod
    def fresh(cls, agreed: torch.Tensor, momentum: bool) -> EagerState:
        """No eager part, nothing sent (the replica's own parameters are the agreed ones)."""
        return cls(torch.zeros_like(agreed), torch.zeros_like(agreed) if momentum else None, torch.zeros_like(agreed))

    def own(self, agreed: torch.Tensor) -> torch.Tensor:
        """A new tensor: ``agreed + E``, the replica's own outer parameters."""
        return torch.add(agreed, self.offset)

    def state_dict(self) -> dict:
        momentum = None if self.offset_momentum is None else self.offset_momentum.clone()
        return {"offset": self.offset.clone(), "offset_momentum": momentum, "sent": self.sent.clone(),
                "sent_weight": self.sent_weight}

    def load_state_dict(self, sd: dict) -> None:
        """ValueError when ``sd`` does not fit (another size, or momentum where none is kept)."""
        mom = sd["offset_momentum"]
        if sd["offset"].numel() != self.offset.numel() or (mom is None) != (self.offset_momentum is None):
            raise ValueError(f"{sd['offset'].numel()} elements (momentum {mom is not None}) saved, "
                             f"{self.offset.numel()} (momentum {self.offset_momentum is not None}) now")
        self.offset.copy_(sd["offset"])
        self.sent.copy_(sd["sent"])
        if self.offset_momentum is not None:
            self.offset_momentum.copy_(mom)
        self.sent_weight = float(sd["sent_weight"])


class EagerSteps:
    """The eager step over :class:`~.outer.OuterStep`'s channels and agreed state (a mixin:
    one world's :class:`EagerOuterStep` and elastic DiLoCo's eager step share it)."""

    def _fresh_eager(self) -> None:
        """Every channel without an eager part (its own parameters the agreed ones), nothing sent."""
        self.eager = {key: EagerState.fresh(a, self.momentum[key] is not None) for key, a in self.agreed.items()}

    def _weight(self, key: str) -> float:
        """This replica's weight in the mean of ``key``'s next exchange (0: the naive control)."""
        return 0.0 if self.naive else self.outer_scale / self.channels[key][1].mean_over

    def _payload(self, key: str, arrived: bool) -> torch.Tensor:
        """Step 1 of the module docstring: a new tensor, ``A + E - local`` plus ``sent`` when
        no exchange of it ``arrived`` (a collective over the replica where the views are lanes)."""
        state = self.eager[key]
        payload = torch.empty_like(state.offset)
        # (not in place: a lane's gather writes its output before it reads the first argument)
        self.channels[key][0].outer_gradient(state.own(self.agreed[key]), payload)  # own - local
        if not arrived:
            payload.add_(state.sent)  # (zeros at the first sync: exact)
        return payload

    def _eager_step(self, key: str, payload: torch.Tensor, weight: float) -> None:
        """Steps 3 and 4 of the module docstring (the agreed parameters took step 2 already):
        the eager part steps, ``local <- A + E``, ``payload`` becomes ``sent``."""
        state = self.eager[key]
        correction = torch.empty_like(payload)
        eager_correction(correction, state.sent, state.sent_weight, payload, weight)
        nesterov_step(state.offset, state.offset_momentum, correction, self.lr, self.mu)
        state.sent.copy_(payload)
        state.sent_weight = weight
        self.channels[key][0].take(state.own(self.agreed[key]), 0.0)

    # -- checkpointing -------------------------------------------------------------------------
    def per_rank_state_dict(self) -> dict:
        """The outer step's per-rank part and, per channel, the replica's own state."""
        return {**super().per_rank_state_dict(), "eager": {key: s.state_dict() for key, s in self.eager.items()}}

    def _load_per_rank(self, sd: Optional[dict], schedule: list) -> list[str]:
        """The outer step's per-rank part, then each channel's own state where its shards
        are the saved ones; elsewhere it starts without an eager part. A saved payload whose
        exchange is not taken back in flight goes out with the next one (step 1)."""
        notes = super()._load_per_rank(sd, schedule)
        saved = (sd or {}).get("eager") or {}
        self._fresh_eager()
        for key, (views, *_rest) in self.channels.items():
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
        self._fresh_eager()


class EagerOuterStep(EagerSteps, OuterStep):
    """:class:`~.outer.OuterStep` with eager updates (the module docstring) in one world;
    ``naive``: the one-interval-delayed control (``w = 0``). The schedule must be eager
    (``tau`` 0, alpha 0)."""

    def __init__(self, *args, naive: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.schedule.eager and not self.schedule.delay and self.alpha == 0.0, "an eager schedule, alpha 0"
        self.naive = naive
        self._fresh_eager()

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
                arrived = key in self.pending
                payload = self._payload(key, arrived)
                if arrived:
                    mean = self._settled_mean(key)
                    del self.pending[key]
                    nesterov_step(self.agreed[key], self.momentum[key], mean, self.lr, self.mu)
                self._eager_step(key, payload, self._weight(key))
                self._send(key, t, payload)

        self._run_step(update)
        self.outer_steps += 1

    def _send(self, key: str, t: int, payload: torch.Tensor) -> None:
        """Start ``key``'s exchange of ``payload`` (which it overwrites with the mean)."""
        if self.outer_scale != 1.0:  # (1.0: not even a multiply, so equal shares stay bit for bit)
            payload = payload * self.outer_scale
        self.pending[key] = (t, self.channels[key][1].start(payload))

    # -- the end of a run ----------------------------------------------------------------------
    def finish(self, t: int) -> dict:
        """The run's final outer step into :attr:`final` (the module docstring), on copies:
        the resumable state (agreed, momentum, eager parts, the settled exchanges, the error
        buffers) stays as a checkpoint of this step holds it. Returns ``{"exchanged":
        fragments that took a final exchange, "in_flight": exchanges in flight applied}``."""
        synced = set(self.schedule.starts(t))
        self.final = {}
        self.settle()
        resumable = dict(self.pending)
        exchanged = set()
        for key, (_, _, _, f) in self.channels.items():
            in_flight = key in resumable
            if f in synced and in_flight:  # (local is A + E: nothing trained since that exchange)
                delta = None
            else:
                delta = self._payload(key, in_flight)  # trained since the last sync (and what never went out)
            agreed = self.agreed[key].clone()
            momentum = self.momentum[key].clone() if self.momentum[key] is not None else None
            if in_flight:
                nesterov_step(agreed, momentum, self._settled_mean(key), self.lr, self.mu)
            if delta is not None:
                if self.outer_scale != 1.0:
                    delta.mul_(self.outer_scale)
                self._final_step(key, t, agreed, momentum, delta)
                exchanged.add(f)
            self.final[key] = agreed
        self.pending = resumable
        return {"exchanged": sorted(exchanged), "in_flight": len(resumable)}
