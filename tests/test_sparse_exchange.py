"""SparseLoCo's exchange (loco_megatron/diloco/sparse/channel.py) on 2 and 3 real gloo ranks,
against the same mean computed with plain torch collectives here."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from loco_megatron.diloco.exchange import OuterChannel
from loco_megatron.diloco.outer import OuterStep, ShardViews
from loco_megatron.diloco.schedule import FragmentSchedule
from loco_megatron.diloco.sparse.channel import SparseChannel
from loco_megatron.diloco.sparse.chunks import ChunkPlan
from loco_megatron.diloco.sparse.codec import chosen_counts_, scatter_add_
from conftest import spawn_ranks

PIECES = [(37, (37,), 0), (16 * 24, (16, 24), 0), (2 * 96 + 12, (16, 24), 91)]
NUMEL = sum(n for n, _, _ in PIECES)
K, CHUNK, BETA = 3, 16, 0.9


def _reference_sum(entries, world: int) -> torch.Tensor:
    """Each rank's decoded entries as a dense fp32 vector, all-gathered with plain torch and
    summed in rank order."""
    mine = torch.zeros(NUMEL)
    scatter_add_(mine, entries)
    rows = [torch.empty(NUMEL) for _ in range(world)]
    dist.all_gather(rows, mine)
    out = torch.zeros(NUMEL)
    for r in rows:
        out += r
    return out


def _exchanges(rank: int, world: int, bits: int, mean: str, weighted: bool = False) -> dict:
    """Four exchanges of this rank's deltas (rank 1 sends zeros at the third, its buffer
    emptied: a replica that just healed), against the reference. ``weighted``: each rank's
    delta scaled by its weight (0.5, 1.5, 1.0: unequal sites' samples), which the mean over
    an entry's senders renormalises by."""
    plan = ChunkPlan(PIECES, CHUNK)
    channel = SparseChannel(plan, None, K, bits, beta=BETA, name=f"t{bits}", mean=mean)
    twin = SparseChannel(plan, None, K, bits, beta=BETA, name="twin")  # the same compressor, driven by hand
    weight = (0.5, 1.5, 1.0)[rank] if weighted else 1.0
    channel.weight = weight
    got, want = [], []
    for step in range(4):
        delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * rank + step)) * weight
        if rank == 1 and step == 2:
            delta.zero_()  # (with an empty error buffer it sends zeros)
            twin.reset()
            channel.reset()
        _, entries = twin.compressor.compress(delta.clone())
        reference = _reference_sum(entries, world)
        if mean == "all":
            reference /= world
        else:  # per entry: the weights of the ranks that sent it a non-zero value
            counts = torch.zeros(NUMEL)
            chosen_counts_(counts, entries)
            counts *= weight
            dist.all_reduce(counts)
            reference = torch.where(counts > 0, reference / torch.where(counts > 0, counts, 1.0), 0.0)
        work = channel.start(delta)
        work.second_phase()
        work.wait()
        assert bool(work.finite)
        got.append(delta.clone())
        want.append(reference)
    return {"got": got, "want": want, "bytes": channel.bytes_to_others(), "payload": channel.layout.nbytes,
            "errors": torch.equal(channel.compressor.error, twin.compressor.error)}


def _outer_run(rank: int) -> dict:
    """An OuterStep over two sparse channels (a 2-D weight's tiles, a bias), SGD at lr 1
    as SparseLoCo's: the agreed parameters after every outer step, and finish()'s effect on
    the error buffers."""
    w = torch.randn(16 * 24, generator=torch.Generator().manual_seed(9))
    b = torch.randn(37, generator=torch.Generator().manual_seed(10))
    channels = {"opt0.fragment0": (ShardViews([w, b], [(torch.zeros(16, 24), 0, 384), (torch.zeros(37), 0, 37)]),
                                   SparseChannel(ChunkPlan([(384, (16, 24), 0), (37, (37,), 0)], CHUNK), None, K, 2),
                                   0, 0)}
    outer = OuterStep(channels, FragmentSchedule(2, 1, 0), 1.0, 0.0, 0.0, lambda update: update(0),
                      lambda work: None, lambda: None, print)
    agreed = []
    for t in range(1, 7):
        g = torch.Generator().manual_seed(1000 * rank + t)
        w.sub_(0.01 * torch.randn(384, generator=g))
        b.sub_(0.01 * torch.randn(37, generator=g))
        outer.after_step(t)
        if t % 2 == 0:
            agreed.append(outer.agreed["opt0.fragment0"].clone())
    channel = channels["opt0.fragment0"][1]
    before = channel.compressor.error.clone()
    w.sub_(0.01)
    outer.finish(7)
    return {"agreed": agreed, "kept": torch.equal(channel.compressor.error, before),
            "final": outer.final["opt0.fragment0"].clone()}


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {(bits, mean): _exchanges(rank, world, bits, mean)
               for bits, mean in ((2, "all"), (4, "all"), (8, "all"), (0, "all"), (2, "chosen"), (0, "chosen"))}
        out[2, "chosen-weighted"] = _exchanges(rank, world, 2, "chosen", weighted=True)
        queue.put(_by_value((rank, out, _outer_run(rank))))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _by_value(obj, back: bool = False):
    """``obj`` with its tensors as numpy arrays (a queue then carries them by value: a
    tensor's shared memory is gone once its process exits), or (``back``) the reverse."""
    if isinstance(obj, dict):
        return {k: _by_value(v, back) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_by_value(v, back) for v in obj)
    if back:
        return torch.from_numpy(obj) if hasattr(obj, "dtype") and not isinstance(obj, torch.Tensor) else obj
    return obj.numpy() if isinstance(obj, torch.Tensor) else obj


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    world = request.param
    got = [_by_value(item, back=True) for item in spawn_ranks(_worker, world, world)]
    return world, {rank: (out, run) for rank, out, run in got}


def test_the_mean_is_the_torch_reference_bit_for_bit_on_every_rank(results):
    """Guards against a sparse mean that differs from the decoded payloads summed in rank
    order and divided by every replica ("all", like the dense mean) or per entry by the
    weights of the replicas that sent it a non-zero value ("chosen": a replica sending zeros
    does not count, unequal sites' weights renormalise), against ranks holding different means
    (a sum in another order, a rank decoding its own payload differently from the others),
    and against the channel's error buffer drifting from the compressor's own step (at 2, 4,
    8 bits and fp32 values)."""
    world, res = results
    for form in res[0][0]:
        for rank in range(world):
            out = res[rank][0][form]
            assert out["errors"], form
            for got, want in zip(out["got"], out["want"]):
                assert _same_bits(got, want), (form, rank)
        for step in range(4):
            firsts = [res[r][0][form]["got"][step] for r in range(world)]
            assert all(_same_bits(firsts[0], f) for f in firsts[1:]), form
            assert firsts[0].any()


def test_bytes_are_the_payload_to_each_other_rank(results):
    """Guards against the sparse exchange's bytes counted as the dense ones (or without the
    bin tables), which the metrics and the run summary's ratio report."""
    world, res = results
    for out in res[0][0].values():
        assert out["bytes"] == (world - 1) * out["payload"]
    plan = ChunkPlan(PIECES, CHUNK)
    assert res[0][0][2, "all"]["payload"] == (4 + -(-plan.chunks * K * 4 // 32) * 4  # weight, 4-bit indices
                                              + -(-plan.chunks * K * 2 // 32) * 4 + plan.groups * 4 * 4)


def test_outer_step_on_sparse_channels_agrees_and_finish_keeps_the_error_buffers(results):
    """Guards against replicas whose agreed parameters differ after a sparse outer step, and
    against finish() (the run's final outer step) leaving its exchange in the error buffers
    (a resume from the final checkpoint would send it twice)."""
    world, res = results
    runs = [res[r][1] for r in range(world)]
    for r in runs:
        assert r["kept"]
        assert all(_same_bits(a, b) for a, b in zip(r["agreed"], runs[0]["agreed"]))
        assert _same_bits(r["final"], runs[0]["final"])
    assert not torch.equal(runs[0]["agreed"][0], runs[0]["agreed"][1])


def test_states_of_the_other_form_are_refused_in_one_line():
    """Guards against a dense exchange's error buffers loading into a sparse channel (or the
    reverse) by crashing (KeyError) instead of a ValueError the outer step turns into its
    one line "the outer error buffers start at zero"."""
    plan = ChunkPlan(PIECES, CHUNK)
    sparse = SparseChannel(plan, None, K, 2, world=2, ops=_LocalOps())
    dense = OuterChannel(NUMEL, None, 2, 16, world=2, ops=_LocalOps(), stream_rank=0)
    with pytest.raises(ValueError, match="dense outer exchange"):
        sparse.load_state_dict(dense.state_dict())
    with pytest.raises(ValueError, match="SparseLoCo"):
        dense.load_state_dict(sparse.state_dict())
    other = SparseChannel(plan, None, K + 1, 2, world=2, ops=_LocalOps())
    with pytest.raises(ValueError, match="top 3 of 16"):
        other.load_state_dict(sparse.state_dict())
    sparse.compressor.error.fill_(0.5)
    again = SparseChannel(plan, None, K, 2, world=3, ops=_LocalOps())  # (any number of replicas)
    again.load_state_dict(sparse.state_dict())
    assert torch.equal(again.compressor.error, sparse.compressor.error)


class _LocalOps:
    """Just enough of CollectiveOps for a channel that never exchanges."""

    def get_world_size(self, group):
        return 1

    def get_rank(self, group):
        return 0


def test_a_re_lay_keeps_the_sparse_error_buffers_and_drops_the_dense_ones():
    """Guards against elastic DiLoCo's re-lay (other replicas leave or join: every channel
    made anew for the new count) zeroing SparseLoCo's error buffers, which are this
    replica's own unsent outer gradient whatever the replica count (the survivor would lose
    it), and against it keeping a dense exchange's, whose rows are per replica; the re-lay
    reports whether it dropped any (its one line says so)."""
    import types

    from loco_megatron.diloco.elastic.saved import ReplicaCheckpoint

    plan = ChunkPlan(PIECES, CHUNK)

    def sparse(world: int) -> SparseChannel:
        return SparseChannel(plan, None, K, 2, world=world, ops=_LocalOps())

    def dense(world: int) -> OuterChannel:
        return OuterChannel(NUMEL, None, 4, 16, world=world, ops=_LocalOps(), stream_rank=0)

    makers = {"fragment0": sparse, "fragment1": dense}
    step = types.SimpleNamespace(channels={k: (None, m(3), 0, i) for i, (k, m) in enumerate(makers.items())},
                                 _relay=lambda key, world: makers[key](world), _laid_for=(0, 1, 2))
    step.channels["fragment0"][1].compressor.error.copy_(torch.arange(NUMEL, dtype=torch.float32))
    dropped = ReplicaCheckpoint._lay(step, (0, 2))
    assert dropped and step._laid_for == (0, 2)
    kept = step.channels["fragment0"][1]
    assert kept.world == 2 and torch.equal(kept.compressor.error, torch.arange(NUMEL, dtype=torch.float32))
    assert step.channels["fragment1"][1].world == 2
    step.channels = {"fragment0": step.channels["fragment0"]}
    assert not ReplicaCheckpoint._lay(step, (0, 1, 2))
    assert torch.equal(step.channels["fragment0"][1].compressor.error, torch.arange(NUMEL, dtype=torch.float32))
