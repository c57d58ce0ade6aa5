"""An elastic replica's checkpoint: what :class:`~.replica.ReplicaStep` saves and how it
resumes, decided alike on every rank of the replica.

A checkpoint never holds an exchange in flight (its cycle has not committed: its mean may
never be the run's). It holds the replica as of its last committed outer step (the agreed
parameters, momentum and outer step count are untouched until a commit), with the error
buffers as before the open cycle, the replica-state record (:mod:`.record`) in its common
state, and the local parameters with this replica's own training since: a resume exchanges
that at its next outer step, as a discarded cycle would, and re-opens nothing.
"""

from __future__ import annotations

from typing import Optional

import torch

from loco_megatron.diloco.elastic.record import ReplicaRecord
from loco_megatron.diloco.elastic.replica import ReplicaStep
from loco_megatron.diloco.elastic.split import Share


class ReplicaCheckpoint(ReplicaStep):
    """:class:`~.replica.ReplicaStep` with its checkpoint (see the module docstring)."""

    def settle(self) -> None:
        """Before a save (every rank, the same iteration): nothing to finish; one
        line when a cycle is open, saying what the checkpoint holds instead of it (the module
        docstring)."""
        if self._open is not None:
            frags = ", ".join(map(str, self._fragments(self._open.keys)))
            self._log(f"DiLoCo: the checkpoint at iteration {self._iteration()} holds outer step "
                      f"{self.outer_steps} (the last committed) and this replica's training since; the exchange of "
                      f"fragment(s) {frags} in flight (started at {self._open.cycle.iteration}) is not in it")

    def per_rank_state_dict(self) -> dict:
        """:meth:`OuterStep.per_rank_state_dict` without the exchange in flight: its
        channels' error buffers as before its cycle, no pending mean."""
        snapshots = self._snapshots if self._open is not None else {}
        return {"shards": {key: views.signature() for key, (views, *_rest) in self.channels.items()},
                "exchange": {key: (snapshots[key][1] if key in snapshots else ch.state_dict())
                             for key, (_, ch, _, _) in self.channels.items()},
                "pending": {}}

    def common_state(self) -> dict:
        record = ReplicaRecord(self.replica, self._progress(), self.outer_steps, self.split_id, self._shares,
                               self._laid_for, dict(self._synced_at))
        return {**super().common_state(), "elastic": {
            **self.coordinator.state_dict(), "samples_trained": self.samples_trained,
            "since": {str(f): n for f, n in self._since.items()}, "record": record.meta(),
            **({"ended": self.unfinished} if self.ended else {})}}

    @staticmethod
    def _saved_record(saved: dict) -> Optional[ReplicaRecord]:
        """The record of a checkpoint's ``elastic`` state (an older checkpoint's loose fields
        read as one), None when it has none."""
        if not saved:
            return None
        if "record" in saved:
            return ReplicaRecord.of(saved["record"])
        return ReplicaRecord(-1, {"iteration": 0}, 0, int(saved.get("split", 0)),
                             {int(r): Share(int(o), int(n)) for r, (o, n) in saved["shares"].items()}
                             if saved.get("shares") else None, tuple(int(r) for r in saved.get("laid_for", ())))

    def load_state_dict(self, sd: Optional[dict]) -> None:
        """As :meth:`OuterStep.load_state_dict`, decided alike on every rank of the job: a
        rank hosting no lane loads nothing (a checkpoint may give it no outer state at all),
        so whether the lanes start afresh is the lane hosts' verdict, and the record (outer
        step count, split, the replicas the error buffers were laid for) is rank 0's. A
        state that does not fit starts from this replica's loaded parameters: the replicas'
        states then differ, and the first cycle makes them agree on one (:mod:`.agreement`).
        An exchange in flight that an older version saved is dropped, its error buffers at
        zero (one line): its cycle never committed."""
        import torch.distributed as dist

        host = self.coordinator.lane is not None
        fits = not host or (sd is not None and set(sd["agreed"]) == set(self.channels)
                            and all(sd["agreed"][k].numel() == a.numel() for k, a in self.agreed.items()))
        verdict = torch.tensor([int(fits)])
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.coordinator.control)
        fits = bool(verdict.item())
        saved = self.coordinator.decide((sd or {}).get("elastic")) or {}
        record = self._saved_record(saved)
        if fits and record is not None and record.laid_for:
            self._lay(record.laid_for)  # (the loaded error buffers' rows were laid for those replicas)
        if not fits:
            self._agree_on_loaded()
            self._log("DiLoCo: the checkpoint's outer state does not fit this run's lanes; the outer step starts "
                      "afresh from this replica's loaded parameters (the replicas agree on one model at the first "
                      "outer step)")
        elif sd is not None:
            super().load_state_dict(sd)
        if self.pending:  # (every lane host alike: one checkpoint moment)
            for key in self.pending:
                self.channels[key][1].reset()
            self._log(f"DiLoCo: the checkpoint holds {len(self.pending)} outer exchange(s) in flight, never "
                      f"committed (saved by an older version): dropped, their error buffers at zero; this replica's "
                      f"training since its last committed outer step goes into its next one")
            self.pending = {}
        self.outer_steps = int(self.coordinator.decide(self.outer_steps))
        self.coordinator.load_state_dict(saved)
        if record is not None:
            mine = (record.shares or {}).get(self.replica)
            if mine is not None and self.split.mode != "fixed" and not self._whole(mine):
                # (a restart in another layout: the saved split was made for the old one's
                # granule; no split is held, so the next cycle makes one for this layout)
                self._log(f"DiLoCo: the checkpoint's batch split gives this replica {mine.samples} samples, not "
                          f"whole shares of {self.split.granule} in this layout: dropped, the replicas split the "
                          f"batch anew at the next outer step")
            elif record.shares and self.split.mode != "fixed":
                self._take_split(record.shares, record.split)
            self._laid_for = record.laid_for if fits else ()
            self._synced_at = dict(record.synced_at)
        self.samples_trained = int(saved.get("samples_trained", 0))
        self._since = {f: int(saved.get("since", {}).get(str(f), self.samples_trained)) for f in self._since}

    def _lay(self, contributors: tuple) -> bool:
        """Every channel anew, laid for ``contributors`` (a row each, in this order). A
        channel whose state does not depend on the replicas (``world_independent``:
        SparseLoCo's error buffer) takes its predecessor's; the others start with error
        buffers at zero. Returns whether any channel's error buffers were dropped so."""
        dropped = False
        for key, (views, old, sub, frag) in list(self.channels.items()):
            fresh = self._relay(key, len(contributors))
            if getattr(old, "world_independent", False):
                fresh.load_state_dict(old.state_dict())
            else:
                dropped = dropped or old.comp1 is not None
            self.channels[key] = (views, fresh, sub, frag)
        self._laid_for = tuple(contributors)
        return dropped

    def _agree_on_loaded(self) -> None:
        """Outer state afresh from the loaded model (the lanes read from the shards)."""
        for key, (views, channel, _, _) in self.channels.items():
            views.read(self.agreed[key])
            if self.momentum[key] is not None:
                self.momentum[key].zero_()
            channel.reset()
        self.pending = {}
