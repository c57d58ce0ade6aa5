"""The outer step's state and per-step driver (see :mod:`loco_megatron.diloco`).

:class:`OuterStep` keeps, per channel (one sub-optimizer's shard of one fragment, fp32
``[N]``): the agreed parameters, the outer momentum, the two error buffers of its
:class:`~.exchange.OuterChannel` and an exchange possibly in flight. The trainer calls
:meth:`OuterStep.after_step` after every inner step; at the iterations the
:class:`~.schedule.FragmentSchedule` names it runs, in this order and the same on every
rank: the second phase of exchanges started one step earlier (``tau >= 2``), then, inside
megatron's optimizer step (``run_step``, :func:`loco_megatron.loco.hooks.diloco.run_in_optimizer_step`),
per sub-optimizer: the exchanges due to be applied, then the ones due to start (with
``tau = 0`` started, finished and applied at once).

A mean that is not finite (a replica's parameters overflowed) is replaced by zero on the
device (no host sync): the agreed parameters then move by momentum only and no NaN
reaches another replica; :attr:`nonfinite` counts such channels for the metrics.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from loco_megatron.diloco.exchange import OuterWork
from loco_megatron.diloco.outer_math import mix_into, nesterov_step, outer_gradient
from loco_megatron.diloco.schedule import FragmentSchedule, describe_schedule


class ShardViews:
    """One channel's parameters: the 1-D fp32 main views of a sub-optimizer's shards that
    belong to one fragment, laid end to end as a flat ``[numel]`` shard. ``slices``
    (optional, for checkpoints in model space): per view, ``(model param, start, end)``,
    the elements of the flattened local parameter it holds."""

    def __init__(self, views: list[torch.Tensor], slices: Optional[list[tuple]] = None):
        self.views, self.slices = views, slices
        self.device = views[0].device if views else torch.device("cpu")
        self.offsets = []
        at = 0
        for v in views:
            self.offsets.append(at)
            at += v.numel()
        self.numel = at

    def _pairs(self, flat: torch.Tensor):
        for v, o in zip(self.views, self.offsets):
            yield v, flat[o:o + v.numel()]

    def read(self, out: torch.Tensor) -> None:
        """``out`` <- the local (main) parameters."""
        for v, part in self._pairs(out):
            part.copy_(v)

    def outer_gradient(self, agreed: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` <- agreed - local."""
        for (v, a), (_, o) in zip(self._pairs(agreed), self._pairs(out)):
            outer_gradient(a, v, o)

    def signature(self) -> list:
        """Which elements of which parameters the views hold (a per-rank checkpoint fits only
        the same): per view its ``(parameter shape, start, end)``, or its size without ``slices``."""
        if self.slices is None:
            return [v.numel() for v in self.views]
        return [(tuple(p.shape), start, end) for p, start, end in self.slices]

    def take(self, agreed: torch.Tensor, alpha: float) -> None:
        """local <- alpha * local + (1 - alpha) * agreed (see :func:`.outer_math.mix_into`)."""
        for v, part in self._pairs(agreed):
            mix_into(v, part, alpha)


class OuterStep:
    """DiLoCo's outer optimizer over this rank's channels.

    ``channels``: key -> (:class:`ShardViews`, :class:`~.exchange.OuterChannel`, sub-optimizer
    index, fragment index), in the order every rank of an outer group builds them.
    ``run_step(update)``: runs ``update(sub_optimizer_index)`` inside megatron's optimizer
    step (every rank, same iterations). ``record(work)``: the exchange's figures for the
    metrics (its time and bytes), once it completed, which is where its mean is applied
    (or kept for a checkpoint, or for the final model); ``every_step()`` is called after
    every step (the metrics' every-step reference). ``log``: one line (rank 0 prints)."""

    def __init__(self, channels: dict, schedule: FragmentSchedule, lr: float, momentum: float, alpha: float,
                 run_step: Callable[[Callable[[int], None]], None], record: Callable[[OuterWork], None],
                 every_step: Callable[[], None], log: Callable[[str], None]):
        self.channels, self.schedule = channels, schedule
        self.lr, self.mu, self.alpha = lr, momentum, alpha
        self._run_step, self._record, self._log = run_step, record, log
        self._every_step = every_step
        self.agreed = {key: torch.empty(views.numel, dtype=torch.float32, device=views.device)
                       for key, (views, *_rest) in channels.items()}
        for key, (views, *_rest) in channels.items():
            views.read(self.agreed[key])  # every replica starts from the same (seeded) weights
        self.momentum = {key: torch.zeros_like(a) if momentum else None for key, a in self.agreed.items()}
        self.pending: dict[str, tuple[int, OuterWork | torch.Tensor]] = {}
        """key -> (start iteration, the exchange in flight, or its mean once settled or loaded)."""
        self.nonfinite = torch.zeros((), dtype=torch.float32,
                                     device=next(iter(self.agreed.values())).device if self.agreed else "cpu")
        """Channels whose mean was not finite (zeroed), since the last :meth:`take_nonfinite`."""
        self.outer_steps = 0
        """Outer updates applied (all channels of one iteration count once)."""
        self.final: Optional[dict[str, torch.Tensor]] = None
        """After :meth:`finish`: per channel, the agreed parameters after the run's final
        outer step (fp32 ``[N]``), which a checkpoint writes as ``diloco.final``."""
        self.outer_scale = 1.0
        """The factor this replica's outer gradients are sent with (elastic DiLoCo's
        samples-weighted mean, :func:`.batch_split.mean_factors`; 1 in one world)."""

    def count_step(self, seconds: float) -> None:
        """One inner step took ``seconds`` (elastic DiLoCo measures its speed; here: nothing)."""

    # -- the per-step driver -------------------------------------------------------------
    def _keys(self, fragments: list[int], sub: Optional[int] = None) -> list[str]:
        return [k for k, (_, _, s, f) in self.channels.items() if f in fragments and (sub is None or s == sub)]

    def steps_at(self, t: int) -> bool:
        """Whether iteration ``t`` applies an outer step (the schedule alone decides)."""
        return bool(self.schedule.updates(t))

    def _second_phases(self, t: int) -> None:
        """After every step: the metrics' every-step reference, and the second phase of the
        exchanges started :attr:`~.schedule.FragmentSchedule.phase_gap` steps earlier
        (``tau >= 2``, eager)."""
        self._every_step()
        if self.schedule.split_phases:
            for key in self._keys(self.schedule.second_phase(t)):
                work = self.pending.get(key, (t, None))[1]
                if isinstance(work, OuterWork):
                    work.second_phase()

    def after_step(self, t: int) -> None:
        """Everything the schedule puts after the inner step of iteration ``t``."""
        sched = self.schedule
        self._second_phases(t)
        applies = sched.applies(t) if sched.delay else []
        starts = sched.starts(t)
        if not (applies or starts):
            return

        def update(sub: int) -> None:
            # (An exchange dropped at a resume, see load_state_dict, has nothing to apply;
            # the optimizer step still runs where the schedule puts it, on every rank.)
            for key in self._keys(applies, sub):
                if key in self.pending:
                    self._apply(key)
            for key in self._keys(starts, sub):
                self._start(key, t)
                if not sched.delay:
                    self._apply(key)

        self._run_step(update)
        self.outer_steps += bool(applies or not sched.delay)

    def _start(self, key: str, t: int) -> None:
        views, channel, _, _ = self.channels[key]
        delta = torch.empty(views.numel, dtype=torch.float32, device=self.agreed[key].device)
        views.outer_gradient(self.agreed[key], delta)
        if self.outer_scale != 1.0:  # (1.0: not even a multiply, so equal shares stay bit for bit)
            delta.mul_(self.outer_scale)
        self.pending[key] = (t, channel.start(delta))

    def _apply(self, key: str) -> None:
        mean = self._settled_mean(key)
        del self.pending[key]
        nesterov_step(self.agreed[key], self.momentum[key], mean, self.lr, self.mu)
        self.channels[key][0].take(self.agreed[key], self.alpha)

    def settle(self) -> None:
        """Finish every exchange in flight (both phases; not applied): before a checkpoint,
        so the saved state holds their means. Every rank calls it at the same iteration."""
        for key, (t, work) in list(self.pending.items()):
            if isinstance(work, OuterWork):
                work.wait()
                self._record(work)
                self.pending[key] = (t, work.delta)

    # -- the end of a run ----------------------------------------------------------------
    def finish(self, t: int) -> dict:
        """The last step ``t`` of a run (every rank, the same step; collective over the
        outer groups): the agreed parameters every replica ends on, into :attr:`final`,
        leaving the resumable state (agreed, momentum, local parameters, exchanges in
        flight, the error buffers) untouched, so a run resumed from this step's checkpoint
        continues exactly as one that never stopped.

        Per channel, on copies of the agreed parameters and the momentum: an exchange in
        flight is finished and applied (as at its apply step, the local parameters mixed
        with alpha), then a final outer step over what the replicas trained since their
        last sync, ``delta = agreed' - local'`` (exchanged as every outer gradient, error
        buffers and all). A fragment that synced at ``t`` itself with alpha 0 (its local
        parameters are the agreed ones, bit for bit) takes none. Channels one at a time:
        the scratch is one channel's three fp32 copies and its error buffers. Returns ``{"exchanged": fragments
        that took a final exchange, "in_flight": exchanges in flight applied}``."""
        sched = self.schedule
        synced = set(sched.updates(t)) if self.alpha == 0.0 else set()
        self.final = {}
        self.settle()
        resumable = dict(self.pending)  # the settled means a checkpoint of this step keeps
        exchanged = set()
        for key, (views, channel, _, f) in self.channels.items():
            agreed = self.agreed[key].clone()
            in_flight = key in resumable
            if f in synced and not in_flight:
                self.final[key] = agreed
                continue
            momentum = self.momentum[key].clone() if self.momentum[key] is not None else None
            if in_flight:
                nesterov_step(agreed, momentum, self._settled_mean(key), self.lr, self.mu)
            delta = torch.empty_like(agreed)
            views.outer_gradient(agreed, delta)  # agreed' - local
            if in_flight:  # local' = alpha local + (1 - alpha) agreed'  =>  agreed' - local' = alpha (agreed' - local)
                delta.mul_(self.alpha)
            self._final_step(key, t, agreed, momentum, delta)
            self.final[key] = agreed
            exchanged.add(f)
        self.pending = resumable
        return {"exchanged": sorted(exchanged), "in_flight": len(resumable)}

    def _final_step(self, key: str, t: int, agreed: torch.Tensor, momentum: Optional[torch.Tensor],
                    delta: torch.Tensor) -> None:
        """The final exchange of ``delta`` (overwritten) over ``key``'s channel and its outer
        step on ``agreed`` and ``momentum`` (copies); :attr:`pending` holds its mean after."""
        channel = self.channels[key][1]
        # The exchange compensates with the error buffers and updates them; a resume
        # must find them as they were (a run that never stopped has no such exchange).
        errors = channel.state_dict()
        self.pending[key] = (t, channel.start(delta))
        nesterov_step(agreed, momentum, self._settled_mean(key), self.lr, self.mu)
        channel.load_state_dict(errors)

    def _settled_mean(self, key: str) -> torch.Tensor:
        """A new tensor: the mean of ``key``'s exchange in flight (finished here if it is
        not yet; :attr:`pending` then holds its mean, as after :meth:`settle`), zero where
        not finite (counted in :attr:`nonfinite`): the agreed parameters then move by
        momentum only and no NaN reaches another replica."""
        t, work = self.pending[key]
        if isinstance(work, OuterWork):
            work.wait()
            self._record(work)
            mean, finite = work.delta, work.finite
            self.pending[key] = (t, mean)
        else:  # settled before a checkpoint, or loaded from one
            mean, finite = work, torch.isfinite(work).all()
        self.nonfinite += (~finite).float()
        return torch.where(finite, mean, torch.zeros((), device=mean.device))

    def take_final(self) -> None:
        """Every replica takes :attr:`final` as its parameters (after the checkpoint, which
        keeps the local ones, was written): a megatron optimizer step, so the model's
        weights and every rank of the replica get them."""
        assert self.final is not None, "finish() first"

        def update(sub: int) -> None:
            for key, (views, _, s, _) in self.channels.items():
                if s == sub:
                    views.take(self.final[key], 0.0)

        self._run_step(update)

    def take_nonfinite(self) -> torch.Tensor:
        out, self.nonfinite = self.nonfinite, torch.zeros_like(self.nonfinite)
        return out

    # -- checkpointing -------------------------------------------------------------------
    # Two parts: the agreed parameters and the momentum, the same on every replica (a
    # reshardable checkpoint writes them in model space: loco_megatron.checkpoint.diloco),
    # and this rank's own, which fits its shards only: the error buffers and the settled
    # means of the exchanges in flight.
    def common_state(self) -> dict:
        """What every rank holds alike besides the agreed parameters and the momentum."""
        return {"schedule": self.schedule.as_list(),
                "outer_steps": self.outer_steps, "with_momentum": bool(self.mu)}

    def per_rank_state_dict(self) -> dict:
        """This rank's own part: per channel its shards (:meth:`ShardViews.signature`), the
        exchange's error buffers, and the settled mean of an exchange in flight."""
        assert all(not isinstance(w, OuterWork) for _, w in self.pending.values()), "settle() before saving"
        return {"shards": {key: views.signature() for key, (views, *_rest) in self.channels.items()},
                "exchange": {key: ch.state_dict() for key, (_, ch, _, _) in self.channels.items()},
                "pending": {key: {"start": t, "mean": mean.clone()} for key, (t, mean) in self.pending.items()}}

    def state_dict(self) -> dict:
        """Everything, per rank (--ckpt-format torch): :meth:`common_state`, ``agreed`` and
        ``momentum`` (channel key -> fp32 ``[N]``; momentum None with --diloco-outer-momentum
        0), ``per_rank`` (:meth:`per_rank_state_dict`) and, at the end of a run, ``final``
        (:attr:`final`, for exports; a resume does not read it)."""
        return {**self.common_state(), "agreed": {key: a.clone() for key, a in self.agreed.items()},
                "momentum": {key: m.clone() for key, m in self.momentum.items()} if self.mu else None,
                "per_rank": self.per_rank_state_dict(),
                **({"final": {key: a.clone() for key, a in self.final.items()}} if self.final is not None else {})}

    def load_state_dict(self, sd: Optional[dict]) -> None:
        """Restore :meth:`state_dict`'s dict. ``None`` (the checkpoint holds no outer state:
        written without --diloco-replicas): the outer step starts afresh from the loaded
        model; ``per_rank`` None (written under another layout): the error buffers start at
        zero and nothing is in flight (the caller says so, in its one line). What else does
        not fit this run starts afresh, one line saying what and why: other channels
        (the torch format under another --diloco-fragments) -> everything; no saved momentum
        -> the momentum; other shards or outer width -> the error buffers and exchanges in
        flight; another schedule -> the exchanges in flight."""
        if sd is None:
            return self._agree_on_loaded()
        agreed = sd["agreed"]
        if set(agreed) != set(self.channels) or any(agreed[k].numel() != a.numel() for k, a in self.agreed.items()):
            self._agree_on_loaded()
            return self._log("DiLoCo: the checkpoint's outer state does not fit this run (other fragments or "
                             "shards); the outer step starts afresh from the first replica's loaded parameters")
        self.outer_steps = int(sd.get("outer_steps", 0))
        notes = []
        for key, a in self.agreed.items():
            a.copy_(agreed[key])
            if self.momentum[key] is not None:
                if sd["momentum"] is None:
                    self.momentum[key].zero_()
                    notes.append("the outer momentum starts at zero (saved without momentum)")
                else:
                    self.momentum[key].copy_(sd["momentum"][key])
        saved, now = list(sd["schedule"]), self.schedule.as_list()
        if saved != now:
            notes.append(f"the outer schedule changes from {describe_schedule(saved)} (checkpoint) to "
                         f"{describe_schedule(now)}: each fragment's next outer step follows the new one")
        notes += self._load_per_rank(sd["per_rank"], saved)
        if notes:  # one line, whatever starts afresh
            self._log(f"DiLoCo: {'; '.join(dict.fromkeys(notes))}")

    def _load_per_rank(self, sd: Optional[dict], schedule: list) -> list[str]:
        """Restore each channel's error buffers and exchange in flight where the channel's
        shards are the saved ones; returns the notes on what starts afresh."""
        for _, channel, _, _ in self.channels.values():
            channel.reset()
        self.pending = {}
        if sd is None:
            return []
        notes, fits = [], set()
        for key, (views, channel, _, _) in self.channels.items():
            if sd["shards"].get(key) != views.signature():
                if channel.comp1 is not None:
                    notes.append("the outer error buffers start at zero (this rank's shards of the model changed)")
                continue
            fits.add(key)
            try:
                channel.load_state_dict(sd["exchange"][key])
            except ValueError as e:
                channel.reset()
                notes.append(f"the outer error buffers start at zero ({e})")
        if schedule != self.schedule.as_list() and sd["pending"]:
            notes.append(f"the {len(sd['pending'])} outer exchange(s) in flight are dropped")
        elif set(sd["pending"]) - fits:
            notes.append("the outer exchanges in flight are dropped (this rank's shards of the model changed)")
        else:
            self.pending = {key: (int(p["start"]), p["mean"].to(self.agreed[key].device))
                            for key, p in sd["pending"].items()}
        return notes

    def _agree_on_loaded(self) -> None:
        """Outer state afresh from the loaded model: the agreed parameters are the first
        replica's loaded ones (broadcast over each outer group, so the replicas agree even
        when their loaded weights differ), momentum and errors zero, nothing in flight."""
        import torch.distributed as dist

        for key, (views, channel, _, _) in self.channels.items():
            views.read(self.agreed[key])
            dist.broadcast(self.agreed[key], src=dist.get_global_rank(channel.group, 0), group=channel.group)
            if self.momentum[key] is not None:
                self.momentum[key].zero_()
            channel.reset()
        self.pending = {}
