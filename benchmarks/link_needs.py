"""What your link needs: how long one DiLoCo outer exchange takes against an outer
interval's compute, projected for sites of H100s at 40% MFU (docs/diloco.md; the formula:
:mod:`loco_megatron.diloco.link`). Prints one markdown table; nothing is measured.

    python benchmarks/link_needs.py [--replicas 2] [--mfu 0.4]

Each row: a site (its GPUs, the tokens per step it trains: its share of the global batch),
H, the outer form; each column a link between the sites. A cell is exchange time /
interval compute: lockstep DiLoCo runs at ``1 + cell`` of its compute time, eager updates
hide the exchange while the cell is at most 1.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from loco_megatron.diloco.link import ASSUMED_GPU, ASSUMED_MFU, exchange_fraction, wire_bits_per_param  # noqa: E402
from loco_megatron.training.flops import PEAK_BF16_TFLOPS  # noqa: E402

SITES = ((8, 256 * 1024), (64, 1024 * 1024), (512, 4 * 1024 * 1024))
"""(GPUs, tokens per step) of each site."""
H = (32, 128)
FORMS = ((0, "fp32"), (4, "LoCo 4-bit"), (2, "LoCo 2-bit"))
LINKS_GBPS = (0.1, 1.0, 10.0, 100.0)
BLOCK = 256
"""--loco-block-size (one fp32 scale per block)."""
PARAMS = 1e9
"""Any model size: with 6 FLOPs per parameter and token it cancels out."""


def table(replicas: int, mfu: float) -> list[str]:
    peak = PEAK_BF16_TFLOPS[ASSUMED_GPU] * 1e12
    links = " | ".join(f"{g:g} Gbit/s" for g in LINKS_GBPS)
    out = [f"| site ({ASSUMED_GPU}s at {mfu:.0%} MFU), tokens per step | H | outer form | {links} |",
           "|---|---|---|" + "---|" * len(LINKS_GBPS)]
    for gpus, tokens in SITES:
        for h in H:
            for bits, form in FORMS:
                per = wire_bits_per_param(bits, replicas, BLOCK)
                cells = [exchange_fraction(PARAMS, per, g, h, tokens, 6 * PARAMS, gpus * peak * mfu)
                         for g in LINKS_GBPS]
                out.append(f"| {gpus} GPUs, {tokens / 2**20:g}M | {h} | {form} | "
                           + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2, help="sites exchanging (R)")
    ap.add_argument("--mfu", type=float, default=ASSUMED_MFU, help="model FLOPs utilisation of each site")
    args = ap.parse_args(argv)
    if args.replicas < 2 or not 0 < args.mfu <= 1:
        print("link_needs.py: error: --replicas must be >= 2 and --mfu in (0, 1]", file=sys.stderr)
        return 2
    print(f"exchange time / outer-interval compute, {args.replicas} sites, bits per parameter on a site's link: "
          + ", ".join(f"{form} {wire_bits_per_param(bits, args.replicas, BLOCK):.2f}" for bits, form in FORMS))
    print("\n".join(table(args.replicas, args.mfu)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
