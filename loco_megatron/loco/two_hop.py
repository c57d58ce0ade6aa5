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
  uncompressed) leaves rank ``b`` the node's partial sums of those shards;
* **hop 2 (inter-node, slow link)**: a compressed reduce-scatter of that chunk over
  the ``n`` ranks with the same local index (``--loco-bits``, its own error state)
  leaves rank ``(a, b)`` the full sum of shard ``a*R + b``, copied into place.

Only hop 2 crosses nodes: ``(n-1)/n * N/R`` elements at ``--loco-bits``, instead of
``(W-R)/W * N`` at the gradient dtype. Hop 2 is launched as soon as hop 1 has
completed, checked whenever another bucket launches, or at the latest when the bucket
is waited on. Every rank must issue the hop-2 collectives in the same order, while
hop 1 may finish at different times on different ranks: a :class:`Hop2Sequencer`
launches them strictly in bucket launch order.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.loco.collectives import ShardLayout, compressed_reduce_scatter, decompress_into
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
    """Sizes of one bucket's two-hop reduce-scatter (``numel`` divisible by ``n*R``)."""

    def __init__(self, numel: int, nodes: int, per_node: int, intra_bits: int, inter_bits: int,
                 block_size: int):
        self.numel, self.nodes, self.per_node = numel, nodes, per_node
        self.shard = numel // (nodes * per_node)
        self.intra = None if intra_bits == 16 else ShardLayout(numel, per_node, intra_bits, block_size)
        self.inter = ShardLayout(numel // per_node, nodes, inter_bits, block_size)

    def node_major_to_local_major(self, flat: torch.Tensor) -> torch.Tensor:
        """``[n, R, S]`` -> contiguous ``[R, n, S]`` (a new fp32 tensor)."""
        return flat.view(self.nodes, self.per_node, self.shard).transpose(0, 1).contiguous().view(-1)


class Hop2Sequencer:
    """Launches the hop 2 of two-hop works in the order their hop 1 was launched (the
    same on every rank), never skipping ahead of one whose hop 1 is still in flight."""

    def __init__(self):
        self._queue: list["TwoHopWork"] = []

    def add(self, work: "TwoHopWork") -> None:
        self._queue.append(work)

    def advance(self, until: Optional["TwoHopWork"] = None) -> None:
        """Launch ready hop 2s in order (never blocking), or, with ``until``, every hop 2
        up to and including that work's (waiting for their hop 1 as needed)."""
        while self._queue:
            head = self._queue[0]
            must = until is not None and until in self._queue
            if not head._hop1_done(block=must):
                return
            head._launch_hop2()
            self._queue.pop(0)
            if head is until:
                return


class TwoHopWork:
    """Handle of an in-flight two-hop reduce-scatter; ``wait()`` completes it.

    ``launch_mark``/``done_mark`` and ``decompress_marks`` (hop 2's) as for
    :class:`CompressedReduceScatterWork`; ``extra_compress_marks`` holds the (start, end)
    marks of hop 2's compression (it happens after launch) and
    ``extra_decompress_marks`` hop 1's decompression. ``bytes_intra`` and
    ``bytes_inter``: what this rank sent on each hop to *other* ranks.
    """

    def __init__(self, hop1, scratch: torch.Tensor, start_hop2: Callable, out: torch.Tensor, clock,
                 launch_mark, bytes_intra: int, sequencer: Hop2Sequencer, gather: Optional[tuple] = None):
        self._hop1, self._scratch, self._start_hop2, self._out = hop1, scratch, start_hop2, out
        self._gather, self._sequencer = gather, sequencer
        sequencer.add(self)
        self._hop2 = None
        self.clock, self.launch_mark, self.done_mark = clock, launch_mark, None
        self.decompress_marks: Optional[tuple] = None
        self.extra_compress_marks: list[tuple] = []
        self.extra_decompress_marks: list[tuple] = []
        self.bytes_intra, self.bytes_inter = bytes_intra, 0

    def _hop1_done(self, block: bool) -> bool:
        if self._hop1 is None:
            return True
        if not block and hasattr(self._hop1, "is_completed") and not self._hop1.is_completed():
            return False
        if not block and not hasattr(self._hop1, "is_completed"):
            return False
        self._hop1.wait()
        if getattr(self._hop1, "decompress_marks", None) is not None:
            self.extra_decompress_marks.append(self._hop1.decompress_marks)
        self._hop1 = None
        return True

    def _launch_hop2(self) -> None:
        start = self.clock.mark()
        self._hop2, self.bytes_inter = self._start_hop2(self._scratch)
        self.extra_compress_marks.append((start, self._hop2.launch_mark))

    def wait(self) -> None:
        if self.done_mark is not None:
            return
        if self._hop2 is None:
            self._sequencer.advance(until=self)
        self._hop2.wait()
        self.decompress_marks = self._hop2.decompress_marks
        self._out.copy_(self._hop2.result)
        if self._gather is not None:
            buffer, group = self._gather
            dist.all_gather_into_tensor(buffer, self._out.clone(), group=group)
        self.done_mark = self.clock.mark()
        self._scratch = None


class _Hop1Handle:
    """hop 1 as a plain bf16 reduce-scatter (``--loco-intra-node-bits 16``)."""

    def __init__(self, work, recv_bf16: torch.Tensor, out: torch.Tensor, scale: float):
        self._work, self._recv, self._out, self._scale = work, recv_bf16, out, scale

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        self._out.copy_(self._recv.float() * self._scale)


def two_hop_reduce_scatter(buffer: torch.Tensor, layout: TwoHopLayout, groups: NodeGroups,
                           compress_intra: Optional[Callable], compress_inter: Callable,
                           async_op: bool = True, average: bool = False, clock=None,
                           decompress: Callable = decompress_into,
                           gather_group=None, sequencer: Optional[Hop2Sequencer] = None
                           ) -> tuple[TwoHopWork, int]:
    """Launch the two-hop reduce-scatter of flat ``buffer``; this rank's reduced shard
    lands in ``buffer``'s shard ``a*R + b`` (and, with ``gather_group`` - the whole
    data-parallel group, without the distributed optimizer - every reduced shard is
    then all-gathered at the buffer's dtype). Returns the handle and the payload bytes
    of hop 1 (hop 2's are known once it launches: ``handle.bytes_inter``). Works that
    share a ``sequencer`` launch their hop 2 in the order they were created."""
    clock = clock or WallClock()
    R, n = layout.per_node, layout.nodes
    a, b = dist.get_rank(groups.inter), dist.get_rank(groups.intra)
    # Transient fp32 copy in local-major order: chunk b = the n shards local rank b owns.
    scratch = layout.node_major_to_local_major(buffer.float() if buffer.dtype != torch.float32 else buffer)
    chunk = scratch.view(R, n * layout.shard)[b]
    launch = clock.mark()
    if layout.intra is None:  # bf16, uncompressed, inside the node
        send = scratch.to(torch.bfloat16)
        recv = torch.empty(n * layout.shard, dtype=torch.bfloat16, device=buffer.device)
        work = dist.reduce_scatter_tensor(recv, send, group=groups.intra, async_op=async_op)
        hop1 = _Hop1Handle(work, recv, chunk, 1.0 / R if average else 1.0)
        bytes_intra = (R - 1) * recv.numel() * 2
        if not async_op:
            hop1.wait()
            hop1 = None
    else:
        hop1, sent = compressed_reduce_scatter(scratch, compress_intra, layout.intra, groups.intra,
                                               async_op=async_op, average=average, clock=clock,
                                               decompress=decompress)
        launch = hop1.launch_mark
        bytes_intra = sent * (R - 1) // R

    def start_hop2(scratch_: torch.Tensor):
        part = scratch_.view(R, n * layout.shard)[b]
        work2, sent2 = compressed_reduce_scatter(part, compress_inter, layout.inter, groups.inter,
                                                 async_op=async_op, average=average, clock=clock,
                                                 decompress=decompress)
        work2.result = part.view(n, layout.shard)[a]
        return work2, sent2 * (n - 1) // n

    out = buffer.view(n * R, layout.shard)[a * R + b]
    handle = TwoHopWork(hop1, scratch, start_hop2, out, clock, launch, bytes_intra, sequencer or Hop2Sequencer(),
                        gather=(buffer, gather_group) if gather_group is not None else None)
    if not async_op:
        handle.wait()
    return handle, bytes_intra
