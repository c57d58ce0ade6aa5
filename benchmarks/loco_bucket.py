#!/usr/bin/env python3
"""LoCo on one realistic gradient bucket: payload bytes and compression throughput.

For a bucket of N fp32 gradient elements reduce-scattered over W ranks it prints, side
by side, the bytes each rank hands to the collective per step for the fp32 and bf16
reduce-scatter and for LoCo 8/4/2-bit (the actual send buffer of
``compressed_reduce_scatter``: codes + fp32 scales + shard padding), their ratio to
bf16, and the compress + decompress-and-sum throughput as a ratio to a torch memory
copy of the same gradient bytes on this machine. The 2-bit quantiser options
(``--loco-quantizer uniform``, ``--loco-scale mse``, ``--loco-rotation hadamard``,
``--loco-rounding stochastic``) get rows of their own, measured the same way: every
option sends ``bits/8`` bytes per padded element plus one fp32 scale per block and no
side information, so their payload equals the original 2-bit scheme's. A second table adds the distributed
optimizer's parameter all-gather (bf16 parameters; ``--param-gather-bits`` 8/4/2: the
gathered codes + scales of ``loco/param_gather.py``; 2 bits paired with LoCo 2-bit, as a
run with both at 2 bits shares its quantiser options), so gradients + parameters of
each variant compare with bf16 reduce-scatter + bf16 all-gather.

    python benchmarks/loco_bucket.py                 # 50M elements, W=8
    python benchmarks/loco_bucket.py --smoke         # seconds, for tests
"""

import argparse
import pathlib
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from loco_megatron.loco import LoCoCompressor  # noqa: E402
from loco_megatron.loco.workspace import Workspace  # noqa: E402
from loco_megatron.loco.collectives import ShardLayout, compressed_reduce_scatter, decompress_into  # noqa: E402
from loco_megatron.loco.param_delta import DeltaLayout  # noqa: E402
from loco_megatron.loco.quantize import QuantOptions  # noqa: E402

TWO_BIT_OPTIONS = {
    "uniform": QuantOptions("uniform"),
    "uniform+mse+hadamard": QuantOptions("uniform", "mse", "hadamard"),
    "all four options": QuantOptions("uniform", "mse", "hadamard", "stochastic"),
}


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--world", type=int, default=8, help="data-parallel ranks the bucket is sharded over")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    args = ap.parse_args()
    if args.smoke:
        args.numel, args.repeats = 1 << 16, 1
    n, w = args.numel - args.numel % args.world, args.world

    # The payload is counted at a real collective call: a 1-rank gloo group runs
    # compressed_reduce_scatter, and the send buffer it builds is what W ranks would send.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    grad = torch.randn(n)
    rows = [("fp32 reduce-scatter", n * 4), ("bf16 reduce-scatter", n * 2)]
    rotation_ok = not args.block_size & (args.block_size - 1)
    for bits, name, opts in [(8, "", None), (4, "", None), (2, "", None),
                             *((2, f" {k}", o) for k, o in TWO_BIT_OPTIONS.items() if rotation_ok or o.rotation == "none")]:
        layout = ShardLayout(n, w, bits, args.block_size, options=opts)
        one = ShardLayout(n, 1, bits, args.block_size, options=opts)
        comp = LoCoCompressor(**one.compressor_shape(), bits=bits, block_size=args.block_size, options=opts)
        _, sent = compressed_reduce_scatter(grad.clone(), comp.compress, one, None, async_op=False)
        # Same elements split W ways: only the per-shard block padding differs.
        rows.append((f"LoCo {bits}-bit{name}", sent + (layout.world * layout.row_bytes - one.row_bytes)))

    bf16 = n * 2
    print(f"bucket: {n:,} fp32 elements over {w} ranks, block {args.block_size}")
    print(f"{'sync':<36}{'bytes/rank/step':>18}{'vs bf16':>10}")
    for name, b in rows:
        print(f"{name:<36}{b:>18,}{b / bf16:>10.3f}")

    # Gradients + parameters: the all-gather's gathered buffer (W rows of one shard each).
    sent = dict(rows)
    both = [("bf16 RS + bf16 all-gather", sent["bf16 reduce-scatter"], n * 2),
            ("LoCo 4-bit + bf16 all-gather", sent["LoCo 4-bit"], n * 2)]
    for gbits, pbits in ((4, 8), (4, 4), (2, 2)):  # the options change no byte: 2-bit codes + fp32 scales
        both.append((f"LoCo {gbits}-bit + params {pbits}-bit", sent[f"LoCo {gbits}-bit"],
                     DeltaLayout(n, w, pbits, args.block_size).gathered_bytes))
    base = both[0][1] + both[0][2]
    print(f"\n{'gradients + parameters':<32}{'grad bytes':>14}{'param bytes':>14}{'total':>14}{'vs bf16+bf16':>14}")
    for name, g, prm in both:
        print(f"{name:<32}{g:>14,}{prm:>14,}{g + prm:>14,}{(g + prm) / base:>14.3f}")

    # Throughput: LoCo 4-bit compress + decompress-and-sum vs copying the same gradient.
    layout = ShardLayout(n, w, 4, args.block_size)
    comp = LoCoCompressor(**layout.compressor_shape(), bits=4, block_size=args.block_size)
    dst = torch.empty_like(grad)
    copy_s = _median_time(lambda: dst.copy_(grad), args.repeats)
    ws = Workspace()  # as in training: one scratch reused across buckets and steps
    codes, scales = comp.compress(grad, ws)
    recv = layout.pack(codes, scales)
    comp_s = _median_time(lambda: comp.compress(grad, ws), args.repeats)
    # Rank j dequantises W chunks of one shard: one bucket's worth of elements.
    summed = torch.empty(layout.shard, dtype=torch.float32)
    dec_s = _median_time(lambda: decompress_into(recv, layout, summed), args.repeats)
    gb = n * 4 / 1e9
    print(f"\nthroughput on this machine ({torch.get_num_threads()} threads), 4-bit:")
    print(f"{'memory copy':<28}{gb / copy_s:>8.2f} GB/s of gradient")
    print(f"{'compress':<28}{gb / comp_s:>8.2f} GB/s  ratio to copy {copy_s / comp_s:.3f}")
    print(f"{'decompress+sum (W chunks)':<28}{gb / dec_s:>8.2f} GB/s  ratio to copy {copy_s / dec_s:.3f}")
    print(f"{'compress+decompress':<28}{gb / (comp_s + dec_s):>8.2f} GB/s  ratio to copy "
          f"{copy_s / (comp_s + dec_s):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
