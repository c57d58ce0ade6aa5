"""The fused @triton.jit kernels (launched by :mod:`.` with the right constexprs): LoCo's
compress and decompress-and-sum, and the parameter gather's decode-and-apply.

The tile of one program is ``[ROWS, K, B/K]``: ``ROWS`` quantisation blocks of ``B``
elements, each split into the ``K = 8/bits`` planes that share a byte (the planar
packing of :mod:`..quantize`), so packing is a shift-and-sum over the middle axis; the
rotation and the mse search see the same tile as ``[ROWS, B]`` (element ``j`` of a block
is plane ``j // (B/K)``, column ``j % (B/K)``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loco_megatron.loco.triton_kernels import jit as J


@triton.jit(do_not_specialize=["key"])
def _compress_kernel(g_ptr, err_ptr, err_s_ptr, codes_ptr, scales_ptr, new_err_ptr, new_err_s_ptr,
                     stats_ptr, signs_ptr, numel, num_blocks, row_numel, row_blocks, beta, alpha, rot_scale, key,
                     BITS: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr, ROWS: tl.constexpr,
                     HAS_ERR: tl.constexpr, UNIFORM: tl.constexpr, MSE: tl.constexpr, ROTATE: tl.constexpr,
                     STOCHASTIC: tl.constexpr, NO_FMA: tl.constexpr, TILES: tl.constexpr = 1,
                     EVEN: tl.constexpr = False):
    """LoCo's compress of blocks ``[TILES * ROWS * pid, TILES * ROWS * (pid + 1))``: each
    program walks ``TILES`` consecutive tiles of ``ROWS`` blocks (many blocks per program:
    the signs, the constants and the program's start-up are paid once per ``TILES * ROWS``
    blocks, and the grid stays small), one pass over the gradient and the error per tile.

    Bytes moved per gradient element (B = 256; ``g`` fp32, bf16 in brackets): read ``g`` 4
    [2] and the int8 error 1 (+4/B for its scale); write the codes bits/8 (0.5 at 4 bits,
    0.25 at 2), the new int8 error 1 (+4/B), the scale 4/B and three fp32 sums 12/B: about
    6.6 [4.6] bytes at 4 bits, where a device copy of the fp32 gradient moves 8, so the
    kernel is memory-bound by design (the NaN rule's select of the new error, outside the
    kernel, adds 3 bytes: read both errors, write one). Without error feedback: 4.6 [2.6].

    ``EVEN`` (set by the launcher when every row is whole blocks, ``row_numel % B == 0``):
    block space *is* the buffer, so the gradient's offsets are the tile's own, contiguous
    per block, with no per-element row arithmetic or padding mask (vectorised loads); else
    each block finds its row and zero-pads past the row's end. Offsets are int64."""
    for t in range(TILES):
        _compress_tile(tl.program_id(0).to(tl.int64) * TILES + t, g_ptr, err_ptr, err_s_ptr, codes_ptr, scales_ptr,
                       new_err_ptr, new_err_s_ptr, stats_ptr, signs_ptr, numel, num_blocks, row_numel, row_blocks,
                       beta, alpha, rot_scale, key, BITS, B, LOG_B, ROWS, HAS_ERR, UNIFORM, MSE, ROTATE, STOCHASTIC,
                       NO_FMA, EVEN)


@triton.jit
def _compress_tile(tile, g_ptr, err_ptr, err_s_ptr, codes_ptr, scales_ptr, new_err_ptr, new_err_s_ptr,
                   stats_ptr, signs_ptr, numel, num_blocks, row_numel, row_blocks, beta, alpha, rot_scale, key,
                   BITS: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr, ROWS: tl.constexpr,
                   HAS_ERR: tl.constexpr, UNIFORM: tl.constexpr, MSE: tl.constexpr, ROTATE: tl.constexpr,
                   STOCHASTIC: tl.constexpr, NO_FMA: tl.constexpr, EVEN: tl.constexpr):
    """One tile of :func:`_compress_kernel` (``tile``: its index, ``ROWS`` blocks)."""
    K: tl.constexpr = 8 // BITS
    BK: tl.constexpr = B // K
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    TOP: tl.constexpr = (1 << (BITS - 1)) if UNIFORM else QMAX  # quantize.top_level
    LO: tl.constexpr = -TOP if UNIFORM else -QMAX  # quantize.code_range
    rows, offs = J.tile(tile, ROWS, K, BK)
    row_ok = rows < num_blocks
    plane = tl.arange(0, K)
    col = tl.arange(0, BK)
    idx = plane[None, :, None] * BK + col[None, None, :]  # element index within its block
    if EVEN:  # whole blocks only: a block is wholly inside the buffer or wholly past it
        g = tl.load(g_ptr + offs, mask=(row_ok & (rows * B < numel))[:, None, None], other=0.0).to(tl.float32)
    else:
        # Block space is row-major over the buffer's rows, each padded to whole blocks: block
        # i holds elements [c0, c0 + B) of row i // row_blocks, zero past the row's end.
        in_row = (rows % row_blocks) * B
        pos = in_row[:, None, None] + offs - rows[:, None, None] * B
        g_offs = (rows // row_blocks)[:, None, None] * row_numel + pos
        in_buf = row_ok[:, None, None] & (pos < row_numel) & (g_offs < numel)
        g = tl.load(g_ptr + g_offs, mask=in_buf, other=0.0).to(tl.float32)
    if ROTATE:  # the step runs in the rotated domain: h = R(g) + e (compressor._compensate)
        d = tl.load(signs_ptr + tl.arange(0, B))
        g = tl.reshape(J.rotate(tl.reshape(g, (ROWS, B)), d, rot_scale, ROWS, B, LOG_B, False, NO_FMA),
                       (ROWS, K, BK))
    ok3 = row_ok[:, None, None]  # per block: constant along the block, so loads stay vectorised
    if HAS_ERR:
        e8 = tl.load(err_ptr + offs, mask=ok3, other=0).to(tl.float32)
        es = tl.load(err_s_ptr + rows, mask=row_ok, other=0.0)
        e = J.mul(e8, es[:, None, None], NO_FMA)
        h = e + g  # same product and sum as torch.mul(...) then add
    else:
        h = g
    m = J.block_absmax(h)
    if UNIFORM:  # signed: -extreme / 2**(bits-1)
        s = tl.math.div_rn(J.signed_extreme(h, idx, m, B), -TOP * 1.0)
    else:
        s = tl.math.div_rn(m, TOP * 1.0)
    if MSE:
        s = J.mse_scale(tl.reshape(h, (ROWS, B)), s, LO, QMAX, ROWS, B, LOG_B, NO_FMA)
    if STOCHASTIC:
        noise = J.uniform_noise(offs, key.to(tl.uint32))
    else:
        noise = 0.0
    q = J.levels(h, s, noise, LO, QMAX, STOCHASTIC)
    tl.store(scales_ptr + rows, s, mask=row_ok)
    # Offset binary, planar: byte j of a block holds plane i's code j in bits [i*BITS, ...).
    u = (q + (1 << (BITS - 1))).to(tl.int32)
    shift = (plane * BITS)[None, :, None]
    packed = tl.sum(u << shift, axis=1)  # planes occupy disjoint bits: sum == or
    byte_offs = rows[:, None] * BK + col[None, :].to(tl.int64)
    tl.store(codes_ptr + byte_offs, packed.to(tl.uint8), mask=row_ok[:, None] & (col[None, :] >= 0))
    resid = tl.fma(-q, s[:, None, None], h)  # one rounding, as torch.addcmul (FMA) does
    h_sq = tl.sum(tl.sum(h * h, axis=2), axis=1)
    r_sq = tl.sum(tl.sum(resid * resid, axis=2), axis=1)
    if HAS_ERR:
        # The reference's h.mul_(beta).add_(resid, alpha=1 - beta): a rounded product, then
        # one FMA (torch's add with alpha is a fused multiply-add on CPU and CUDA), with
        # alpha = fp32(1 - beta) from the host (1 - fp32(beta) differs in the last bit).
        # Rotated, the reference re-reads e (h - R(g) would round differently).
        prev = e if ROTATE else h - g
        new_e = tl.fma(resid, alpha, J.mul(prev, beta, NO_FMA))
        new_s = tl.math.div_rn(J.block_absmax(new_e), 127.0)
        new_q = J.levels(new_e, new_s, 0.0, -127, 127, False)
        tl.store(new_err_ptr + offs, new_q.to(tl.int8), mask=ok3)
        tl.store(new_err_s_ptr + rows, new_s, mask=row_ok)
        e_sq = tl.sum(tl.sum(new_e * new_e, axis=2), axis=1)
    else:
        e_sq = r_sq * 0.0
    tl.store(stats_ptr + rows * 3 + 0, e_sq, mask=row_ok)
    tl.store(stats_ptr + rows * 3 + 1, r_sq, mask=row_ok)
    tl.store(stats_ptr + rows * 3 + 2, h_sq, mask=row_ok)


@triton.jit
def _decompress_sum_kernel(recv_ptr, recv_f32_ptr, out_ptr, signs_ptr, shard, shard_blocks, row_bytes, code_bytes,
                           scale, rot_scale, WORLD: tl.constexpr, BITS: tl.constexpr, B: tl.constexpr,
                           LOG_B: tl.constexpr, ROWS: tl.constexpr, ROTATE: tl.constexpr, OUT_BF16: tl.constexpr,
                           NO_FMA: tl.constexpr):
    K: tl.constexpr = 8 // BITS
    BK: tl.constexpr = B // K
    rows, offs = J.tile(tl.program_id(0), ROWS, K, BK)
    row_ok = rows < shard_blocks
    col = tl.arange(0, BK)
    byte_offs = rows[:, None] * BK + col[None, :].to(tl.int64)
    byte_ok = row_ok[:, None] & (col[None, :] >= 0)
    row_bytes64 = row_bytes.to(tl.int64)
    # acc = part_0, then += part_r in rank order: the reference's fp32 additions (starting
    # from zeros instead would turn a -0.0 part, q = 0 under a negative uniform scale, into +0.0).
    s = tl.load(recv_f32_ptr + code_bytes // 4 + rows, mask=row_ok, other=0.0)
    acc = J.dequant(recv_ptr, byte_offs, byte_ok, s, BITS, K, NO_FMA)
    for r in range(1, WORLD):
        s = tl.load(recv_f32_ptr + (r * row_bytes64 + code_bytes) // 4 + rows, mask=row_ok, other=0.0)
        acc += J.dequant(recv_ptr + r * row_bytes64, byte_offs, byte_ok, s, BITS, K, NO_FMA)
    if ROTATE:  # the rows were rotated: unrotate the sum once (linear), before the scaling
        d = tl.load(signs_ptr + tl.arange(0, B))
        acc = tl.reshape(J.rotate(tl.reshape(acc, (ROWS, B)), d, rot_scale, ROWS, B, LOG_B, True, NO_FMA),
                         (ROWS, K, BK))
    acc = J.mul(acc, scale, NO_FMA)  # exact when scale == 1.0
    if OUT_BF16:  # rounded to nearest even on the bits, as torch's copy_ does
        tl.store(out_ptr + offs, J.bf16_bits(acc), mask=offs < shard)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < shard)


@triton.jit
def _param_apply_kernel(codes_ptr, scales_ptr, src_ptr, dst_ptr, new_ptr, dst2_ptr, norms_ptr, signs_ptr, numel,
                        num_blocks, rot_scale, BITS: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
                        ROWS: tl.constexpr, ROTATE: tl.constexpr, DTYPE: tl.constexpr, OWN: tl.constexpr,
                        HAS_DST2: tl.constexpr, SWAP: tl.constexpr, NO_FMA: tl.constexpr):
    """``dst = cast(float(src) + D(codes, scales))`` for blocks ``[0, num_blocks)`` of one
    gathered row (``numel`` elements; the contract of ``csrc/param_apply.h``): the delta
    ``q * s`` (an explicit ``mul.rn``: it feeds an add), unrotated with ``ROTATE``, added
    in fp32 and cast once. In place (not ``OWN``) a block whose scale is zero is neither
    decoded nor written unless its source holds a -0.0 (x + (+-0) == x for every other x).
    ``OWN``: every element is applied, ``dst2`` gets the new values (``SWAP``) or the
    result, and each program writes its blocks' ``(sum (result - new)^2, sum new^2)``
    into ``norms[pid]``. Every element is loaded (src, new) before anything is stored, so
    ``new`` may be ``dst`` and ``dst2`` may be ``src``."""
    K: tl.constexpr = 8 // BITS
    BK: tl.constexpr = B // K
    rows, offs = J.tile(tl.program_id(0), ROWS, K, BK)
    row_ok = rows < num_blocks
    in_shard = offs < numel
    s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
    raw = tl.load(src_ptr + offs, mask=in_shard, other=0)
    x, neg_zero = J.param_load(raw, DTYPE)
    if OWN:
        new_raw = tl.load(new_ptr + offs, mask=in_shard, other=0)
        need = row_ok
    else:  # a zero scale is a delta of signed zeros: only a -0.0 source can change
        need = row_ok & ((s != 0) | (tl.sum(tl.sum(neg_zero.to(tl.int32), axis=2), axis=1) > 0))
    col = tl.arange(0, BK)
    byte_offs = rows[:, None] * BK + col[None, :].to(tl.int64)
    delta = J.dequant(codes_ptr, byte_offs, need[:, None] & (col[None, :] >= 0), s, BITS, K, NO_FMA)
    if ROTATE:  # the encode rotated the difference: the delta is unrotated per block
        d = tl.load(signs_ptr + tl.arange(0, B))
        delta = tl.reshape(J.rotate(tl.reshape(delta, (ROWS, B)), d, rot_scale, ROWS, B, LOG_B, True, NO_FMA),
                           (ROWS, K, BK))
    result = J.param_cast(x + delta, DTYPE)
    tl.store(dst_ptr + offs, result, mask=in_shard & need[:, None, None])
    if OWN:
        back, _ = J.param_load(result, DTYPE)
        new, _ = J.param_load(new_raw, DTYPE)
        diff = tl.where(in_shard, back - new, 0.0)
        tl.store(norms_ptr + tl.program_id(0) * 2, tl.sum(tl.sum(tl.sum(diff * diff, axis=2), axis=1), axis=0))
        tl.store(norms_ptr + tl.program_id(0) * 2 + 1, tl.sum(tl.sum(tl.sum(new * new, axis=2), axis=1), axis=0))
        if HAS_DST2:
            if SWAP:
                tl.store(dst2_ptr + offs, new_raw, mask=in_shard)
            else:
                tl.store(dst2_ptr + offs, result, mask=in_shard)
