"""The replica-state record: everything the ranks of one elastic replica must hold alike,
as one versioned value that travels whole.

A replica's ranks take another state at three seams: a *heal* (torchft sends a live
replica's state to the lane hosts of one that is behind), an *agreement* (every participant
takes one participant's state) and a *resume* (a checkpoint). At each of them the record
reaches every rank of the replica, so no rank can keep a piece of its old state: the
progress (iteration, LR schedule position), the outer step count, the batch split and this
replica's share of it, the replicas the outer error buffers were laid for, and each
fragment's last committed iteration. The tensors (the lane's agreed parameters and outer
momentum) ride along on the lane hosts only; the error buffers are per rank and stay each
replica's own. Hosts and non-hosts differ only in which tensors they hold, never in which
fields they know.

The record is taken only between cycles, when no exchange is in flight (a delayed exchange
closes before the next cycle opens: ``tau <= H / F``; an eager one, of one fragment, at the
next sync, before that sync's cycle opens), and a checkpoint never holds one
(:meth:`~.replica.ReplicaStep.settle`): there is no pending exchange to carry. A replica
healed under eager updates starts with no eager part and nothing sent (its own training
is replaced), so no eager state travels either (:mod:`.eager`).

Pure: builtins and tensors in, builtins out; no torch.distributed.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.diloco.elastic.split import Share

VERSION = 1
"""The record's layout; a record of another version cannot be applied (the cycle fails on
every rank of the replica, in one line naming both)."""


@dataclasses.dataclass
class ReplicaRecord:
    """One replica's state, the same on every rank of it (see the module docstring)."""

    source: int
    """The replica id it was taken from."""
    progress: dict
    """The trainer's position: ``iteration`` and ``scheduler_steps`` (ints)."""
    outer_steps: int
    """Outer steps committed."""
    split: int = 0
    """:func:`~.split.split_id` of :attr:`shares` (0: none, or the ``fixed`` split)."""
    shares: Optional[dict[int, Share]] = None
    """The batch split (replica id -> share of each step's global batch), or None."""
    laid_for: tuple[int, ...] = ()
    """The replicas the outer exchange (its error buffers' rows) is laid for; () unknown."""
    synced_at: dict[int, int] = dataclasses.field(default_factory=dict)
    """Per fragment, the iteration its last outer step committed at."""
    agreed: Optional[dict] = None
    """Lane hosts: the lane's agreed parameters, channel key -> fp32 ``[N]`` (None elsewhere)."""
    momentum: Optional[dict] = None
    """Lane hosts: the lane's outer momentum (None: zero, or not a host)."""

    @property
    def iteration(self) -> int:
        return int(self.progress["iteration"])

    def meta(self) -> dict:
        """Every field but the tensors, as builtins (an object gather, a checkpoint's common state)."""
        return {"version": VERSION, "source": self.source, "progress": dict(self.progress),
                "outer_steps": self.outer_steps, "split": self.split,
                "shares": None if self.shares is None else {str(r): [s.offset, s.samples]
                                                           for r, s in sorted(self.shares.items())},
                "laid_for": list(self.laid_for), "synced_at": {str(f): t for f, t in sorted(self.synced_at.items())}}

    def transport(self) -> dict:
        """What torchft sends a lane host that heals: :meth:`meta` and the lane's tensors."""
        return {"meta": self.meta(), "agreed": self.agreed, "momentum": self.momentum}

    @classmethod
    def of(cls, meta: dict, agreed: Optional[dict] = None, momentum: Optional[dict] = None) -> "ReplicaRecord":
        """The record of :meth:`meta`'s dict (and a host's tensors). ValueError, naming the
        field, when it cannot be this version's record: every rank of a replica reads the
        same dict, so every rank refuses it alike."""
        if not isinstance(meta, dict) or meta.get("version") != VERSION:
            got = meta.get("version") if isinstance(meta, dict) else type(meta).__name__
            raise ValueError(f"a replica-state record of version {got} (this program reads version {VERSION})")
        try:
            progress = {k: int(v) for k, v in meta["progress"].items()}
            if "iteration" not in progress:
                raise KeyError("progress.iteration")
            shares = meta["shares"]
            shares = None if shares is None else {int(r): Share(int(o), int(n)) for r, (o, n) in shares.items()}
            return cls(int(meta["source"]), progress, int(meta["outer_steps"]), int(meta["split"]), shares,
                       tuple(int(r) for r in meta["laid_for"]),
                       {int(f): int(t) for f, t in meta["synced_at"].items()}, agreed, momentum)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"a replica-state record without a valid {e}") from None

    @classmethod
    def received(cls, state: dict) -> "ReplicaRecord":
        """The record of :meth:`transport`'s dict (a lane host's heal)."""
        if not isinstance(state, dict) or "meta" not in state:
            raise ValueError("the state healed from a live replica is not a replica-state record (another version "
                             "of this program?)")
        return cls.of(state["meta"], state.get("agreed"), state.get("momentum"))

    def share_of(self, replica: int) -> Optional[Share]:
        """``replica``'s share under :attr:`shares` (None: not in the split)."""
        return (self.shares or {}).get(replica)
