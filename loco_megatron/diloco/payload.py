"""What one outer exchange sends, in bytes per rank, from the config alone (``--dry-run``:
no model is built, so the shard is counted in elements and SparseLoCo's per-tensor bin
tables are named, not counted)."""

from __future__ import annotations

from loco_megatron.config import Config
from loco_megatron.diloco.sparse.chunks import index_bits


def outer_bytes(config: Config, elements: float) -> float:
    """Bytes a rank whose outer shard has ``elements`` fp32 elements sends to the others per
    exchange (every fragment once): the fp32 ring all-reduce's ``2 (R-1)/R * 4`` per element,
    LoCo's two phases at ``bits`` plus a 4-byte scale per block, or SparseLoCo's ``R - 1``
    payloads of ``k`` packed indices and values per chunk (bin tables not counted)."""
    d, lc = config.diloco, config.loco
    r = d.diloco_replicas
    if d.sparse_outer:
        entries = -(-elements // d.diloco_outer_chunk) * d.diloco_outer_topk
        return (r - 1) * entries * (index_bits(d.diloco_outer_chunk) + (d.diloco_outer_bits or 32)) / 8
    per = d.diloco_outer_bits / 8 + 4 / lc.loco_block_size if d.diloco_outer_bits else 4.0
    return 2 * (r - 1) / r * elements * per


def payload_line(config: Config, elements: float) -> str:
    """One dry-run line: the outer payload per exchange of a rank holding ``elements`` of the
    outer state, against the fp32 ring all-reduce of the same shard (per exchange, and per
    step against data parallel's every step)."""
    d = config.diloco
    sent = outer_bytes(config, elements)
    fp32 = 2 * (d.diloco_replicas - 1) / d.diloco_replicas * elements * 4
    ratio = f"{sent / fp32:.4g}x" if fp32 else "n/a"
    per_step = f"{sent / fp32 / d.diloco_inner_steps:.3g}x" if fp32 else "n/a"
    tables = (f", plus a {4 << d.diloco_outer_bits}-byte bin table per tensor" if d.sparse_outer and d.diloco_outer_bits
              else "")
    return (f"DiLoCo outer payload per exchange (estimate, a rank holding {elements / 2**20:.2f} M elements): "
            f"{sent / 2**20:.3f} MiB to the other replicas{tables}; {ratio} the fp32 ring all-reduce of the same "
            f"shard, {per_step} of data parallel's fp32 gradient all-reduce per step (H = {d.diloco_inner_steps})")
