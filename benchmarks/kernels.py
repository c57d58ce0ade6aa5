#!/usr/bin/env python3
"""LoCo compress and decompress-and-sum throughput vs memory-copy bandwidth.

For bucket sizes from 1M to 100M fp32 elements (``--sizes 1M,...,256M`` on a GPU) it
times, on the GPU when one is present (else the CPU, with all of torch's threads):

* ``copy``: ``dst.copy_(grad)`` of the bucket (the machine's memory-copy speed on the
  same bytes);
* ``compress``: one LoCo step (compensate, block absmax, quantise, pack, moving-average
  error update, int8 re-quantisation of the error) at 4 bits;
* ``decompress+sum``: unpack, dequantise and sum in fp32 the ``--world`` received chunks
  of one shard (a bucket's worth of elements in total).

Throughput is gradient bytes (4 per element) over time; the ratios to ``copy`` are
what the targets are stated in. Median of ``--repeats`` runs after one warm-up.

    python benchmarks/kernels.py
    python benchmarks/kernels.py --sizes 1M,16M --bits 2
    python benchmarks/kernels.py --smoke
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from loco_megatron.loco.collectives import ShardLayout, decompress_into  # noqa: E402
from loco_megatron.loco.compressor import LoCoCompressor, Workspace, resolve_kernels  # noqa: E402


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1_000_000}.get(text[-1].upper(), 1)
    try:
        return int(float(text[:-1] if mult != 1 else text) * mult)
    except ValueError:
        raise SystemExit(f"error: --sizes: '{text}' is not a size like 1M or 65536")


def _timer(device: torch.device):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def median(fn, repeats: int) -> float:
        fn()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,4M,16M,64M,100M", help="bucket sizes in elements")
    ap.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    ap.add_argument("--world", type=int, default=8, help="ranks a bucket is reduce-scattered over")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto",
                    help="auto: the fused Triton kernels on CUDA when triton is installed (with the torch "
                         "reference timed alongside for the speedup), else torch")
    ap.add_argument("--smoke", action="store_true", help="two tiny sizes, one repeat")
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.repeats = "64K,256K", 1
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        kernels = resolve_kernels(args.kernels, device.type, os.environ.get("TRITON_INTERPRET") == "1",
                                  args.bits, 256, 8, True)
    except ValueError as e:
        sys.exit(f"error: {e}")
    sizes = [_size(s) for s in args.sizes.split(",") if s]
    median = _timer(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads"
    print(f"LoCo {args.bits}-bit {kernels} kernels on {where}; W={args.world}, median of {args.repeats}")
    print(f"{'elements':>12} {'copy GB/s':>10} {'compress GB/s':>14} {'ratio':>6} "
          f"{'decomp+sum GB/s':>16} {'ratio':>6}")
    ws = Workspace()
    for n in sizes:
        n -= n % args.world
        torch.manual_seed(0)
        grad = torch.randn(n, device=device)
        dst = torch.empty_like(grad)
        layout = ShardLayout(n, args.world, args.bits, 256)
        padded = layout.padded(grad).reshape(-1)
        shard = torch.empty(layout.shard, device=device)
        copy_s = median(lambda: dst.copy_(grad), args.repeats)

        def measure(impl: str) -> tuple[float, float]:
            comp = LoCoCompressor(layout.compressed_numel, bits=args.bits, device=device, kernels=impl)
            comp_s = median(lambda: comp.compress(padded, ws), args.repeats)
            recv = layout.pack(*comp.compress(padded, ws))
            if impl == "triton":
                from loco_megatron.loco import triton_kernels

                dec_s = median(lambda: triton_kernels.decompress_sum(recv, layout, shard), args.repeats)
            else:
                dec_s = median(lambda: decompress_into(recv, layout, shard), args.repeats)
            return comp_s, dec_s

        comp_s, dec_s = measure(kernels)
        gb = n * 4 / 1e9
        print(f"{n:>12,} {gb / copy_s:>10.2f} {gb / comp_s:>14.2f} {copy_s / comp_s:>6.3f} "
              f"{gb / dec_s:>16.2f} {copy_s / dec_s:>6.3f}", flush=True)
        if kernels == "triton":
            ref_c, ref_d = measure("torch")
            print(f"{'':>12} speedup over the torch reference: compress {ref_c / comp_s:.1f}x, "
                  f"decompress+sum {ref_d / dec_s:.1f}x", flush=True)


if __name__ == "__main__":
    main()
