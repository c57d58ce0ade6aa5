"""SparseLoCo's pure tensor functions (loco_megatron/diloco/sparse): chunks, top-k, the bin
quantiser, bit packing, the payload and the error feedback, against references written here."""

from __future__ import annotations

import pytest
import torch

from loco_megatron.diloco.sparse.chunks import ChunkPlan, index_bits, slice_pieces, tile_side
from loco_megatron.diloco.sparse.codec import (RANGE_SIGMAS, PayloadLayout, choose, decode, encode, pack_bits,
                                               quantise, scatter_add_, sender_weight, unpack_bits)
from loco_megatron.diloco.sparse.compressor import SparseCompressor

# a flat bias, a whole 2-D weight, a 2-D weight's shard that starts and ends inside bands of
# tiles (flat head and tail around whole bands), a stack of two matrices, a non-divisible matrix
PIECES = [(37, (37,), 0), (16 * 24, (16, 24), 0), (2 * 96 + 5 + 7, (16, 24), 4 * 24 - 5),
          (2 * 8 * 12, (2, 8, 12), 0), (5 * 7, (5, 7), 0)]
C = 16  # tiles of 4 x 4


def _plan(pieces=PIECES, chunk=C) -> ChunkPlan:
    return ChunkPlan(pieces, chunk)


def _elements(plan: ChunkPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (chunk, element) position and validity."""
    index = torch.arange(plan.chunk).expand(plan.chunks, -1)
    return plan.positions(index)


def test_chunks_cover_every_element_once_tiles_where_they_fit():
    """Guards against a chunk plan that maps two entries to one element or misses one (an
    outer gradient entry sent twice or never), and against tiles cut where a shard holds no
    whole band of rows (a tile straddling another parameter) or not cut where it does."""
    plan = _plan()
    pos, ok = _elements(plan)
    held = pos[ok]
    assert held.numel() == plan.numel == sum(n for n, _, _ in PIECES)
    assert torch.equal(held.sort().values, torch.arange(plan.numel))
    kinds = [(s.side, s.numel) for s in plan.segments]
    assert kinds == [(0, 37), (4, 384), (0, 5), (4, 192), (0, 7), (4, 192), (0, 35)]
    # a tile is a 4 x 4 square of its matrix
    flat = torch.arange(plan.numel, dtype=torch.float32)
    seg = plan.segments[1]
    chunks = plan.segment_chunks(flat, seg)
    matrix = flat[seg.offset:seg.offset + seg.numel].view(16, 24)
    assert torch.equal(chunks[7].view(4, 4), matrix[4:8, 4:8])  # band 1, tile column 1 (6 per band)
    assert torch.equal(chunks[7], flat[pos[seg.first_chunk + 7]])


def test_a_chunk_that_is_not_a_square_cuts_flat():
    """Guards against tiles of a chunk size with no integer side (a rectangle sent as a square)."""
    assert tile_side(4096) == 64 and tile_side(24) == 0 and tile_side(1) == 0
    plan = _plan(chunk=24)
    assert all(s.side == 0 for s in plan.segments)
    pos, ok = _elements(plan)
    assert torch.equal(pos[ok].sort().values, torch.arange(plan.numel))


def test_positions_past_two_to_the_31_are_exact():
    """Guards against int32 offsets: a shard of more than 2^31 elements must index its last
    chunks exactly (no wrap to negative positions)."""
    n = 2**31 + 5000
    plan = ChunkPlan([(n, (n,), 0)], 4096)
    assert plan.chunks == -(-n // 4096)
    pos, ok = plan.positions(torch.tensor([[0, 4095]] * plan.chunks))
    assert pos[-1, 0].item() == (plan.chunks - 1) * 4096 and pos[-1, 0].item() > 2**31
    assert ok[-1].tolist() == [True, False] and ok[-2].tolist() == [True, True]


def test_one_job_shards_are_cut_by_their_parameters_shapes():
    """Guards against the one-job mode's shard (parameter ranges) chunked without its
    parameters' shapes: a 2-D weight would never be tiled."""
    w = torch.zeros(8, 12)
    plan = ChunkPlan(slice_pieces([(w, 0, 96), (torch.zeros(5), 1, 4)]), 16)
    assert [(s.side, s.numel) for s in plan.segments] == [(4, 96), (0, 3)]


def test_top_k_is_the_largest_magnitudes_of_each_chunk():
    """Guards against top-k over the wrong elements (another chunk's, a tile's transpose) or
    by value instead of magnitude, and against a short chunk's padding chosen over its
    elements."""
    plan = _plan()
    e = torch.randn(plan.numel, generator=torch.Generator().manual_seed(0))
    k = 3
    index, values = choose(e, plan, k)
    pos, ok = plan.positions(index)
    assert ok.all()  # every chunk has >= 3 valid elements here
    assert torch.equal(values, e[pos])
    all_pos, all_ok = _elements(plan)
    for c in range(plan.chunks):
        mags = e[all_pos[c][all_ok[c]]].abs()
        assert torch.equal(e[pos[c]].abs().sort().values, mags.sort().values[-k:])


def test_bins_decode_to_the_mean_of_their_values():
    """Guards against a quantiser that decodes a bin to its centre (or an edge) instead of the
    mean of what fell into it, bins outside +-6 sigma of each group's own mean, statistics
    mixed across groups, or padding entries counted."""
    g = torch.Generator().manual_seed(1)
    values = torch.cat([torch.randn(40, generator=g), 100 + 5 * torch.randn(30, generator=g)])
    groups = torch.tensor([0] * 40 + [1] * 30)
    valid = torch.ones(70, dtype=torch.bool)
    valid[5] = False
    for bits in (2, 4, 8):
        codes, table = quantise(values, groups, valid, 2, bits)
        nb = 1 << bits
        assert codes.min() >= 0 and codes.max() < nb
        for grp in range(2):
            sel = (groups == grp) & valid
            v = values[sel]
            mu, sigma = v.mean(), v.std()
            width = 2 * RANGE_SIGMAS * sigma / nb
            want = ((v - mu) / width + nb // 2).floor().clamp(0, nb - 1).long()
            assert torch.equal(codes[sel], want)
            for b in range(nb):
                members = v[want == b]
                expect = members.mean() if members.numel() else torch.tensor(0.0)
                assert torch.allclose(table[grp, b], expect, rtol=1e-6, atol=1e-6)


def test_quantiser_degenerate_and_non_finite_groups():
    """Guards against a group of equal values (sigma 0) dividing by zero into out-of-range
    codes, and a NaN indexing outside the table (a crash) instead of making its group's
    table non-finite (so the receivers' mean is non-finite and dropped)."""
    values = torch.tensor([2.0, 2.0, 2.0, 1.0, float("nan"), 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    codes, table = quantise(values, groups, torch.ones(6, dtype=torch.bool), 2, 2)
    assert codes[:3].tolist() == [2, 2, 2] and table[0, 2].item() == 2.0
    assert codes.min() >= 0 and codes.max() < 4
    assert not torch.isfinite(table[1]).all() and torch.isfinite(table[0]).all()


@pytest.mark.parametrize("bits", range(1, 17))
def test_bit_packing_round_trips(bits):
    """Guards against packed indices or codes that decode to other values at any width, and
    against a payload longer than ceil(n * bits / 8) bytes."""
    v = torch.randint(0, 1 << bits, (101,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(v, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == (101 * bits + 7) // 8
    assert torch.equal(unpack_bits(packed, bits, 101), v)


def test_twelve_bit_indices_are_two_per_three_bytes():
    """Guards against 12-bit indices sent in 2 bytes each (a third more bytes) or in another
    bit order than the payload layout documents (LSB first)."""
    assert index_bits(4096) == 12 and index_bits(4097) == 13 and index_bits(64) == 6
    assert pack_bits(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]


@pytest.mark.parametrize("bits", [2, 4, 8, 0])
def test_payload_is_fixed_size_and_decodes_to_what_was_sent(bits):
    """Guards against a payload whose size depends on the values (the all-gather needs equal
    sizes), bytes left uncounted (indices, codes, tables), and a receiver decoding other
    entries than the sender's own decoded copy (the replicas' means would differ from what
    the senders' error buffers subtract)."""
    plan = _plan()
    k = 3
    layout = PayloadLayout(plan, k, bits)
    entries = plan.chunks * k
    vb = bits or 32
    def whole_words(nbits: int) -> int:  # bytes, rounded up to a multiple of 4
        return -(-nbits // 32) * 4

    assert layout.nbytes == (4 + whole_words(entries * 4) + whole_words(entries * vb)  # weight, 4-bit indices
                             + (plan.groups * (1 << bits) * 4 if bits else 0))
    for seed in range(3):
        e = torch.randn(plan.numel, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
        payload, sent = encode(e, plan, layout, weight=0.25 * seed)
        assert payload.numel() == layout.nbytes and sender_weight(payload, layout).item() == 0.25 * seed
        got = decode(payload, plan, layout)
        assert all(torch.equal(a, b) for a, b in zip(sent, got))
        if not bits:
            _, values = choose(e, plan, k)
            assert torch.equal(got[1], values.reshape(-1))


def test_garbled_payload_decodes_in_range():
    """Guards against a payload of a failed collective (garbage bytes) crashing the decode or
    writing outside the shard (indices past a chunk's valid elements, C not a power of two)."""
    plan = _plan(chunk=24)
    layout = PayloadLayout(plan, 5, 2)
    junk = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    pos, values, valid = decode(junk, plan, layout)
    assert pos.min() >= 0 and pos.max() < plan.numel
    out = torch.zeros(plan.numel)
    scatter_add_(out, (pos, values, valid))  # (no IndexError)


def test_error_feedback_keeps_what_was_not_sent():
    """Guards against an error buffer that forgets the unsent remainder (e <- delta), double
    counts the sent part (no subtraction), or subtracts something else than the decoded
    payload: after each exchange e + decoded(sent) == beta * e_before + delta, and an
    unsent entry is exactly beta * e_before + delta."""
    plan = _plan()
    comp = SparseCompressor(plan, 2, 2, beta=0.9)
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        before = comp.error.clone()
        delta = torch.randn(plan.numel, generator=g)
        _, (pos, values, valid) = comp.compress(delta)
        target = 0.9 * before + delta
        rebuilt = comp.error.clone()
        scatter_add_(rebuilt, (pos, values, valid))
        assert torch.allclose(rebuilt, target, atol=1e-6)
        unsent = torch.ones(plan.numel, dtype=torch.bool)
        unsent[pos[valid]] = False
        assert torch.equal(comp.error[unsent], target[unsent])
    without = SparseCompressor(plan, 2, 2, error_feedback=False)
    assert without.error is None and without.state_dict() == {"error": None}


def test_an_overflow_does_not_poison_the_error_buffer():
    """Guards against a NaN/Inf outer gradient staying in the error buffer for good (every
    later payload non-finite, the outer step dropped forever), while the payload itself still
    carries it (so the mean is dropped once)."""
    plan = _plan()
    comp = SparseCompressor(plan, 2, 2)
    delta = torch.randn(plan.numel, generator=torch.Generator().manual_seed(5))
    delta[3], delta[50] = float("nan"), float("inf")
    _, (pos, values, valid) = comp.compress(delta)
    assert not torch.isfinite(torch.where(valid, values, 0.0)).all()
    assert torch.isfinite(comp.error).all()
    _, (_, values, _) = comp.compress(torch.randn(plan.numel, generator=torch.Generator().manual_seed(6)))
    assert torch.isfinite(values).all()


def test_compressor_state_save_then_load():
    """Guards against a checkpointed error buffer that does not come back bit for bit (a
    resumed run sends other entries), or a state dict aliasing the live buffer (a discarded
    exchange could not put it back), or a buffer of another shard loading silently."""
    plan = _plan()
    comp = SparseCompressor(plan, 2, 2)
    comp.compress(torch.randn(plan.numel, generator=torch.Generator().manual_seed(7)))
    sd = comp.state_dict()
    saved = sd["error"].clone()
    comp.compress(torch.randn(plan.numel))
    assert torch.equal(sd["error"], saved)
    other = SparseCompressor(plan, 2, 2)
    other.load_state_dict(sd)
    assert torch.equal(other.error, saved)
    with pytest.raises(ValueError, match="does not fit"):
        SparseCompressor(_plan(PIECES[:2]), 2, 2).load_state_dict(sd)
    other.reset()
    assert not other.error.any()
