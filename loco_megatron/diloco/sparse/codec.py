"""SparseLoCo's payload as pure tensor functions: the top-k entries of each chunk, their
values quantised to a few bits, the indices packed, all in one fixed-size uint8 buffer.

Per chunk (:mod:`.chunks`) the ``k`` entries of largest ``|e|`` are chosen (``k`` is fixed,
so the payload's size depends on the plan alone and every rank's is the same: one
all-gather carries them). Their values are sent at ``bits`` 2, 4 or 8 through a bin table
per quantisation group (a piece: one tensor), or as fp32 (``bits`` 0):

* the group's chosen values have mean ``mu`` and sample deviation ``sigma``; ``2**bits`` bins
  of equal width split ``[mu - 6 sigma, mu + 6 sigma]`` (values outside fall in the end bins);
* each bin is decoded as the mean of the values that fell into it (the table: ``2**bits``
  fp32 values per group, sent with the codes); a bin nothing fell into decodes as 0.

Payload layout (uint8, each section padded to a multiple of 4 bytes so the fp32 sections
can be read in place): the sender's weight (fp32: the factor its outer gradient was scaled
by, 1 but for elastic DiLoCo's unequal sites, so a mean over the senders of an entry can
renormalise by their weights); the indices, ``ceil(log2 C)`` bits each, packed LSB first
(12-bit indices: two per 3 bytes), chunk by chunk; the value codes packed the same way (or
the fp32 values); the bin tables, group by group.

Every receiver decodes the same bytes, so all of them hold the same entries; the sender
itself decodes what it sent the same way (:func:`encode` returns it) for its error feedback.
"""

from __future__ import annotations

import math

import torch

from loco_megatron.diloco.sparse.chunks import ChunkPlan, index_bits

RANGE_SIGMAS = 6.0
"""The bins cover the group's mean +- this many of its chosen values' deviations (the
reference's, arXiv 2508.15706)."""


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def _word_values(bits: int) -> int:
    """Values per packing word when ``lcm(8, bits)`` fits an int64 word with room (<= 56
    bits), else 0 (packed bit by bit)."""
    span = bits * 8 // math.gcd(bits, 8)
    return span // bits if span <= 56 else 0


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``[ceil(n * bits / 8)]``: the ``n`` integers of ``values`` (each in ``[0, 2**bits)``)
    laid LSB first, value after value, ``bits`` each (12 bits: two values in 3 bytes)."""
    v = values.reshape(-1).long()
    n = v.numel()
    nbytes = (n * bits + 7) // 8
    g = _word_values(bits)
    if g:  # whole words of g values (lcm(8, bits) bits): shift, add, cut into bytes
        pad = (-n) % g
        if pad:
            v = torch.cat([v, v.new_zeros(pad)])
        word = (v.view(-1, g) << (torch.arange(g, device=v.device) * bits)).sum(1)
        nb = g * bits // 8
        out = (word[:, None] >> (torch.arange(nb, device=v.device) * 8)) & 0xFF
        return out.reshape(-1)[:nbytes].to(torch.uint8)
    out = torch.zeros(nbytes, dtype=torch.int64, device=v.device)
    at = torch.arange(n, dtype=torch.int64, device=v.device) * bits
    for j in range(bits):  # (bits are disjoint: adding them is or-ing them)
        p = at + j
        out.index_add_(0, p >> 3, ((v >> j) & 1) << (p & 7))
    return out.to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int64 ``[n]``."""
    b = packed.reshape(-1).long()
    g = _word_values(bits)
    mask = (1 << bits) - 1
    if g:
        nb = g * bits // 8
        words = -(-n // g)
        if b.numel() < words * nb:
            b = torch.cat([b, b.new_zeros(words * nb - b.numel())])
        word = (b[:words * nb].view(words, nb) << (torch.arange(nb, device=b.device) * 8)).sum(1)
        return ((word[:, None] >> (torch.arange(g, device=b.device) * bits)) & mask).reshape(-1)[:n]
    out = torch.zeros(n, dtype=torch.int64, device=b.device)
    at = torch.arange(n, dtype=torch.int64, device=b.device) * bits
    for j in range(bits):
        p = at + j
        out |= ((b[p >> 3] >> (p & 7)) & 1) << j
    return out


def quantise(values: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, ngroups: int,
             bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseLoCo's bin quantiser (module docstring) of fp32 ``values`` ``[n]`` in groups
    (int64 ``groups`` ``[n]``, ``0 <= group < ngroups``); ``valid`` (bool ``[n]``) marks the
    entries that count (the others get a code, and count in no mean). Returns int64 codes
    ``[n]`` in ``[0, 2**bits)`` and the fp32 tables ``[ngroups, 2**bits]``.

    A group whose values are all equal (``sigma`` 0) puts them in bin ``2**(bits-1)``. A
    non-finite value makes its group's table non-finite (the receivers' mean then is, and
    the outer step drops it), never an out-of-range code."""
    nb = 1 << bits
    dev = values.device
    w = valid.to(values.dtype)
    v = torch.where(valid, values, torch.zeros((), device=dev))
    count = torch.zeros(ngroups, device=dev).index_add_(0, groups, w)
    mu = torch.zeros(ngroups, device=dev).index_add_(0, groups, v) / count.clamp(min=1)
    c = torch.where(valid, values - mu[groups], torch.zeros((), device=dev))
    var = torch.zeros(ngroups, device=dev).index_add_(0, groups, c * c) / (count - 1).clamp(min=1)
    width = (2 * RANGE_SIGMAS / nb) * var.sqrt()
    wg = width[groups]
    x = torch.nan_to_num((c / wg + nb // 2).floor().clamp(0, nb - 1), nan=0.0)
    codes = torch.where(wg > 0, x, torch.full((), float(nb // 2), device=dev)).long()
    slot = groups * nb + codes
    sums = torch.zeros(ngroups * nb, device=dev).index_add_(0, slot, v)
    counts = torch.zeros(ngroups * nb, device=dev).index_add_(0, slot, w)
    table = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros((), device=dev))
    return codes, table.view(ngroups, nb)


class PayloadLayout:
    """Sizes and sections of one channel's payload (module docstring): ``entries`` = chunks x
    ``topk``; ``HEADER`` (the weight), ``index_bytes``, ``value_bytes``, ``table_bytes`` (each
    a multiple of 4) and ``nbytes``, their sum, the same on every rank of a channel."""

    HEADER = 4

    def __init__(self, plan: ChunkPlan, topk: int, bits: int):
        if not 1 <= topk <= plan.chunk:
            raise ValueError(f"top {topk} of chunks of {plan.chunk}: k must be in 1 ... {plan.chunk}")
        if bits not in (0, 2, 4, 8):
            raise ValueError(f"{bits}-bit values: 0 (fp32), 2, 4 or 8")
        self.topk, self.bits = topk, bits
        self.entries = plan.chunks * topk
        self.index_bits = index_bits(plan.chunk)
        self.value_bits = bits or 32
        self.bins = 1 << bits if bits else 0
        self.index_bytes = _pad4((self.entries * self.index_bits + 7) // 8)
        self.value_bytes = _pad4((self.entries * self.value_bits + 7) // 8)
        self.table_bytes = plan.groups * self.bins * 4
        self.nbytes = self.HEADER + self.index_bytes + self.value_bytes + self.table_bytes

    def sections(self, payload: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The weight (fp32 ``[1]``), index, value and table sections of ``payload``."""
        a = self.HEADER
        b, c = a + self.index_bytes, a + self.index_bytes + self.value_bytes
        return payload[:a].view(torch.float32), payload[a:b], payload[b:c], payload[c:self.nbytes]


def choose(e: torch.Tensor, plan: ChunkPlan, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` entries of largest ``|e|`` in every chunk of ``plan`` (``e``: fp32 ``[numel]``):
    their indices in the chunk (int64 ``[chunks, topk]``) and values (fp32 ``[chunks, topk]``).
    An invalid element (past a flat run's end) is chosen only when its chunk has fewer than
    ``topk`` valid ones."""
    if not plan.chunks:
        return (torch.zeros(0, topk, dtype=torch.int64, device=e.device),
                torch.zeros(0, topk, dtype=e.dtype, device=e.device))
    index, values = [], []
    for seg, chunks in plan.iter_chunks(e):
        score = chunks.abs()
        if not seg.side and seg.numel % plan.chunk:  # the run's last chunk is short
            score[-1, seg.numel - (seg.chunks - 1) * plan.chunk:] = -1.0
        i = torch.topk(score, topk, dim=1, sorted=False).indices
        index.append(i)
        values.append(chunks.gather(1, i))
    return torch.cat(index), torch.cat(values)


def encode(e: torch.Tensor, plan: ChunkPlan, layout: PayloadLayout, weight: float = 1.0) -> tuple[torch.Tensor, tuple]:
    """The payload of ``e`` (uint8 ``[layout.nbytes]``; ``weight``: the sender's, see the
    module docstring) and what it decodes to (:func:`decode`'s triple), without decoding the
    bytes again."""
    index, values = choose(e, plan, layout.topk)
    pos, valid = plan.positions(index)
    payload = torch.zeros(layout.nbytes, dtype=torch.uint8, device=e.device)
    weight_part, idx_part, val_part, table_part = layout.sections(payload)
    weight_part.fill_(weight)
    idx_part[:(layout.entries * layout.index_bits + 7) // 8] = pack_bits(index, layout.index_bits)
    values, valid = values.reshape(-1), valid.reshape(-1)
    if layout.bits:
        groups = plan.group[:, None].expand(-1, layout.topk).reshape(-1)
        codes, table = quantise(values, groups, valid, plan.groups, layout.bits)
        val_part[:(layout.entries * layout.bits + 7) // 8] = pack_bits(codes, layout.bits)
        table_part.view(torch.float32).copy_(table.reshape(-1))
        decoded = table.reshape(-1)[groups * layout.bins + codes]
    else:
        val_part.view(torch.float32).copy_(values)
        decoded = values.clone()
    return payload, (pos.reshape(-1), decoded, valid)


def decode(payload: torch.Tensor, plan: ChunkPlan, layout: PayloadLayout) -> tuple[torch.Tensor, ...]:
    """The entries of a payload: their shard positions (int64 ``[entries]``), decoded values
    (fp32) and validity (bool; an invalid entry's position is 0). Any bytes decode without
    error (a garbled payload of a failed collective gives in-range positions)."""
    _, idx_part, val_part, table_part = layout.sections(payload)
    index = unpack_bits(idx_part, layout.index_bits, layout.entries).view(-1, layout.topk)
    pos, valid = plan.positions(index)
    if layout.bits:
        codes = unpack_bits(val_part, layout.bits, layout.entries)
        groups = plan.group[:, None].expand(-1, layout.topk).reshape(-1)
        values = table_part.view(torch.float32)[groups * layout.bins + codes]
    else:
        values = val_part.view(torch.float32)[:layout.entries]
    return pos.reshape(-1), values, valid.reshape(-1)


def scatter_add_(out: torch.Tensor, entries: tuple[torch.Tensor, ...]) -> None:
    """``out[pos] += value`` for every valid entry (fp32 ``out``; the positions of one payload
    are distinct, so the result does not depend on the order of the adds). Invalid entries
    add an exact 0 at position 0 (no host sync to drop them)."""
    pos, values, valid = entries
    if pos.numel():
        out.index_put_((pos,), torch.where(valid, values, torch.zeros((), device=out.device)), accumulate=True)


def sender_weight(payload: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    """The sender's weight a payload carries (fp32 ``[1]``)."""
    return layout.sections(payload)[0]


def chosen_counts_(out: torch.Tensor, entries: tuple[torch.Tensor, ...], weight=1.0) -> None:
    """``out[pos] += weight`` (the sender's) where an entry is valid and decodes to a non-zero
    value (a replica that sends zeros, one that just healed, chose nothing)."""
    pos, values, valid = entries
    if pos.numel():
        chosen = (valid & (values != 0)).to(out.dtype)
        out.index_put_((pos,), chosen * weight, accumulate=True)
