"""Two-hop (hierarchical) LoCo reduce-scatter: inside each node, then across nodes.

A data-parallel group of ``W = n * R`` ranks (``n`` nodes, ``R`` ranks of the group per
node, group rank ``j = a*R + b`` on node ``a`` with local index ``b``) must leave
group rank ``j`` holding the sum of shard ``j`` of every rank's flat buffer (what
megatron-core's distributed optimizer reads). The flat reduce-scatter sends
``(W-R)/W`` of every buffer across nodes; here:

* **hop 1 (intra-node, fast link)**: the buffer, viewed as ``[n, R, S]``, is
  transposed to ``[R, n, S]`` so that local rank ``b`` owns the contiguous chunk of the
  ``n`` shards ``{a*R + b}``; a compressed reduce-scatter over the ``R`` ranks of the
  node (``--loco-intra-node-bits``, its own LoCo error state; or 16 = bf16
  uncompressed: an all-to-all of bf16 rows summed in fp32 in rank order) leaves rank
  ``b`` the node's partial sums of those shards;
* **hop 2 (inter-node, slow link)**: a compressed reduce-scatter of that chunk over
  the ``n`` ranks with the same local index (``--loco-bits``, its own error state)
  leaves rank ``(a, b)`` the full sum of shard ``a*R + b``, copied into place.

Only hop 2 crosses nodes: ``(n-1)/n * N/R`` elements at ``--loco-bits``, instead of
``(W-R)/W * N`` at the gradient dtype.

**Collective order** (NCCL needs every rank of a communicator to issue its operations in
the same order, and ranks using the intra- and inter-node communicators must not
interleave them differently). The order is a pure function of program order, the same
on every rank, and never depends on whether a collective happens to have finished:

* hop 1 of a bucket is issued when megatron launches the bucket's sync;
* the hop 2s of all earlier buckets are issued, in the order their hop 1 was issued,
  at one fixed point: the start of the *next* bucket group's launch (before its hop 1s),
  or, for the last ones, when megatron waits on their bucket group
  (:class:`Hop2Sequencer`); issuing hop 2 waits for that bucket's hop 1 first.

So on every rank the sequence is ``hop1(g0) | hop2(g0) hop1(g1) | hop2(g1) hop1(g2) | ...``
(``g`` = bucket groups in launch order; within a group, buckets in order).

**Memory**: hop 1 reads the buffer in place (its rows go to local rank ``i % R``, no
transposed copy); hop 1's fp32 result (``N/R`` elements, padding included) is written
into the shared workspace when hop 2 is issued, compressed straight away and not
needed afterwards, so the transient cost is one such scratch for the largest bucket,
not one per bucket in flight. Hop 2 writes the reduced shard straight into the buffer.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.loco.collectives import (TORCH_OPS, CollectiveOps, ShardLayout, compressed_reduce_scatter,
                                            decompress_into, gather_rows)
from loco_megatron.loco.workspace import Workspace
from loco_megatron.metrics.comm import WallClock


class NodeGroups:
    """The intra-node and inter-node sub-groups of one data-parallel group, for this rank."""

    def __init__(self, intra, inter, nodes: int, per_node: int):
        self.intra, self.inter, self.nodes, self.per_node = intra, inter, nodes, per_node


def build_node_groups(groups: list, ranks_per_node: int) -> list[Optional[NodeGroups]]:
    """Create the sub-groups of each process group in ``groups`` (e.g. the dense and the
    expert data-parallel group). Collective over the whole world: every rank calls it
    with its own groups, in the same order. Returns, per input group, its
    :class:`NodeGroups` (None when the group lies within one node).

    Raises ValueError when a group's ranks are not node-major (rank ``j`` of the group
    on node ``j // R``) with the same number on every node.
    """
    world = dist.get_world_size()
    mine = [tuple(dist.get_process_group_ranks(g)) for g in groups]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    out: list[Optional[NodeGroups]] = [None] * len(groups)
    for slot in range(len(groups)):
        # Every distinct group of this kind, in one global order, so that new_group is
        # called identically on every rank.
        for ranks in sorted({per_rank[slot] for per_rank in everyone}):
            nodes = sorted({r // ranks_per_node for r in ranks})
            per_node = len(ranks) // len(nodes)
            by_node = [[r for r in ranks if r // ranks_per_node == a] for a in nodes]
            if any(len(x) != per_node for x in by_node) or [r for x in by_node for r in x] != list(ranks):
                raise ValueError(f"two-hop LoCo needs the data-parallel group {list(ranks)} to hold the same "
                                 f"number of ranks on every node, node by node (ranks per node "
                                 f"{ranks_per_node}; set --loco-ranks-per-node or --no-loco-hierarchical)")
            intra = [dist.new_group(x) for x in by_node]
            inter = [dist.new_group([x[b] for x in by_node]) for b in range(per_node)]
            if ranks == mine[slot] and len(nodes) > 1:
                me = dist.get_rank()
                a = nodes.index(me // ranks_per_node)
                out[slot] = NodeGroups(intra[a], inter[by_node[a].index(me)], len(nodes), per_node)
    return out


class TwoHopLayout:
    """Sizes of one bucket's two-hop reduce-scatter over ``n`` nodes x ``R`` ranks.

    ``flat``: the buffer as ``W = n*R`` shards (row ``a*R + b`` for rank ``(a, b)``);
    ``intra``: hop 1, those rows grouped by local rank (``pieces = n``), None for the
    uncompressed bf16 hop; ``inter``: hop 2 over hop 1's result of ``n`` rows of
    ``P`` (the padded shard), one row per node. ``options``: the quantiser options of
    both compressed hops.
    """

    def __init__(self, numel: int, nodes: int, per_node: int, intra_bits: int, inter_bits: int,
                 block_size: int, options=None):
        self.numel, self.nodes, self.per_node = numel, nodes, per_node
        self.flat = ShardLayout(numel, nodes * per_node, inter_bits, block_size)
        self.shard = self.flat.piece
        self.intra = None if intra_bits == 16 else ShardLayout(numel, per_node, intra_bits, block_size,
                                                               pieces=nodes, options=options)
        self.inter = ShardLayout(nodes * self.flat.piece_padded, nodes, inter_bits, block_size, options=options)

    @property
    def hop1_numel(self) -> int:
        """fp32 elements of hop 1's result (``n`` zero-padded shards)."""
        return self.nodes * self.flat.piece_padded


class Hop2Sequencer:
    """Issues the hop 2 of two-hop works in the order their hop 1 was issued - the same
    on every rank - at fixed points in program order (see the module docstring)."""

    def __init__(self):
        self._queue: list["TwoHopWork"] = []

    def add(self, work: "TwoHopWork") -> None:
        self._queue.append(work)

    def flush(self, until: Optional["TwoHopWork"] = None) -> None:
        """Issue every queued hop 2 in order (each after waiting for its hop 1), or only
        up to and including ``until``'s."""
        while self._queue:
            head = self._queue.pop(0)
            head._launch_hop2()
            if head is until:
                return


class TwoHopWork:
    """Handle of an in-flight two-hop reduce-scatter; ``wait()`` completes it.

    ``launch_mark``/``done_mark`` and ``decompress_marks`` (hop 2's) as for
    :class:`CompressedReduceScatterWork`; ``extra_compress_marks`` holds the (start, end)
    marks of hop 2's compression (it happens after launch) and
    ``extra_decompress_marks`` hop 1's decompression. ``bytes_intra`` and
    ``bytes_inter``: what this rank sent on each hop to *other* ranks (the per-link
    split); ``bytes_handed``: every byte it handed to the two hops' collectives, its own
    rows included, as flat LoCo counts ``comm/grad_bytes_sent``; ``gather_bytes``
    what the all-gather (without the distributed optimizer) handed over.
    """

    def __init__(self, finish_hop1: Callable, start_hop2: Callable, clock, launch_mark, bytes_intra: int,
                 sequencer: Hop2Sequencer, gather: Optional[Callable] = None, hop1_handed: int = 0):
        self._finish_hop1, self._start_hop2, self._gather = finish_hop1, start_hop2, gather
        self._sequencer = sequencer
        sequencer.add(self)
        self._hop2 = None
        self.clock, self.launch_mark, self.done_mark = clock, launch_mark, None
        self.decompress_marks: Optional[tuple] = None
        self.extra_compress_marks: list[tuple] = []
        self.extra_decompress_marks: list[tuple] = []
        self.bytes_intra, self.bytes_inter, self.gather_bytes = bytes_intra, 0, 0
        self.bytes_handed = hop1_handed

    def _launch_hop2(self) -> None:
        result, marks = self._finish_hop1()
        if marks is not None:
            self.extra_decompress_marks.append(marks)
        start = self.clock.mark()
        self._hop2, self.bytes_inter, handed = self._start_hop2(result)
        self.bytes_handed += handed
        self.extra_compress_marks.append((start, self._hop2.launch_mark))

    def wait(self) -> None:
        if self.done_mark is not None:
            return
        if self._hop2 is None:
            self._sequencer.flush(until=self)
        self._hop2.wait()
        self.decompress_marks = self._hop2.decompress_marks
        if self._gather is not None:
            self.gather_bytes = self._gather()
        self.done_mark = self.clock.mark()


def two_hop_reduce_scatter(buffer: torch.Tensor, layout: TwoHopLayout, groups: NodeGroups,
                           compress_intra: Optional[Callable], compress_inter: Callable,
                           async_op: bool = True, average: bool = False, clock=None,
                           decompress: Callable = decompress_into,
                           gather_group=None, sequencer: Optional[Hop2Sequencer] = None,
                           workspace: Optional[Workspace] = None, ops: CollectiveOps = TORCH_OPS
                           ) -> tuple[TwoHopWork, int]:
    """Launch hop 1 of the two-hop reduce-scatter of flat ``buffer``; this rank's reduced
    shard lands in ``buffer``'s shard ``a*R + b`` (and, with ``gather_group`` - the whole
    data-parallel group, without the distributed optimizer - every reduced shard is
    then all-gathered at the buffer's dtype). Returns the handle and the payload bytes
    of hop 1 (hop 2's are known once it launches: ``handle.bytes_inter``). Hop 2 is
    issued by ``sequencer`` (see the module docstring); with ``async_op=False`` both
    hops are complete on return."""
    clock = clock or WallClock()
    ws = workspace or Workspace()
    R, n = layout.per_node, layout.nodes
    a, b = dist.get_rank(groups.inter), dist.get_rank(groups.intra)
    P, S = layout.flat.piece_padded, layout.flat.piece
    launch = clock.mark()
    if layout.intra is None:  # bf16, uncompressed, inside the node: [n, R, S] -> [R, n, S]
        rows = buffer.view(n, R, S) if layout.flat.divides else layout.flat.padded(buffer)[:, :S].view(n, R, S)
        # One pass converts and transposes (row b of send goes to local rank b). An
        # all-to-all and a sum here in fp32, in rank order, instead of a bf16
        # reduce-scatter: the sum is exact fp32 (a bf16 reduce-scatter rounds every
        # partial sum to bf16), deterministic, and it avoids gloo's reduce-scatter, which
        # costs more CPU than its all-to-all (docs/benchmarks.md, two-hop). Same
        # bytes on the wire per rank; the receive buffer holds R rows, not one.
        send = torch.empty((R, n, S), dtype=torch.bfloat16, device=buffer.device)
        send.copy_(rows.transpose(0, 1))
        recv = torch.empty_like(send)
        work = ops.all_to_all_single(recv.view(-1), send.view(-1), group=groups.intra, async_op=async_op)
        bytes_intra = (R - 1) * n * S * 2
        hop1_handed = send.numel() * 2
        scale = 1.0 / R if average else 1.0

        def finish_hop1():
            if work is not None:
                work.wait()
            result = ws.get("hop1", (n, P), buffer.device)
            result[:, S:].zero_()
            out = result[:, :S]
            out.copy_(recv[0])
            for r in range(1, R):
                out.add_(recv[r])  # fp32 += bf16: computed and rounded in fp32
            if scale != 1.0:
                out.mul_(scale)
            return result.view(-1), None
    else:
        hop1, sent = compressed_reduce_scatter(buffer, compress_intra, layout.intra, groups.intra,
                                               async_op=async_op, average=average, clock=clock,
                                               decompress=decompress, ops=ops, out=None)
        launch = hop1.launch_mark
        bytes_intra = sent * (R - 1) // R
        hop1_handed = sent

        def finish_hop1():
            # Written when hop 2 is issued and compressed right away: a shared scratch.
            hop1.set_output(ws.get("hop1", (layout.hop1_numel,), buffer.device))
            hop1.wait()
            return hop1.output, hop1.decompress_marks

    s0, s1 = layout.flat.row_range(a * R + b)
    mine = buffer[s0:s1]

    def start_hop2(result: torch.Tensor):
        work2, sent2 = compressed_reduce_scatter(result, compress_inter, layout.inter, groups.inter,
                                                 async_op=async_op, average=average, clock=clock,
                                                 decompress=decompress, out=mine, ops=ops)
        return work2, sent2 * (n - 1) // n, sent2

    gather = None
    if gather_group is not None:
        gather = lambda: gather_rows(buffer, mine, layout.flat, gather_group, ops)  # noqa: E731
    handle = TwoHopWork(finish_hop1, start_hop2, clock, launch, bytes_intra, sequencer or Hop2Sequencer(), gather,
                        hop1_handed)
    if not async_op:
        handle.wait()
    return handle, bytes_intra
