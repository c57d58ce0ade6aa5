"""LoCo's per-bucket hot path under ``torch.cuda.set_sync_debug_mode("error")``.

For each kernel set and bit width asked for, one bucket goes through everything a step
does to it on a rank: the compressor (compensate, quantise, error update, metric sums),
the compressed reduce-scatter's pack, launch and decompress-and-sum, then the compressed
parameter gather's encode, launch and apply. The collectives are a local loopback (one
rank: what is sent is received), since a single GPU has no peers; NCCL launches no host
sync of its own. A first pass warms up (device constants, Triton compilation); the second
runs with CUDA's sync debugging set to raise on any blocking host-device synchronisation
(``.item()``, a pageable host-to-device copy, a stream synchronise). Prints one
``sync_check ... ok`` line per configuration, or the traceback of the first sync and exit 1.

On CPU (no sync debugging there) it runs the same calls as a smoke test; the CPU guard of
the whole overlapped training step is ``tests/test_hot_path.py``.

    python benchmarks/sync_check.py --kernels triton,torch --bits 4,2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loco_megatron.config.loco import LOCO_DEFAULT_OPTIONS  # noqa: E402
from loco_megatron.loco.collectives import CollectiveOps, ShardLayout, compressed_reduce_scatter  # noqa: E402
from loco_megatron.loco.compressor import LoCoCompressor  # noqa: E402
from loco_megatron.loco.kernel_choice import decompressor  # noqa: E402
from loco_megatron.loco.param_delta import AgreedShard, DeltaLayout  # noqa: E402
from loco_megatron.loco.param_gather import compressed_param_all_gather  # noqa: E402
from loco_megatron.loco.quantize import QuantOptions  # noqa: E402
from loco_megatron.loco.workspace import Workspace  # noqa: E402


def _loopback_all_to_all(recv, send, group=None, async_op=False):
    recv.copy_(send)


def _loopback_gather(recv, send, group=None, async_op=False):
    recv.copy_(send)


LOOPBACK = CollectiveOps(all_to_all_single=_loopback_all_to_all, all_gather_into_tensor=_loopback_gather)
"""One rank's collectives: what is sent is what is received (device-to-device copies)."""


def one_bucket(grad, compressor, layout, ws, decompress, params, shard, delta_layout) -> None:
    """The hot path of one bucket on one rank (see the module docstring)."""
    work, _ = compressed_reduce_scatter(grad, lambda flat: compressor.compress(flat, ws), layout, None,
                                        async_op=True, decompress=decompress, ops=LOOPBACK)
    work.wait()
    shard.begin_step()
    params.view(1, -1)[0].add_(grad, alpha=-1e-3)  # the optimizer's update of the own shard
    gather, _ = compressed_param_all_gather(params, shard, delta_layout, None, async_op=True, ops=LOOPBACK)
    gather.wait()


def check(kernels: str, bits: int, numel: int, device: torch.device) -> None:
    opts = QuantOptions(**LOCO_DEFAULT_OPTIONS.get(bits, {}))
    layout = ShardLayout(numel, 1, bits, 256, options=opts)
    compressor = LoCoCompressor(**layout.compressor_shape(), bits=bits, device=device, kernels=kernels, options=opts)
    delta_layout = DeltaLayout(numel, 1, bits, 256, kernels=kernels, options=opts)
    params = torch.randn(numel, device=device).to(torch.bfloat16)
    shard = AgreedShard(params.view(1, -1)[0], main_aliased=False)
    ws, decompress = Workspace(), decompressor(kernels)
    grad = torch.randn(numel, device=device)
    one_bucket(grad.clone(), compressor, layout, ws, decompress, params, shard, delta_layout)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        one_bucket(grad.clone(), compressor, layout, ws, decompress, params, shard, delta_layout)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    print(f"sync_check kernels={kernels} bits={bits} numel={numel} device={device.type}: ok", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default="triton,torch", help="comma-separated: torch, triton, cpu")
    p.add_argument("--bits", default="4,2", help="comma-separated LoCo widths (each with its default options)")
    p.add_argument("--numel", type=int, default=(1 << 20) + 77, help="elements of the bucket (ragged on purpose)")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="sync_check_"), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # rank lookups only; no tensor sent
    try:
        for kernels in a.kernels.split(","):
            for bits in (int(b) for b in a.bits.split(",")):
                check(kernels, bits, a.numel, device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
