"""Elastic DiLoCo's lanes (loco_megatron/diloco/elastic/lanes.py): the layout-independent partition
of the model the outer state lives in, and the mover between a replica's shards and its
lanes, on 3 real gloo ranks against the plain model-space tensors."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from conftest import spawn_ranks
from loco_megatron.diloco.elastic.lanes import LaneMover, Space, check_cover, hosts, intersect, shard_blocks

# The model: A [6, 4] split over two "TP" ranks along axis 1, B [5] replicated on both (main
# on TP rank 0), C [3, 2, 2] on a third rank ("another stage") split by "DP" into two flat
# ranges held by ranks 2 and 0.
SHAPES = {"A": (6, 4), "B": (5,), "C": (3, 2, 2)}


def _global(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _local(rank: int, model: dict[str, torch.Tensor]):
    """This rank's [(ShardedTensor, start, end, 1-D main view)] and the views' owner tensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = []
    if rank in (0, 1):
        a = model["A"][:, 2 * rank:2 * rank + 2].contiguous()
        out.append((ShardedTensor.from_rank_offsets("A", a, (1, rank, 2), replica_id=(0, 0, 0)), 0, a.numel(), a))
        b = model["B"].clone()
        out.append((ShardedTensor.from_rank_offsets("B", b, replica_id=(0, rank, 0)), 0, 5, b))
    c = model["C"].clone()
    if rank == 2:
        out.append((ShardedTensor.from_rank_offsets("C", c, replica_id=(0, 0, 0)), 0, 7, c))
    if rank == 0:
        out.append((ShardedTensor.from_rank_offsets("C", c, replica_id=(0, 0, 1)), 7, 12, c))
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for lanes in (1, 2, 3):
            _check(rank, world, lanes, queue)
    finally:
        dist.destroy_process_group()


def _check(rank: int, world: int, lanes: int, queue) -> None:
    model = _global(0)
    local = _local(rank, model)
    mine = []
    for sh, start, end, owner in local:
        view = owner.view(-1)[start:end]
        mine += shard_blocks(sh, start, end, view, 0)
    table = [None] * world
    dist.all_gather_object(table, [b.describe() for b, _ in mine])
    space = Space(SHAPES, lanes)
    check_cover(space, table, 0)
    mover = LaneMover(space, 0, table, mine, rank, dist.all_to_all_single, torch.device("cpu"))
    canonical = torch.cat([model[k].reshape(-1) for k in space.keys])
    lane = torch.full((mover.numel,), float("nan"))
    mover.gather(lane)
    expected = canonical[slice(*space.lane(mover.lane))] if mover.lane is not None else torch.empty(0)
    gathered = torch.equal(lane, expected)
    # scatter a new model: every copy (B on both TP ranks) must take it, bit for bit
    new = _global(1)
    new_canonical = torch.cat([new[k].reshape(-1) for k in space.keys])
    mover.scatter(new_canonical[slice(*space.lane(mover.lane))].clone() if mover.lane is not None
                  else torch.empty(0))
    want = _local(rank, new)
    scattered = all(torch.equal(o.view(-1)[s:e], w.view(-1)[s:e])
                    for (_, s, e, o), (_, _, _, w) in zip(local, want))
    # alpha 0.5 mixes: local <- 0.5 local + 0.5 lane
    mover.scatter(torch.zeros(mover.numel), 0.5)
    halved = all(torch.equal(o.view(-1)[s:e], w.view(-1)[s:e] * 0.5)
                 for (_, s, e, o), (_, _, _, w) in zip(local, want))
    queue.put((lanes, rank, mover.lane, gathered, scattered, halved))


def test_lanes_gather_main_copies_and_scatter_to_every_copy():
    """Guards against a lane holding elements in another order than the canonical one (the
    replicas of different layouts would exchange mismatched elements), a gather reading a
    replicated copy twice or the tied/replicated copy instead of the main one, a scatter
    that misses a copy (the TP ranks' replicated parameters would drift apart) or writes
    outside a rank's shard, and lanes hosted on the wrong ranks: 3 gloo ranks holding a
    TP-split, a replicated and a DP-split tensor, L = 1, 2 and 3."""
    results = sorted(spawn_ranks(_worker, 3, 9), key=lambda x: (x[0], x[1]))
    for lanes in (1, 2, 3):
        mine = [r for r in results if r[0] == lanes]
        assert [lane for _, _, lane, *_ in mine] == [hosts(3, lanes).index(r) if r in hosts(3, lanes) else None
                                                     for r in range(3)], mine
        assert all(g and s and h for *_, g, s, h in mine), mine


def test_a_lane_partition_tiles_the_space_and_blocks_intersect_exactly():
    """Guards against lanes that overlap or leave elements out (an element exchanged twice
    or never), and against a box intersection off by one at the edges."""
    space = Space({"x": (7, 3), "a": (4,), "z": (2, 5)}, 4)
    assert space.keys == ["a", "x", "z"] and space.numel == 4 + 21 + 10
    spans = [space.lane(j) for j in range(4)]
    assert spans[0][0] == 0 and spans[-1][1] == space.numel and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for j in range(4):
        held = sum(math.prod(shape) for k in space.keys for _, shape in space.lane_boxes(k, j))
        assert held == spans[j][1] - spans[j][0]
    assert intersect(((0, 0), (2, 3)), ((1, 2), (5, 5))) == ((1, 2), (1, 1))
    assert intersect(((0, 0), (2, 3)), ((2, 0), (1, 3))) is None
    with pytest.raises(ValueError, match="main copies hold"):
        check_cover(Space({"x": (2, 2)}, 1), [[("x", (2, 2), (0, 0), (1, 2), True, 0)]], 0)


def test_a_fragment_holds_the_rows_of_its_layers_in_a_stacked_tensor():
    """Guards against Streaming DiLoCo across sites crashing at start-up: megatron stacks a
    parameter of every layer in one tensor (a leading layer axis), a fragment is a range of
    layers, and each fragment's space claimed the whole stacked tensor ("the replica's main
    copies hold 256 of the 512 elements"). Each fragment's space now holds the rows of its
    layers, in global coordinates: the two fragments' lanes cover the stacked tensor once,
    a TP-split weight (its columns on two ranks) included."""
    stack, w = (4, 6), (4, 2, 6)  # a layer norm weight of 4 layers; a [2, 6] weight per layer, TP-split
    table = [  # rank 0: layers 1-2 (fragment 0) and the left half of w's columns; rank 1 the right half
        [("ln", stack, (0, 0), (2, 6), True, 0), ("w", w, (0, 0, 0), (2, 2, 3), True, 0),
         ("ln", stack, (2, 0), (2, 6), True, 1), ("w", w, (2, 0, 0), (2, 2, 3), True, 1)],
        [("ln", stack, (0, 0), (2, 6), False, 0), ("w", w, (0, 0, 3), (2, 2, 3), True, 0),
         ("ln", stack, (2, 0), (2, 6), False, 1), ("w", w, (2, 0, 3), (2, 2, 3), True, 1)],
    ]
    covered = {}
    for f in (0, 1):
        space = Space.of_blocks(table, f, 3)
        check_cover(space, table, f)
        assert space.shapes == {"ln": (2, 6), "w": (2, 2, 6)} and space.origins["ln"] == (2 * f, 0)
        for j in range(3):
            for key, global_shape, origin, shape, _ in space.lane_blocks(j):
                assert global_shape == {"ln": stack, "w": w}[key] and origin[0] in (2 * f, 2 * f + 1)
                covered[key] = covered.get(key, 0) + math.prod(shape)
        buf = torch.arange(float(space.numel))
        view = space.lane_view(buf[slice(*space.lane(0))], 0, "ln", ((2 * f, 0), (1, 6)))
        assert view.tolist() == [[float(x) for x in range(6)]]  # ("ln" sorts first: the lane's first row)
    assert covered == {"ln": 24, "w": 48}
    with pytest.raises(ValueError, match="hold 12 of the 24 elements of ln in fragment 0"):
        check_cover(Space({"ln": stack, "w": w}, 3), table, 0)  # (the whole stack: the crash)


def test_lane_pieces_are_the_lane_in_order_as_runs_of_each_box():
    """Guards against SparseLoCo's chunks of a lane cut by other shapes or offsets than the
    lane holds (a tile would mix rows of two tensors, or of another fragment's layers): a
    lane's pieces are its elements in lane order, each a run of one key's box (its shape,
    e.g. a fragment's rows of a stacked tensor), starting where the lane enters the box."""
    space = Space({"x": ((8, 6), (2, 0), (4, 6)), "a": (5,), "z": (3, 4)}, 3)
    assert space.keys == ["a", "x", "z"] and space.numel == 5 + 24 + 12
    for j in range(3):
        lo, hi = space.lane(j)
        pieces = space.lane_pieces(j)
        assert sum(n for n, _, _ in pieces) == hi - lo
        at = lo
        for n, shape, start in pieces:
            key = next(k for k in space.keys if space.shapes[k] == shape)
            assert space.base[key] + start == at and start + n <= math.prod(shape)
            at += n
    assert space.lane_pieces(1) == [(14, (4, 6), 8)]
    assert space.lane_pieces(2) == [(2, (4, 6), 22), (12, (3, 4), 0)]
