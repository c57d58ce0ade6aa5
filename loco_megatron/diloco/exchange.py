"""The outer-gradient exchange among the R ranks of an outer group, with a work handle.

One :class:`OuterChannel` per (sub-optimizer, fragment) shard of ``N`` fp32 elements.
:meth:`OuterChannel.start` launches the exchange of a flat outer gradient ``delta`` and
returns an :class:`OuterWork`; ``second_phase()`` and ``wait()`` finish it, after which
``delta`` holds the mean over the group, bit-identical on every rank of the group.

* ``bits == 0``: one fp32 ``all_reduce`` (sum; every rank receives the same reduced
  values, as NCCL's and gloo's ring and tree algorithms deliver them), then ``/ R``.
* ``exact``: an fp32 ``all_gather`` of every rank's ``delta``, summed in rank order. Each
  element's mean then depends on that element's values alone, not on where it sits in the
  buffer (a ring all-reduce's summation order does): the two copies of a tied embedding,
  which sit at different places of their pipeline stages' shards, get the same update.
  ``(R - 1) * N * 4`` bytes per rank.
* ``bits`` 8, 4, 2: LoCo's two-phase compressed all-reduce. Phase 1 is
  :func:`~loco_megatron.loco.collectives.compressed_reduce_scatter`: each rank
  compensates ``delta`` with its own error buffer, quantises it in ``R`` rows and sends
  row ``j`` to rank ``j`` in one all-to-all; rank ``j`` sums its ``R`` received rows in
  fp32 in rank order and divides by ``R``. Phase 2: rank ``j`` compensates that mean row
  with a second error buffer (the owner's), quantises it and all-gathers the codes; every
  rank decodes every row from the same bytes, so all of them hold the same mean, bit for
  bit. Bytes per rank to other ranks: ``2 (R - 1) / R * N * bits / 8`` plus one fp32
  scale per block, against ``2 (R - 1) / R * N * 4`` for the fp32 ring all-reduce.

Collectives go through a :class:`~loco_megatron.loco.collectives.CollectiveOps` and are
issued in program order only (the driver decides when each phase runs from the
iteration number; see :mod:`.schedule`).
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.loco.collectives import (TORCH_OPS, CodeGather, CollectiveOps, ShardLayout, compressed_reduce_scatter,
                                            decode_rows_into)
from loco_megatron.loco.compressor import LoCoCompressor
from loco_megatron.loco.quantize import QuantOptions
from loco_megatron.loco.workspace import Workspace
from loco_megatron.metrics.comm import WallClock


class OuterChannel:
    """The exchange of one flat fp32 shard of ``numel`` elements over ``group`` (R ranks).

    Owns the two LoCo compressors (phase 1: this rank's outer gradient; phase 2: the mean
    of the row this rank owns) and their error buffers, which persist across outer steps
    and are checkpointed (:meth:`state_dict`)."""

    def __init__(self, numel: int, group, bits: int, block_size: int = 256, options: Optional[QuantOptions] = None,
                 error_feedback: bool = True, beta: float = 0.8, kernels: str = "torch",
                 device: Optional[torch.device] = None, name: str = "outer", ops: CollectiveOps = TORCH_OPS,
                 decompress: Optional[Callable] = None, workspace: Optional[Workspace] = None, clock=None,
                 exact: bool = False, gain_correction: bool = False, stream_rank: Optional[int] = None,
                 world: Optional[int] = None):
        if exact and bits:
            raise ValueError("exact (gather and sum in rank order) is an fp32 exchange: bits must be 0")
        self.numel, self.group, self.bits, self.name, self.exact = numel, group, bits, name, exact
        self.world = ops.get_world_size(group) if world is None else world
        """Rows of the exchange (``world``: laid for that many ranks whatever the group's
        size now; elastic DiLoCo lays its channels for the replicas of a cycle)."""
        self.rank = ops.get_rank(group)
        self.mean_over = self.world
        """The deltas a mean is over: every rank of the group, unless some send zeros that
        must not count (elastic DiLoCo: a replica that just healed; set per exchange)."""
        self.ops, self.clock = ops, clock or WallClock()
        self.workspace = workspace or Workspace()
        if decompress is None:
            from loco_megatron.loco.kernel_choice import decompressor

            decompress = decompressor(kernels)
        self._decompress = decompress
        self.comp1 = self.comp2 = None
        if not bits:
            return
        options = options or QuantOptions()
        self.layout1 = ShardLayout(numel, self.world, bits, block_size, options=options)
        # Phase 2 decodes one row at a time into its place: a one-rank layout of a row.
        self.row_layout = ShardLayout(self.layout1.piece, 1, bits, block_size, options=options)
        # Stochastic rounding streams: this shard, phase and rank (seed and step do the rest);
        # ``stream_rank``: the rank's place in the whole run where that is not its global rank
        # (replicas in worlds of their own), else independent replicas would round alike.
        rank = dist.get_rank() if stream_rank is None else stream_rank

        def stream(phase: str) -> int:
            return zlib.crc32(f"{name}/{phase}/rank{rank}".encode())

        common = dict(bits=bits, beta=beta, block_size=block_size, error_bits=8, reset_interval=0,
                      error_feedback=error_feedback, device=device, kernels=kernels, options=options,
                      gain_correction=gain_correction)
        self.comp1 = LoCoCompressor(**self.layout1.compressor_shape(), stream=stream("own"), **common)
        self.comp2 = LoCoCompressor(self.layout1.piece, stream=stream("mean"), **common)

    # -- sizes -------------------------------------------------------------------------
    def bytes_to_others(self) -> int:
        """Bytes this rank sends to the other ranks of the group per exchange (both phases)."""
        if self.exact:
            return (self.world - 1) * self.numel * 4
        if not self.bits:
            return 2 * (self.world - 1) * self.numel * 4 // self.world
        return (self.world - 1) * (self.layout1.row_bytes + self.row_layout.row_bytes)

    def uncompressed_bytes(self) -> int:
        """What the fp32 ring all-reduce of the same shard sends per rank."""
        return 2 * (self.world - 1) * self.numel * 4 // self.world

    def state_nbytes(self) -> int:
        """Bytes of the error buffers kept across outer steps."""
        return sum(c.error_nbytes() for c in (self.comp1, self.comp2) if c is not None)

    # -- the exchange ------------------------------------------------------------------
    def start(self, delta: torch.Tensor) -> "OuterWork":
        """Launch the exchange of ``delta`` (fp32 ``[numel]``, this rank's outer gradient).
        ``delta`` must stay untouched until ``wait()`` returns; then it holds the mean."""
        assert delta.numel() == self.numel and delta.dtype == torch.float32
        work = OuterWork(self, delta)
        work.begin()
        return work

    def state_dict(self) -> dict:
        return {"numel": self.numel, "bits": self.bits,
                "comp1": self.comp1.state_dict() if self.comp1 else None,
                "comp2": self.comp2.state_dict() if self.comp2 else None}

    def load_state_dict(self, sd: dict) -> None:
        """Restore both error buffers; :class:`~loco_megatron.loco.compressor.LoCoStateMismatch`
        (or ValueError) naming what differs when ``sd`` was written for another shard."""
        if sd.get("form", "dense") != "dense":  # (SparseLoCo's error buffer: diloco/sparse)
            raise ValueError(f"{self.name}: the checkpoint holds SparseLoCo's error buffer, this run's outer exchange "
                             "is dense")
        if sd["numel"] != self.numel or sd["bits"] != self.bits:
            raise ValueError(f"{self.name}: {sd['numel']} elements at {sd['bits']} bits in the checkpoint, "
                             f"{self.numel} at {self.bits} now")
        if self.comp1 is not None:
            self.comp1.load_state_dict(sd["comp1"])
            self.comp2.load_state_dict(sd["comp2"])

    def reset(self) -> None:
        for c in (self.comp1, self.comp2):
            if c is not None:
                c.reset()


class OuterWork:
    """One exchange in flight. ``second_phase()`` (compressed only: finish phase 1, launch
    the all-gather; a no-op for fp32 or when already done) and ``wait()`` (everything
    still to do; ``delta`` then holds the mean) are called in program order by the driver.

    Clock marks (resolved by the driver, after the step: on CUDA they are events):
    ``launch_mark`` .. ``done_mark`` (the exchange, end to end) and ``exposed_marks``
    (the intervals the caller spent inside ``begin``/``second_phase``/``wait``:
    compressing, decoding and waiting, i.e. what the training loop did not overlap)."""

    def __init__(self, channel: OuterChannel, delta: torch.Tensor):
        self.c, self.delta = channel, delta
        self._work = None  # torch work of the collective in flight
        self._rs = None  # phase 1 handle (compressed)
        self._mean_row: Optional[torch.Tensor] = None
        self._recv2: Optional[torch.Tensor] = None  # (exact: the gathered deltas)
        self._gather: Optional[CodeGather] = None  # phase 2 in flight
        self.phase = 0
        """1: phase 1 in flight; 2: phase 2 in flight (or the fp32 all-reduce); 3: done."""
        self.launch_mark = self.done_mark = None
        self.exposed_marks: list[tuple] = []
        self.bytes_sent = channel.bytes_to_others()
        self.finite: Optional[torch.Tensor] = None
        """0-d bool device tensor: whether the mean is finite (set by ``wait()``)."""

    def _timed(self, fn) -> None:
        start = self.c.clock.mark()
        fn()
        self.exposed_marks.append((start, self.c.clock.mark()))

    def begin(self) -> None:
        c = self.c
        if c.exact:
            self.launch_mark = c.clock.mark()
            self._recv2 = torch.empty(c.world * c.numel, dtype=torch.float32, device=self.delta.device)
            self._work = c.ops.all_gather_into_tensor(self._recv2, self.delta, group=c.group, async_op=True)
            self.phase = 2
            return
        if not c.bits:
            self.launch_mark = c.clock.mark()
            self._work = c.ops.all_reduce(self.delta, group=c.group, async_op=True)
            self.phase = 2
            return
        mean_row = torch.zeros(c.layout1.piece, dtype=torch.float32, device=self.delta.device)
        a, b = c.layout1.row_range(c.rank)
        self._mean_row = mean_row

        def launch():
            self._rs, _ = compressed_reduce_scatter(
                self.delta, lambda flat: c.comp1.compress(flat, c.workspace), c.layout1, c.group, async_op=True,
                scale=1.0 / c.mean_over, clock=c.clock, decompress=c._decompress, out=mean_row[: b - a], ops=c.ops)

        self._timed(launch)
        self.launch_mark = self._rs.launch_mark
        self.phase = 1

    def second_phase(self) -> None:
        if self.phase != 1:
            return
        c = self.c

        def run():
            self._rs.wait()  # the fp32 mean of this rank's row, in rank order
            self._rs = None
            codes, scales = c.comp2.compress(self._mean_row, c.workspace)
            self._gather = CodeGather(codes, scales, c.world, c.group, async_op=True, ops=c.ops)

        self._timed(run)
        self.phase = 2

    def wait(self) -> None:
        if self.phase == 3:
            return
        self.second_phase()
        c = self.c

        def run():
            if self._work is not None:
                self._work.wait()
                self._work = None
            if c.exact:
                rows = self._recv2.view(c.world, -1)
                self.delta.copy_(rows[0])
                for r in range(1, c.world):  # rank order: the same sum wherever the element sits
                    self.delta.add_(rows[r])
                self.delta.div_(c.mean_over)
                self._recv2 = None
            elif not c.bits:
                self.delta.div_(c.mean_over)
            else:
                decode_rows_into(self._gather.wait(), c.layout1, c.row_layout, self.delta, c._decompress)
                self._gather = self._mean_row = None
            self.finite = torch.isfinite(self.delta).all()

        self._timed(run)
        self.done_mark = c.clock.mark()
        self.phase = 3
