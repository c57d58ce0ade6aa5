#!/usr/bin/env python3
"""Megatron-FSDP's overlapped parameter all-gather pattern in plain torch.distributed on
gloo, without megatron or loco-megatron: a check of whether gloo itself corrupts memory
under it (docs/fsdp.md, "CPU: overlapped parameter all-gathers").

    torchrun --standalone --nproc_per_node 4 tools/gloo_gather_stress.py --iters 3000
    MALLOC_PERTURB_=165 torchrun ... tools/gloo_gather_stress.py           # freed memory poisoned
    PYTHONMALLOC=malloc torchrun --no-python --nproc_per_node 2 valgrind --tool=memcheck \\
        --undef-value-errors=no python tools/gloo_gather_stress.py --iters 200

Each iteration, as megatron-core 0.16.1's ``AllGatherPipeline`` does after an optimizer
step and in its prefetches: the buckets' storage is allocated (``_typed_storage()._resize_``,
megatron's ``StorageResizeBasedBucketAllocator``), each pair of buckets is all-gathered as one
asynchronous coalesced ``all_gather_into_tensor`` (``_coalescing_manager(async_ops=True)``),
so several gathers of the same group are in flight on gloo's worker threads at once; the
main thread meanwhile runs what the backward and the logging run on the same group (a
synchronous coalesced ``reduce_scatter_tensor`` of fresh gradient buckets, an
``all_reduce``); then it waits for each gather, checks this rank's slice of every bucket
and frees the buckets' storage (resize to 0) as megatron releases them. A wrong slice
raises; heap corruption aborts the process (``malloc(): ...``) or shows in valgrind.
Prints ``done N iterations`` on rank 0.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed import _coalescing_manager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--buckets", type=int, default=6, help="buckets per iteration, gathered two at a time")
    parser.add_argument("--numel", type=int, default=8192, help="elements of the smallest shard")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    sizes = [args.numel * (b + 1) for b in range(args.buckets)]
    shards = [torch.randn(n) for n in sizes]
    buckets = [torch.empty(n * world) for n in sizes]
    for bucket in buckets:
        bucket._typed_storage()._resize_(0)
    for it in range(args.iters):
        in_flight = []
        for first in range(0, len(buckets), 2):
            pair = range(first, min(first + 2, len(buckets)))
            with _coalescing_manager(group, async_ops=True) as gathers:
                for b in pair:
                    buckets[b]._typed_storage()._resize_(sizes[b] * world)
                    dist.all_gather_into_tensor(buckets[b], shards[b], group=group, async_op=True)
            in_flight.append((pair, gathers))
        grads = [torch.randn(n * world) for n in sizes[:2]]
        reduced = [torch.empty(n) for n in sizes[:2]]
        with _coalescing_manager(group):
            for out, grad in zip(reduced, grads):
                dist.reduce_scatter_tensor(out, grad, group=group)
        dist.all_reduce(torch.tensor([float(it)]), group=group)
        for pair, gathers in in_flight:
            gathers.wait()
            for b in pair:
                mine = buckets[b][rank * sizes[b]:(rank + 1) * sizes[b]]
                if not torch.equal(mine, shards[b]):
                    raise RuntimeError(f"iteration {it}: bucket {b} holds the wrong slice on rank {rank}")
                buckets[b]._typed_storage()._resize_(0)
    dist.barrier()
    if rank == 0:
        print(f"done {args.iters} iterations", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
