"""Two-hop LoCo: 2 "nodes" x 2 ranks of real gloo processes, and training with it."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import TINY, free_port, torchrun, train_losses
from loco_megatron.loco import LoCoCompressor
from loco_megatron.loco.two_hop import TwoHopLayout, build_node_groups, two_hop_reduce_scatter

WORLD, PER_NODE, SHARD, STEPS = 4, 2, 1000, 12



def _worker(rank, port, intra_bits, average, async_op, queue, collected):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        ng = build_node_groups([dist.group.WORLD], PER_NODE)[0]
        n = WORLD * SHARD  # a shard of 1000 is not a whole number of blocks: padding on both hops
        layout = TwoHopLayout(n, ng.nodes, ng.per_node, intra_bits, 4, 256)
        intra = LoCoCompressor(**layout.intra.compressor_shape(), bits=intra_bits, beta=0.0) if layout.intra else None
        inter = LoCoCompressor(**layout.inter.compressor_shape(), bits=4, beta=0.0)
        g = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        exact = g.clone()
        dist.all_reduce(exact)
        j = dist.get_rank(ng.inter) * PER_NODE + dist.get_rank(ng.intra)
        want = exact.view(WORLD, SHARD)[j] / (WORLD if average else 1)
        total, first, bytes_inter = torch.zeros(SHARD), None, None
        for _ in range(STEPS):
            buf = g.clone()
            work, _ = two_hop_reduce_scatter(buf, layout, ng, intra.compress if intra else None, inter.compress,
                                             async_op=async_op, average=average)
            work.wait()
            got = buf.view(WORLD, SHARD)[j].clone()
            first = got if first is None else first
            total += got
            bytes_inter = work.bytes_inter
        rel = lambda x: float((x - want).norm() / want.norm())  # noqa: E731
        queue.put((rank, j, rel(first), rel(total / STEPS), bytes_inter, layout.inter.row_bytes))
        collected.wait(timeout=120)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(worker, *args, timeout: int = 180) -> list:
    """Run ``worker(rank, port, *args, queue, collected)`` on WORLD spawned ranks; their
    queued results (one per rank, in arrival order)."""
    ctx = mp.get_context("spawn")
    queue, collected = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, *args, queue, collected)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=timeout) for _ in range(WORLD)]
    finally:
        collected.set()
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    return results


def _run(intra_bits, average, async_op):
    return sorted(_spawn(_worker, intra_bits, average, async_op))


@pytest.mark.parametrize("intra_bits,average,async_op", [(8, False, True), (16, True, True), (8, False, False)])
def test_two_hop_reduces_every_shard(intra_bits, average, async_op):
    """Guards against shards landing on the wrong rank, a hop summing the wrong chunks,
    a broken average, lost compensation on either hop, or inter-node bytes that do not
    follow the formula: each rank gets its own shard of the exact sum within 4-bit
    quantisation error, the average over steps converges (error feedback telescopes on
    both hops), and hop 2 sends (n-1) rows of codes + scales across nodes. Also run
    synchronously (--no-overlap-grad-reduce), where hop 1's output buffer is only known
    when hop 2 is issued."""
    results = _run(intra_bits, average, async_op)
    assert [r[1] for r in results] == [0, 1, 2, 3]  # rank (node a, local b) owns shard a*R + b
    for _, _, first, averaged, bytes_inter, row_bytes in results:
        assert first < 0.15, first                      # one step: 4-bit (+ 8-bit) quantisation error
        assert averaged < first / 3, (averaged, first)  # error feedback: the error does not accumulate
        assert bytes_inter == (WORLD // PER_NODE - 1) * row_bytes


@pytest.mark.parametrize("extra", [[], ["--no-use-distributed-optimizer", "--loco-intra-node-bits", "16"]],
                         ids=["distopt-intra8", "allreduce-intra-bf16"])
def test_training_with_two_hop_loco(cache_dir, tmp_path, extra):
    """Guards against the two-hop path breaking megatron's buckets (or issuing hop-2
    collectives in a different order on different ranks): 4 ranks as 2 nodes x 2 train
    with falling loss, every bucket goes two-hop, and the inter-node bytes per rank of the
    two hops are at most a quarter of what a flat bf16 reduce-scatter sends across nodes.
    Without the distributed optimizer the reduced shards are then all-gathered at the
    gradient dtype (fp32), whose rows go to the other node too: counted in the inter-node
    bytes, (W - R) / W of the rank's fp32 row."""
    args = TINY + ["--train-iters", "8", "--loco-bits", "4", "--loco-hierarchical", "--loco-ranks-per-node", "2",
                   "--log-interval", "4", *extra]
    _, metrics = torchrun(4, args, cache_dir, tmp_path)
    losses = train_losses(metrics)
    assert losses[8] < losses[4]
    last = [m for m in metrics if "comm/grad_bytes_sent_inter" in m][-1]
    assert last["comm/compressed_fraction"] == 1.0
    raw_elements = last["comm/grad_bytes_uncompressed"] / 4  # fp32 gradient buffers
    flat_bf16_inter = raw_elements * 2 * (4 - 2) / 4        # (W-R)/W of a bf16 buffer crosses nodes
    gather_inter = raw_elements * 4 / 4 * (4 - 2) / 4 if extra else 0  # the fp32 rows of the all-gather
    hops = last["comm/grad_bytes_sent_inter"] - gather_inter
    assert 0 < hops <= flat_bf16_inter / 4
    # hop 2: (n-1)/n of N/R elements at 4 bits + one fp32 scale per 256 (plus block padding)
    formula = raw_elements / 2 / 2 * (0.5 + 4 / 256)
    assert formula <= hops <= formula * 1.1
    assert last["comm/grad_bytes_sent_intra"] > last["comm/grad_bytes_sent_inter"]  # 8/16-bit inside the node


def _kernels_worker(rank, port, queue, collected):
    """Both hops and a flat compressed reduce-scatter with the 2-bit default options (+
    stochastic rounding), on the torch path and on the Triton kernels (interpreted on CPU:
    TRITON_INTERPRET=1 is inherited from the pytest process); puts this rank's outputs."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from loco_megatron.loco import quantize as qz
        from loco_megatron.loco import triton_kernels
        from loco_megatron.loco.collectives import ShardLayout, compressed_reduce_scatter, decompress_into

        opts = qz.QuantOptions("uniform", "mse", "hadamard", "stochastic", seed=5)
        ng = build_node_groups([dist.group.WORLD], PER_NODE)[0]
        n = WORLD * SHARD
        layout = TwoHopLayout(n, ng.nodes, ng.per_node, 8, 2, 256, options=opts)
        flat = ShardLayout(n, WORLD, 2, 256, options=opts)
        out = {}
        for kernels, decompress in (("torch", decompress_into), ("triton", triton_kernels.decompress_sum)):
            mk = lambda shape, bits: LoCoCompressor(**shape, bits=bits, options=opts, kernels=kernels,  # noqa: E731
                                                    stream=rank)
            intra, inter, one = mk(layout.intra.compressor_shape(), 8), mk(layout.inter.compressor_shape(), 2), \
                mk(flat.compressor_shape(), 2)
            got = []
            for step in range(2):  # the second step carries the error of the first
                g = torch.randn(n, generator=torch.Generator().manual_seed(10 * rank + step))
                buf = g.clone()
                work, _ = two_hop_reduce_scatter(buf, layout, ng, intra.compress, inter.compress, average=True,
                                                 decompress=decompress)
                work.wait()
                buf2 = g.clone()
                work2, _ = compressed_reduce_scatter(buf2, one.compress, flat, dist.group.WORLD, average=True,
                                                     decompress=decompress)
                work2.wait()
                got.append((buf.clone(), buf2.clone()))
            out[kernels] = got
        queue.put((rank, out))
        collected.wait(timeout=300)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_hop_triton_kernels_with_options_match_torch():
    """Guards against the two-hop path (and the flat compressed reduce-scatter) losing the
    quantiser options on the Triton kernels - the options or noise key not reaching the
    compress kernel, a hop's receiver not unrotating or dropping the uniform grid's signed
    scales: on 4 gloo ranks (2 nodes x 2), the 2-bit default + stochastic rounding, every
    rank's buffer equals the torch path's bit for bit in the first step, and to ulps in the
    second (the interpreter's tl.fma is a rounded product plus a rounded sum, torch's
    addcmul on CPU one FMA, so the stored errors may differ in the last bit; measured: at
    most 3.6e-7 on values of about 3.6, in 5% of one rank's elements)."""
    for rank, out in _spawn(_kernels_worker, timeout=300):
        for step, ((a_hop, a_flat), (b_hop, b_flat)) in enumerate(zip(out["torch"], out["triton"])):
            if step == 0:  # the error buffers are still zero: bit for bit
                assert torch.equal(a_hop.view(torch.int32), b_hop.view(torch.int32)), rank
                assert torch.equal(a_flat.view(torch.int32), b_flat.view(torch.int32)), rank
            else:  # the interpreter's FMA rounds twice (torch's addcmul once): ulps of the error
                torch.testing.assert_close(a_hop, b_hop, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(a_flat, b_flat, rtol=1e-6, atol=1e-6)
