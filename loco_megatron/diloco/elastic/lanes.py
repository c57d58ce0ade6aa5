"""Lanes: elastic DiLoCo's outer state in a layout-independent partition of the model.

A replica's ranks hold the fp32 main parameters as its TP x PP x DP layout shards them
(each rank a flattened range of each local parameter: :mod:`loco_megatron.checkpoint.model_space`
maps such a range to rectangular *blocks* of the global, model-space tensor). Replicas of
different layouts therefore hold different elements on "rank k", so they cannot exchange
rank by rank. Instead, per fragment, the model's parameters are laid end to end in a
canonical order (model keys sorted; each key's box row-major: the whole global tensor, or
the rows of the fragment's layers where megatron stacks the layers in one tensor), giving a
space of ``N`` elements that depends on the model and the fragments alone; lane ``j`` of ``L``
(--diloco-outer-ranks) is elements ``j*N//L ... (j+1)*N//L - 1``, hosted by rank
``j * (W // L)`` of each replica's ``W`` ranks. Lane hosts exchange with the same lane
of the other replicas; the agreed parameters, momentum and error buffers live there.

:class:`LaneMover` moves one fragment between the shards and the lanes in one
``all_to_all_single`` over the replica's own ranks: *gather* reads each element from its
main copy (a parameter replicated over TP, or the tied output-layer copy of the word
embedding, has several; megatron's replica ids say which one is main), *scatter* writes
it to every copy (so tied and replicated copies stay bit-identical). Every rank of the
replica takes part in both, host or not, at the same program points.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator, Optional

import torch

from loco_megatron.checkpoint.model_space import row_major_blocks, sharded_parts
from loco_megatron.diloco.outer_math import mix_into, outer_gradient


@dataclasses.dataclass(frozen=True)
class Block:
    """A rectangular block of one model tensor held by one rank (global coordinates)."""

    key: str
    global_shape: tuple
    origin: tuple
    shape: tuple
    main: bool
    """The copy gathers read (every element has exactly one main copy in a replica)."""
    fragment: int

    def describe(self) -> tuple:  # (what other ranks learn of it)
        return self.key, self.global_shape, self.origin, self.shape, self.main, self.fragment


@dataclasses.dataclass(frozen=True)
class Local:
    """Where a :class:`Block` of this rank lies in its shard: ``view`` (the 1-D fp32 main
    shard of one parameter), the position of the block's origin element in it, and the
    strides of the block's axes there (row-major of the local parameter; 0 on axes of one)."""

    view: torch.Tensor
    pos: int
    strides: tuple


def shard_blocks(sh, start: int, end: int, view: torch.Tensor, fragment: int) -> list[tuple[Block, Local]]:
    """The blocks of elements [start, end) of a local parameter whose model-space
    ShardedTensor is ``sh`` (megatron's ``sharded_state_dict()`` entry) and whose fp32 main
    shard is ``view`` (those elements, 1-D), with where each lies in ``view``."""

    out = []
    for part, base in sharded_parts(sh):
        lo, hi = max(start, base), min(end, base + math.prod(part.local_shape))
        p = part.prepend_axis_num
        rid = part.replica_id
        # megatron's replica id: (copy of another stage's tensor, TP replica, DP rank); the
        # DP coordinate does not matter here (DP ranks hold distinct elements of a shard).
        main = all(r == 0 for r in rid[:-1]) if isinstance(rid, tuple) else True
        strides = (0,) * p + row_major(tuple(part.local_shape))
        for off, shape, flat in row_major_blocks(tuple(part.local_shape), lo - base, hi - base):
            origin = tuple(part.global_offset[:p]) + tuple(g + o for g, o in zip(part.global_offset[p:], off))
            out.append((Block(part.key, tuple(part.global_shape), origin, (1,) * p + tuple(shape), main, fragment),
                        Local(view, base + flat - start, strides)))
    return out


def row_major(shape: tuple) -> tuple:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def hosts(world: int, lanes: int) -> list[int]:
    """The rank hosting each lane in a replica of ``world`` ranks."""
    return [j * (world // lanes) for j in range(lanes)]


def blocks(shape: tuple, start: int, end: int) -> Iterator[tuple[tuple, tuple]]:
    """Rectangular (origin, shape) blocks covering flat elements [start, end) of a row-major
    ``shape``, in flat order (at most two per axis)."""
    for origin, shp, _ in row_major_blocks(tuple(shape), start, end):
        yield origin, shp


def intersect(a: tuple[tuple, tuple], b: tuple[tuple, tuple]) -> Optional[tuple[tuple, tuple]]:
    """The intersection of two (origin, shape) boxes, None when empty."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


class Space:
    """One fragment's canonical space: per model key (sorted) the box of its global tensor
    the fragment holds (all of it, or, for the layers megatron stacks into one tensor, the
    rows of the fragment's layers), laid end to end, each box row-major.

    ``boxes``: key -> ``(global shape, origin, shape)`` of the box in the global tensor;
    a key -> shape entry means the whole tensor."""

    def __init__(self, boxes: dict, lanes: int):
        self.keys = sorted(boxes)
        self.global_shapes, self.origins, self.shapes = {}, {}, {}
        for k in self.keys:
            box = boxes[k]
            if box and isinstance(box[0], tuple):
                g, o, shp = (tuple(x) for x in box)
            else:  # the whole tensor
                g, o, shp = tuple(box), (0,) * len(box), tuple(box)
            self.global_shapes[k], self.origins[k], self.shapes[k] = g, o, shp
        self.base, at = {}, 0
        for k in self.keys:
            self.base[k] = at
            at += math.prod(self.shapes[k])
        self.numel, self.lanes = at, lanes

    @classmethod
    def of_blocks(cls, table: list[list[tuple]], fragment: int, lanes: int) -> "Space":
        """The space of ``fragment`` from every rank's blocks (``table``: per rank its
        :meth:`Block.describe` list): per key the bounding box of the fragment's blocks
        (every copy's, main or not). ValueError when a key's global shape differs between
        ranks."""
        seen: dict[str, tuple] = {}
        for rank_blocks in table:
            for key, global_shape, origin, shape, _, f in rank_blocks:
                if f != fragment:
                    continue
                if key in seen:
                    g, lo, hi = seen[key]
                    if g != tuple(global_shape):
                        raise ValueError(f"DiLoCo lanes: {key} has shapes {tuple(global_shape)} and {g} on "
                                         "different ranks")
                    seen[key] = (g, tuple(map(min, lo, origin)),
                                 tuple(max(h, o + n) for h, o, n in zip(hi, origin, shape)))
                else:
                    seen[key] = (tuple(global_shape), tuple(origin), tuple(o + n for o, n in zip(origin, shape)))
        return cls({k: (g, lo, tuple(h - l for l, h in zip(lo, hi))) for k, (g, lo, hi) in seen.items()}, lanes)

    def lane(self, j: int) -> tuple[int, int]:
        """Lane ``j``'s element range [lo, hi)."""
        return j * self.numel // self.lanes, (j + 1) * self.numel // self.lanes

    def _range(self, key: str, j: int) -> tuple[int, int]:
        """The part [a, b) of ``key``'s box (flat, row-major in the box) in lane ``j``."""
        lo, hi = self.lane(j)
        base, size = self.base[key], math.prod(self.shapes[key])
        return max(lo - base, 0), min(hi - base, size)

    def lane_pieces(self, j: int) -> list[tuple[int, tuple, int]]:
        """Lane ``j`` as runs of the keys' boxes, in lane order: ``(length, box shape, start)``
        each, elements ``[start, start + length)`` of the key's box, row-major (what
        SparseLoCo's chunks are cut by, :mod:`loco_megatron.diloco.sparse.chunks`)."""
        out = []
        for k in self.keys:
            a, b = self._range(k, j)
            if a < b:
                out.append((b - a, self.shapes[k], a))
        return out

    def lane_boxes(self, key: str, j: int) -> list[tuple[tuple, tuple]]:
        """The boxes of ``key``'s global tensor that lane ``j`` holds (global coordinates),
        in flat order."""
        a, b = self._range(key, j)
        origin = self.origins[key]
        return [(tuple(o + x for o, x in zip(origin, off)), shape)
                for off, shape, _ in row_major_blocks(self.shapes[key], a, b)] if a < b else []

    def lane_blocks(self, j: int) -> list[tuple]:
        """``(key, global shape, origin, shape, offset in the lane)`` of every block lane ``j``
        holds, in lane order (each block a contiguous run of the lane; global coordinates)."""
        lo = self.lane(j)[0]
        out = []
        for k in self.keys:
            a, b = self._range(k, j)
            origin = self.origins[k]
            for off, shape, flat in (row_major_blocks(self.shapes[k], a, b) if a < b else ()):
                out.append((k, self.global_shapes[k], tuple(o + x for o, x in zip(origin, off)), shape,
                            self.base[k] + flat - lo))
        return out

    def lane_view(self, buf: torch.Tensor, j: int, key: str, box: tuple[tuple, tuple]) -> torch.Tensor:
        """The elements of ``box`` (of ``key``, global coordinates) in ``buf``, lane ``j``'s
        flat buffer."""
        strides = row_major(self.shapes[key])
        at = self.base[key] - self.lane(j)[0] + sum((o - b) * s for o, b, s in zip(box[0], self.origins[key], strides))
        return torch.as_strided(buf, box[1], strides, buf.storage_offset() + at)

    def signature(self) -> list:
        return [(k, self.global_shapes[k], self.origins[k], self.shapes[k]) for k in self.keys]


def check_cover(space: Space, table: list[list[tuple]], fragment: int) -> None:
    """ValueError unless the main blocks of every rank (``table``: per rank, its blocks'
    :meth:`Block.describe`) hold each element of the fragment's space exactly once by count."""
    held = dict.fromkeys(space.keys, 0)
    for rank_blocks in table:
        for key, _, _, shape, main, f in rank_blocks:
            if main and f == fragment:
                held[key] += math.prod(shape)
    wrong = [k for k in space.keys if held[k] != math.prod(space.shapes[k])]
    if wrong:
        raise ValueError(f"DiLoCo lanes: the replica's main copies hold {held[wrong[0]]} of the "
                         f"{math.prod(space.shapes[wrong[0]])} elements of {wrong[0]} in fragment {fragment} "
                         "(a layout the lanes do not map)")


class LaneMover:
    """Moves one fragment between this rank's shards and the lanes of its replica (see the
    module docstring). ``table``: per rank of the replica, its blocks (:meth:`Block.describe`,
    the same list on every rank); ``mine``: this rank's blocks with where they lie
    (:class:`Local`), in the order of ``table[rank]``; ``all_to_all(output, input, output
    splits, input splits)``: torch's ``all_to_all_single`` over the replica's ranks."""

    def __init__(self, space: Space, fragment: int, table: list[list[tuple]], mine: list[tuple[Block, Local]],
                 rank: int, all_to_all: Callable, device: torch.device):
        self.space, self.rank, self._all_to_all, self.device = space, rank, all_to_all, device
        world = len(table)
        self.hosts = hosts(world, space.lanes)
        self.lane = self.hosts.index(rank) if rank in self.hosts else None
        """The lane this rank hosts, or None."""
        self.numel = (lambda lo, hi: hi - lo)(*space.lane(self.lane)) if self.lane is not None else 0

        def pieces(described: list[tuple], main_only: bool, j: int) -> list[tuple[int, str, tuple]]:
            """(block index, key, sub-box) of one rank's blocks in lane ``j``, in a fixed order."""
            out = []
            for i, (key, _, origin, shape, main, f) in enumerate(described):
                if f != fragment or (main_only and not main):
                    continue
                for box in space.lane_boxes(key, j):
                    sub = intersect((origin, shape), box)
                    if sub is not None:
                        out.append((i, key, sub))
            return out

        def local_view(i: int, sub: tuple) -> torch.Tensor:
            block, where = mine[i]
            at = where.pos + sum((o - b) * s for o, b, s in zip(sub[0], block.origin, where.strides))
            return torch.as_strided(where.view, sub[1], where.strides, where.view.storage_offset() + at)

        # gather: my main pieces to each lane's host; as a host, every rank's main pieces of my lane
        self._gather_send = [[local_view(i, sub) for i, _, sub in pieces(table[rank], True, j)]
                             for j in range(space.lanes)]
        self._gather_recv = [[(key, sub) for _, key, sub in pieces(table[s], True, self.lane)]
                             if self.lane is not None else [] for s in range(world)]
        # scatter: as a host, every rank's pieces (every copy) of my lane; mine from each lane
        self._scatter_send = [[(key, sub) for _, key, sub in pieces(table[s], False, self.lane)]
                              if self.lane is not None else [] for s in range(world)]
        self._scatter_recv = [[local_view(i, sub) for i, _, sub in pieces(table[rank], False, j)]
                              for j in range(space.lanes)]
        self.world = world

    @staticmethod
    def _count(pieces: list[tuple[str, tuple]]) -> int:
        """Elements of ``(key, box)`` pieces."""
        return sum(math.prod(box[1]) for _, box in pieces)

    def _exchange(self, send_parts: list[list[torch.Tensor]], recv_counts: list[int]) -> torch.Tensor:
        sizes = [sum(p.numel() for p in parts) for parts in send_parts]
        flat = [p.reshape(-1) for parts in send_parts for p in parts]
        send = torch.cat(flat) if flat else torch.empty(0, dtype=torch.float32, device=self.device)
        recv = torch.empty(sum(recv_counts), dtype=torch.float32, device=self.device)
        self._all_to_all(recv, send, recv_counts, sizes)
        return recv

    def gather(self, out: torch.Tensor) -> None:
        """``out`` (this rank's lane, ``[numel]``; empty off hosts) <- the replica's main copies."""
        send = [[] for _ in range(self.world)]
        for j, host in enumerate(self.hosts):
            send[host] = self._gather_send[j]
        recv = self._exchange(send, [self._count(parts) for parts in self._gather_recv])
        at = 0
        for parts in self._gather_recv:
            for key, sub in parts:
                n = math.prod(sub[1])
                self.space.lane_view(out, self.lane, key, sub).copy_(recv[at:at + n].view(sub[1]))
                at += n

    def scatter(self, lane: torch.Tensor, alpha: float = 0.0) -> None:
        """Every copy on every rank <- ``alpha * copy + (1 - alpha) * lane`` (``lane``: this
        rank's lane, empty off hosts; alpha 0 copies, bit for bit)."""
        send = [[self.space.lane_view(lane, self.lane, key, sub) for key, sub in parts]
                for parts in self._scatter_send]
        counts = [0] * self.world
        for j, host in enumerate(self.hosts):
            counts[host] = sum(v.numel() for v in self._scatter_recv[j])
        recv = self._exchange(send, counts)
        at, by_host = 0, {}
        for s in range(self.world):  # the received segments come in rank order
            by_host[s] = at
            at += counts[s]
        for j, host in enumerate(self.hosts):
            at = by_host[host]
            for view in self._scatter_recv[j]:
                n = view.numel()
                mix_into(view, recv[at:at + n].view(view.shape), alpha)
                at += n


class LaneViews:
    """:class:`~.outer.ShardViews`' interface over a lane: ``numel`` (this rank's lane; 0
    off hosts); ``read``, ``outer_gradient`` and ``take`` are collectives over the replica
    (every rank, the same order)."""

    def __init__(self, mover: LaneMover):
        self.mover, self.numel, self.device = mover, mover.numel, mover.device
        self.slices = None

    def read(self, out: torch.Tensor) -> None:
        self.mover.gather(out)

    def outer_gradient(self, agreed: torch.Tensor, out: torch.Tensor) -> None:
        self.mover.gather(out)
        outer_gradient(agreed, out, out)

    def take(self, agreed: torch.Tensor, alpha: float) -> None:
        self.mover.scatter(agreed, alpha)

    def signature(self) -> list:
        """The lane (a per-rank checkpoint of its error buffers fits the same lane only)."""
        return [self.mover.lane, self.mover.space.lanes, self.mover.space.signature() if self.mover.lane is not None
                else None]


class NoLane:
    """The exchange of a rank that hosts no lane (or an empty one): nothing to send. Its
    ``start`` gives back the (empty) outer gradient as the settled mean."""

    comp1 = None
    mean_over = 1
    rank = 0

    def __init__(self, world: Optional[int] = None):
        pass  # (laid for any number of replicas: it sends nothing)

    def start(self, delta: torch.Tensor) -> torch.Tensor:
        return delta

    def uncompressed_bytes(self) -> int:
        return 0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def reset(self) -> None:
        pass
