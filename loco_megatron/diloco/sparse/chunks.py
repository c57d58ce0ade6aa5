"""Cutting one channel's flat fp32 shard into SparseLoCo's chunks (pure tensor functions).

A channel's shard is *pieces* laid end to end: each piece is a contiguous range
``[start, start + length)`` of one row-major tensor of ``shape`` (a parameter's local
flattening in the one-job mode, a key's box in an elastic lane). A piece whose tensor is a
matrix (or a stack of matrices: the last two axes) whose rows and columns the tile side
``s = sqrt(C)`` both divide is cut into square ``s x s`` tiles wherever the piece holds whole
bands of ``s`` rows; its head and tail outside whole bands, and every other piece, are cut into
flat chunks of ``C`` consecutive elements (the last one of a run shorter, its missing
elements *invalid*). A ``C`` that is not a perfect square cuts everything flat.

Chunk ``i`` holds up to ``C`` elements; its element ``j`` (``0 <= j < C``, row-major in a
tile) is at shard position ``base[i] + (j // div[i]) * width[i] + j % div[i]`` and valid when
``j < valid[i]`` (tiles: ``div = s``, ``width`` the matrix's row length, all valid; flat:
``div = C``). Positions are int64 throughout: shards past 2^31 elements are indexed exactly.
``group[i]`` is the piece a chunk belongs to: SparseLoCo quantises each tensor's chosen
values with their own bin table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of the shard cut one way: ``side`` 0 (flat chunks of ``C``) or the tile side
    (whole bands of ``side`` rows of a matrix whose rows are ``width`` long)."""

    offset: int
    numel: int
    side: int
    width: int
    group: int
    first_chunk: int
    chunks: int


def tile_side(chunk: int) -> int:
    """The side of a square tile of ``chunk`` elements, 0 when ``chunk`` is not a square."""
    s = math.isqrt(chunk)
    return s if s * s == chunk and s > 1 else 0


def index_bits(chunk: int) -> int:
    """Bits of one index into a chunk of ``chunk`` elements: ``ceil(log2 chunk)``."""
    return max(1, (chunk - 1).bit_length())


class ChunkPlan:
    """The chunks of a shard of ``pieces`` (``(length, shape, start)`` each, laid end to end:
    see the module docstring), ``chunk`` elements each.

    ``segments``: the runs, in shard order; ``chunks``: how many in all; ``groups``: how many
    pieces (quantisation groups); per chunk (int64 ``[chunks]`` tensors, built on ``device``):
    ``base``, ``div``, ``width``, ``valid`` and ``group``."""

    def __init__(self, pieces: Sequence[tuple[int, tuple, int]], chunk: int, device=None):
        if chunk < 2:
            raise ValueError(f"a chunk of {chunk} element(s): at least 2")
        self.chunk, self.side = chunk, tile_side(chunk)
        self.segments: list[Segment] = []
        self.chunks = 0
        offset = 0
        nonempty = [p for p in pieces if p[0] > 0]
        for group, (length, shape, start) in enumerate(nonempty):
            for a, b, side, width in _cuts(int(length), tuple(shape), int(start), self.side):
                self._add(offset + a - start, b - a, side, width, group)
            offset += length
        self.numel, self.groups = offset, len(nonempty)
        meta = [self._meta(s) for s in self.segments]
        cat = (lambda i: torch.cat([m[i] for m in meta]).to(device)) if meta else \
            (lambda i: torch.zeros(0, dtype=torch.int64, device=device))
        self.base, self.div, self.width, self.valid, self.group = (cat(i) for i in range(5))

    def _add(self, offset: int, numel: int, side: int, width: int, group: int) -> None:
        if numel <= 0:
            return
        chunks = numel // (side * side) if side else -(-numel // self.chunk)
        self.segments.append(Segment(offset, numel, side, width, group, self.chunks, chunks))
        self.chunks += chunks

    def _meta(self, seg: Segment) -> tuple[torch.Tensor, ...]:
        n = seg.chunks
        if seg.side:
            s, w = seg.side, seg.width
            per_band = w // s
            i = torch.arange(n, dtype=torch.int64)
            base = seg.offset + (i // per_band) * (s * w) + (i % per_band) * s
            div, width, valid = torch.full((n,), s), torch.full((n,), w), torch.full((n,), self.chunk)
        else:
            base = seg.offset + torch.arange(n, dtype=torch.int64) * self.chunk
            div, width = torch.full((n,), self.chunk), torch.zeros(n, dtype=torch.int64)
            valid = (seg.offset + seg.numel - base).clamp(max=self.chunk)
        return base, div.long(), width.long(), valid.long(), torch.full((n,), seg.group, dtype=torch.int64)

    def segment_chunks(self, flat: torch.Tensor, seg: Segment) -> torch.Tensor:
        """``[seg.chunks, C]``: the chunks of ``seg`` in ``flat`` (the shard), row-major in
        each tile; invalid elements 0. A view where the run is whole flat chunks, else a copy."""
        x = flat[seg.offset:seg.offset + seg.numel]
        if seg.side:
            s = seg.side
            return x.view(-1, s, seg.width // s, s).permute(0, 2, 1, 3).reshape(-1, s * s)
        if seg.numel % self.chunk == 0:
            return x.view(-1, self.chunk)
        out = torch.zeros(seg.chunks, self.chunk, dtype=flat.dtype, device=flat.device)
        out.view(-1)[:seg.numel] = x
        return out

    def iter_chunks(self, flat: torch.Tensor) -> Iterator[tuple[Segment, torch.Tensor]]:
        for seg in self.segments:
            yield seg, self.segment_chunks(flat, seg)

    def positions(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``index``: int64 ``[chunks, k]``, an element of each chunk per entry. Returns the
        entries' shard positions (int64 ``[chunks, k]``; 0 where invalid) and their validity
        (bool ``[chunks, k]``: the element exists, ``index < valid``; an index that no
        sender could have chosen, from a garbled payload, is invalid too)."""
        index = index.long()
        ok = (index >= 0) & (index < self.valid[:, None])
        pos = self.base[:, None] + torch.div(index, self.div[:, None], rounding_mode="floor") * self.width[:, None] \
            + torch.remainder(index, self.div[:, None])
        return torch.where(ok, pos, torch.zeros((), dtype=torch.int64, device=pos.device)), ok


def _cuts(length: int, shape: tuple, start: int, side: int) -> Iterator[tuple[int, int, int, int]]:
    """``(a, b, side, width)`` runs of the piece ``[start, start + length)`` of a row-major
    ``shape``: a flat head, the whole bands of tiles, a flat tail (``side`` 0: flat)."""
    end = start + length
    if side and len(shape) >= 2 and shape[-1] % side == 0 and shape[-2] % side == 0:
        band = side * shape[-1]  # (rows % side == 0: a band never straddles two matrices of a stack)
        head = min(end, -(-start // band) * band)
        tail = max(head, end // band * band)
        yield start, head, 0, 0
        yield head, tail, side, shape[-1]
        yield tail, end, 0, 0
    else:
        yield start, end, 0, 0


def slice_pieces(slices: Sequence[tuple]) -> list[tuple[int, tuple, int]]:
    """The pieces of a one-job shard: per ``(param, start, end)`` of
    :attr:`~loco_megatron.diloco.outer.ShardViews.slices`, its elements of the parameter's
    local (TP/PP/EP) shape."""
    return [(end - start, tuple(p.shape), start) for p, start, end in slices]
