"""Compressed reduce-scatter on 2 and 4 real gloo ranks, against plain torch collectives."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from loco_megatron.loco import LoCoCompressor, dequantize_blockwise
from loco_megatron.loco.collectives import (ShardLayout, compressed_all_gather_sum, compressed_reduce_scatter,
                                         gathered_layout)



def _worker(rank, world, port, numel, bits, all_gather, queue, collected):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layout = ShardLayout(numel, world, bits, 256)
        comp = LoCoCompressor(**layout.compressor_shape(), bits=bits, beta=0.8)
        results = []
        for step in range(3):
            g = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + rank))
            original = g.clone()
            # What this rank transmits, reconstructed independently from its compressor.
            probe = LoCoCompressor(**layout.compressor_shape(), bits=bits, beta=0.8)
            probe.load_state_dict(comp.state_dict())
            codes, scales = probe.compress(g)
            mine = dequantize_blockwise(codes, scales, bits, 256, layout.compressed_numel)
            work, nbytes = compressed_reduce_scatter(g, comp.compress, layout, None, async_op=True,
                                                     all_gather=all_gather)
            work.wait()
            gathered = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            plain = original.clone()
            dist.all_reduce(plain)
            results.append((g.clone(), gathered, plain, nbytes))
        queue.put((rank, results))
        # Stay alive until the parent has read every result (a child exiting while its
        # queue data is in flight resets the pipe), and leave the store together.
        collected.wait(timeout=120)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(target, world, *args):
    """Run ``target(rank, world, port, *args, queue, collected)`` on ``world`` gloo ranks;
    returns ``{rank: what it put on the queue}``."""
    ctx = mp.get_context("spawn")
    queue, collected = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue, collected)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=120) for _ in procs)
    collected.set()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def _run(world, numel, bits, all_gather):
    return _spawn(_worker, world, numel, bits, all_gather)


@pytest.mark.parametrize("world,numel,bits", [(2, 1000, 4), (4, 4096, 2), (4, 1800, 8)])
def test_reduce_scatter_equals_sum_of_dequantised_chunks(world, numel, bits):
    """Guards against mis-routed chunks, wrong shard offsets, lost padding or a
    non-rank-ordered sum: each rank's shard equals the rank-ordered fp32 sum of every
    rank's independently dequantised transmission, and is close to the exact sum."""
    out = _run(world, numel, bits, all_gather=False)
    shard = numel // world
    layout = ShardLayout(numel, world, bits, 256)
    for rank, results in out.items():
        for g, gathered, plain, nbytes in results:
            expected = None
            for r in range(world):
                part = gathered[r].view(world, layout.padded_shard)[rank, :shard]
                expected = part.clone() if expected is None else expected.add_(part)
            got = g[rank * shard:(rank + 1) * shard]
            assert torch.equal(got, expected)
            # And it approximates the uncompressed reduction (LoCo error is bounded).
            err = (got - plain[rank * shard:(rank + 1) * shard]).norm() / plain.norm() * world ** 0.5
            assert err < {2: 1.0, 4: 0.25, 8: 0.02}[bits]
            assert nbytes == world * layout.row_bytes


def test_without_distributed_optimizer_all_gathers_every_shard():
    """Guards against the non-distributed-optimizer path leaving other ranks' shards stale."""
    out = _run(2, 1024, 4, all_gather=True)
    g0, g1 = out[0][0][0], out[1][0][0]
    assert torch.equal(g0, g1)
    plain = out[0][0][2]
    assert (g0 - plain).norm() / plain.norm() < 0.25


def _gather_sum_worker(rank, world, port, numel, bits, queue, collected):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        one_row = ShardLayout(numel, 1, bits, 256)  # each rank compresses its whole buffer as one row
        layout = gathered_layout(numel, world, bits, 256)
        comp = LoCoCompressor(**one_row.compressor_shape(), bits=bits, beta=0.8)
        results = []
        for step in range(3):
            g = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + rank))
            original = g.clone()
            probe = LoCoCompressor(**one_row.compressor_shape(), bits=bits, beta=0.8)
            probe.load_state_dict(comp.state_dict())
            codes, scales = probe.compress(g.clone())
            mine = dequantize_blockwise(codes, scales, bits, 256, one_row.compressed_numel)[:numel].contiguous()
            _, nbytes = compressed_all_gather_sum(g, comp.compress, layout, None)
            gathered = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            plain = original.clone()
            dist.all_reduce(plain)
            results.append((g.clone(), gathered, plain, nbytes, one_row.row_bytes))
        queue.put((rank, results))
        collected.wait(timeout=120)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,numel,bits", [(3, 1000, 4), (2, 600, 2)])
def test_all_gather_sum_equals_rank_ordered_sum_on_every_rank(world, numel, bits):
    """Guards the FSDP cross-node path (compressed all-gather, then a local sum) against
    rows mis-sliced from the gathered buffer (partial last block, odd group size), a sum
    in another order on some rank (replicas would drift apart bit by bit), and a byte
    count other than (world - 1) packed rows: every rank's result equals the rank-ordered
    fp32 sum of every rank's independently dequantised transmission, all ranks are
    bit-identical, and the result is close to plain all_reduce."""
    out = _spawn(_gather_sum_worker, world, numel, bits)
    for step in range(3):
        for rank in range(world):
            got, gathered, plain, nbytes, row_bytes = out[rank][step]
            expected = gathered[0].clone()
            for r in range(1, world):
                expected.add_(gathered[r])
            assert torch.equal(got, expected), (rank, step)
            assert torch.equal(got, out[0][step][0])
            assert (got - plain).norm() / plain.norm() < {2: 1.0, 4: 0.25}[bits]
            assert nbytes == (world - 1) * row_bytes


def test_reduce_scatter_keeps_its_send_buffer_until_wait(monkeypatch):
    """Guards against the send buffer being freed while the all-to-all may still read it
    (safe only where the backend tracks its inputs, as NCCL's caching allocator does): the
    handle must hold the send tensor until ``wait()``, then let it go."""
    import gc
    import weakref

    from loco_megatron.loco import collectives as col

    monkeypatch.setattr(col.dist, "get_rank", lambda group=None: 0)
    sent = []

    class Pending:
        def wait(self):
            pass

    def all_to_all_single(recv, send, group=None, async_op=False):
        sent.append(weakref.ref(send))
        recv.copy_(send)
        return Pending()

    layout = ShardLayout(1000, 1, 4, 256)
    comp = LoCoCompressor(**layout.compressor_shape(), bits=4)
    work, _ = compressed_reduce_scatter(torch.randn(1000), comp.compress, layout, None, async_op=True,
                                        ops=col.CollectiveOps(all_to_all_single=all_to_all_single))
    gc.collect()
    assert sent[0]() is not None
    work.wait()
    gc.collect()
    assert sent[0]() is None


def _code_gather_worker(rank, world, port, numel, queue, collected):
    from loco_megatron.loco.collectives import CodeGather, decode_rows_into

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layout = ShardLayout(numel, world, 4, 256)  # rows of a flat buffer, the last one ragged
        row_layout = ShardLayout(layout.piece, 1, 4, 256)
        a, b = layout.row_range(rank)
        comp = LoCoCompressor(row_layout.piece, bits=4, error_feedback=False)
        row = torch.zeros(layout.piece)
        row[: b - a] = torch.randn(b - a, generator=torch.Generator().manual_seed(rank))
        codes, scales = comp.compress(row)
        gather = CodeGather(codes, scales, world, None, async_op=True)
        rows = gather.wait()
        plain = [torch.empty(gather.row_bytes, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(plain, torch.cat([codes, scales.view(torch.uint8)]))
        out = torch.full((numel,), float("nan"))
        decode_rows_into(rows, layout, row_layout, out)
        mine = dequantize_blockwise(codes, scales, 4, 256, layout.piece)[: b - a]
        queue.put((rank, (rows.clone(), torch.stack(plain), out, mine, (a, b))))
        collected.wait(timeout=120)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_code_gather_equals_plain_all_gather_and_rows_decode_into_place():
    """Guards DiLoCo's phase 2 (the compressed mean rows' all-gather and decode) against
    codes or scales mis-packed or mis-ordered in the gathered buffer, and a row decoded
    into another row's place or its ragged tail dropped: on 3 gloo ranks the gathered rows
    equal plain all_gather of each rank's packed codes and scales, byte for byte, and the
    decoded buffer holds, at each rank's row range, exactly that rank's dequantised row,
    with no element left unwritten, the same on every rank."""
    out = _spawn(_code_gather_worker, 3, 1000)
    for rank in range(3):
        rows, plain, decoded, _, _ = out[rank]
        assert torch.equal(rows, plain)
        assert torch.equal(decoded, out[0][2]) and not decoded.isnan().any()
        for r in range(3):
            a, b = out[r][4]
            assert torch.equal(decoded[a:b], out[r][3])
