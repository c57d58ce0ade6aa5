"""SparseLoCo's outer exchange: :class:`~loco_megatron.diloco.exchange.OuterChannel`'s
interface over one fixed-size all-gather of every rank's payload.

:meth:`SparseChannel.start` compresses this rank's outer gradient (its error buffer
updated, :mod:`.compressor`) and launches one ``all_gather_into_tensor`` of the uint8
payloads (every rank's has the same size: ``k`` entries per chunk of the same plan); ``wait()``
decodes the ``R`` rows and adds them into ``delta`` in fp32 in rank order, so every rank holds
the same sum bit for bit, then divides it. Bytes per rank to the others: ``(R - 1)`` payloads.

The division (``mean``, --diloco-outer-topk-mean): ``chosen`` (the default) divides each
entry by the replicas that sent it a non-zero value, each counted with its weight (the factor
a caller's ``outer_scale`` scaled its gradient by, elastic DiLoCo's samples-weighted mean, 1
elsewhere; the payload carries it), so an entry's mean is the weighted mean over its senders
(Templar's merge); ``all`` divides every entry by ``mean_over`` (every rank of the group, or
the contributors an elastic cycle counts) like the dense mean: an entry a replica did not send
counts as its zero. docs/diloco.md gives the measurement behind the default.
"""

from __future__ import annotations

from typing import Optional

import torch

from loco_megatron.diloco.exchange import OuterWork
from loco_megatron.diloco.sparse.chunks import ChunkPlan
from loco_megatron.diloco.sparse.codec import chosen_counts_, decode, scatter_add_, sender_weight
from loco_megatron.diloco.sparse.compressor import SparseCompressor
from loco_megatron.loco.collectives import TORCH_OPS, CollectiveOps
from loco_megatron.metrics.comm import WallClock

MEANS = ("all", "chosen")


class SparseChannel:
    """The SparseLoCo exchange of one flat fp32 shard of ``plan.numel`` elements over ``group``
    (``world`` rows: the group's size unless given). ``comp1``: its compressor when it keeps
    an error buffer (None without error feedback), as OuterChannel's phase-1 compressor."""

    world_independent = True
    """The state (the error buffer) does not depend on the number of replicas: a channel laid
    anew for other replicas takes it over (elastic DiLoCo's re-lay)."""
    exact = False
    comp2 = None

    def __init__(self, plan: ChunkPlan, group, topk: int, bits: int, beta: float = 0.95, error_feedback: bool = True,
                 device: Optional[torch.device] = None, name: str = "outer", ops: CollectiveOps = TORCH_OPS,
                 clock=None, world: Optional[int] = None, mean: str = "chosen"):
        if mean not in MEANS:
            raise ValueError(f"mean {mean!r}: one of {', '.join(MEANS)}")
        self.plan, self.numel, self.group, self.name, self.mean = plan, plan.numel, group, name, mean
        self.bits, self.topk = bits, topk
        self.ops, self.clock = ops, clock or WallClock()
        self.world = ops.get_world_size(group) if world is None else world
        self.rank = ops.get_rank(group)
        self.mean_over = self.world
        """The deltas a mean is over (see OuterChannel.mean_over; ``mean="all"`` only)."""
        self.weight = 1.0
        """The factor this rank's next outer gradient is scaled by (elastic DiLoCo sets it per
        exchange: :attr:`~loco_megatron.diloco.outer.OuterStep.outer_scale`), sent with it."""
        self.compressor = SparseCompressor(plan, topk, bits, beta, error_feedback, device)
        self.comp1 = self.compressor if error_feedback else None
        self.layout = self.compressor.layout

    # -- sizes -------------------------------------------------------------------------
    def bytes_to_others(self) -> int:
        """Bytes this rank sends to the others per exchange: its payload, to each of them
        (indices, values and bin tables)."""
        return (self.world - 1) * self.layout.nbytes

    def uncompressed_bytes(self) -> int:
        """What the fp32 ring all-reduce of the same shard sends per rank."""
        return 2 * (self.world - 1) * self.numel * 4 // self.world

    def state_nbytes(self) -> int:
        return self.compressor.error_nbytes()

    # -- the exchange ------------------------------------------------------------------
    def start(self, delta: torch.Tensor) -> "SparseWork":
        """Launch the exchange of ``delta`` (fp32 ``[numel]``); after ``wait()`` it holds the mean."""
        assert delta.numel() == self.numel and delta.dtype == torch.float32
        work = SparseWork(self, delta)
        work.begin()
        return work

    def state_dict(self) -> dict:
        return {"form": "sparse", "numel": self.numel, "topk": self.topk, "chunk": self.plan.chunk,
                "bits": self.bits, "compressor": self.compressor.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """ValueError naming what differs when ``sd`` was written for another exchange."""
        mine = (self.numel, self.topk, self.plan.chunk, self.bits)
        theirs = tuple(sd.get(k) for k in ("numel", "topk", "chunk", "bits"))
        if sd.get("form") != "sparse":
            raise ValueError(f"{self.name}: the checkpoint holds a dense outer exchange's error buffers, this run "
                             f"exchanges top {self.topk} of {self.plan.chunk}")
        if theirs != mine:
            raise ValueError(f"{self.name}: {theirs[0]} elements, top {theirs[1]} of {theirs[2]} at {theirs[3]} bits "
                             f"in the checkpoint, {mine[0]}, top {mine[1]} of {mine[2]} at {mine[3]} now")
        self.compressor.load_state_dict(sd["compressor"])

    def reset(self) -> None:
        self.compressor.reset()


class SparseWork(OuterWork):
    """One SparseLoCo exchange in flight (OuterWork's handle: ``second_phase()`` has nothing
    to do, ``wait()`` decodes and sums)."""

    def begin(self) -> None:
        c = self.c

        def launch():
            payload, _ = c.compressor.compress(self.delta, c.weight)
            self._recv = torch.empty(c.world * payload.numel(), dtype=torch.uint8, device=payload.device)
            self.launch_mark = c.clock.mark()
            self._send = payload  # (referenced until wait(): the collective may read it until then)
            self._work = c.ops.all_gather_into_tensor(self._recv, payload, group=c.group, async_op=True)

        self._timed(launch)
        self.phase = 2

    def wait(self) -> None:
        if self.phase == 3:
            return
        c = self.c

        def run():
            if self._work is not None:
                self._work.wait()
                self._work = None
            rows = self._recv.view(c.world, c.layout.nbytes)
            delta = self.delta
            delta.zero_()
            counts = torch.zeros_like(delta) if c.mean == "chosen" else None
            for r in range(c.world):  # rank order: the same sum on every rank
                entries = decode(rows[r], c.plan, c.layout)
                scatter_add_(delta, entries)
                if counts is not None:
                    chosen_counts_(counts, entries, sender_weight(rows[r], c.layout))
            if counts is None:
                delta.div_(c.mean_over)
            else:
                # (a weight may be below 1: divide by it as it is, only where some sender counts)
                torch.where(counts > 0, delta / torch.where(counts > 0, counts, torch.ones((), device=delta.device)),
                            torch.zeros((), device=delta.device), out=delta)
            self._recv = self._send = None
            self.finite = torch.isfinite(delta).all()

        self._timed(run)
        self.done_mark = c.clock.mark()
        self.phase = 3
