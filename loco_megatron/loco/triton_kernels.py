"""Fused Triton kernels for LoCo's compress and decompress-and-sum (GPU; CPU under
``TRITON_INTERPRET=1`` for tests).

They compute exactly what the pure-torch reference (:mod:`.quantize`,
:class:`.LoCoCompressor`, :func:`.collectives.decompress_sum`) computes, in one pass
over memory per bucket:

* :func:`compress`: reads ``g`` (fp32/bf16) and the int8 error with its block scales;
  writes packed codes, fp32 block scales, the updated int8 error and its scales (into
  scratch: the NaN/Inf rule needs the whole buffer's verdict before the error may
  change, so the caller selects new-or-old on the device), and per-block sums for the
  metrics. Codes and scales are bit-identical to the reference: the same fp32
  operations in the same order, IEEE division (``div_rn``), round-half-even.
* :func:`decompress_sum`: reads the ``W`` received rows (codes + scales) of one shard
  and writes ``scale * sum_r D(codes_r, scales_r)``, summed in fp32 in rank order, into
  the shard (cast to its dtype) - bit-identical to the reference.

The tile of one program is ``[ROWS, K, B/K]``: ``ROWS`` quantisation blocks of ``B``
elements, each split into the ``K = 8/bits`` planes that share a byte (the planar
packing of :mod:`.quantize`), so packing is a shift-and-sum over the middle axis.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A global read inside @triton.jit must be a tl.constexpr: the compiler (unlike the CPU
# interpreter) refuses any other global, so a plain float here passed every interpreted test
# and failed to compile on the first real GPU.
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (x + M) - M rounds fp32 |x| < 2**22 half to even


@triton.jit
def _round_half_even(x):
    # IEEE addition rounds to nearest even; |x| <= qmax here, far below 2**22.
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def _mul(a, b, NO_FMA: tl.constexpr):
    """``a * b`` rounded on its own. The GPU compiler contracts ``a * b + c`` into one FMA
    (one rounding), where torch's reference rounds the product and then the sum; the
    explicit ``mul.rn`` of PTX is never contracted. The interpreter never contracts."""
    if NO_FMA:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _block_absmax(x):
    """max |x| over a block's planes, NaN-propagating like torch.amax (tl.max is not, and a
    NaN must give a NaN scale so the overflow stays visible). Two built-in reductions
    rather than a custom combine function, which the interpreter runs element by element."""
    m = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    nans = tl.sum(tl.sum((x != x).to(tl.int32), axis=2), axis=1)
    return tl.where(nans > 0, float("nan"), m)


@triton.jit
def _codes(h, s, QMAX: tl.constexpr):
    """clamp(round(h / s)) with s == 0 -> code 0 and NaN -> code 0 (as the reference)."""
    d = tl.where(s > 0, s, float("inf"))
    q = _round_half_even(tl.math.div_rn(h, d[:, None, None]))
    q = tl.where(q == q, q, 0.0)  # NaN (from a non-finite block) -> 0
    return tl.minimum(tl.maximum(q, -QMAX), QMAX)


@triton.jit
def _tile(pid, ROWS: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Block indices ``[ROWS]`` of program ``pid`` and the ``[ROWS, K, BK]`` element
    offsets of its tile in block space, in int64: a bucket of 2**31 elements or more
    (one stage as one bucket with --no-overlap-grad-reduce) would overflow int32."""
    blocks = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    plane = tl.arange(0, K).to(tl.int64)
    col = tl.arange(0, BK).to(tl.int64)
    offs = blocks[:, None, None] * (K * BK) + plane[None, :, None] * BK + col[None, None, :]
    return blocks, offs


@triton.jit
def _compress_kernel(g_ptr, err_ptr, err_s_ptr, codes_ptr, scales_ptr, new_err_ptr, new_err_s_ptr,
                     stats_ptr, numel, num_blocks, row_numel, row_blocks, beta, alpha,
                     BITS: tl.constexpr, B: tl.constexpr, ROWS: tl.constexpr, HAS_ERR: tl.constexpr,
                     NO_FMA: tl.constexpr):
    K: tl.constexpr = 8 // BITS
    BK: tl.constexpr = B // K
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    rows, offs = _tile(tl.program_id(0), ROWS, K, BK)
    row_ok = rows < num_blocks
    plane = tl.arange(0, K)
    col = tl.arange(0, BK)
    # Block space is row-major over the buffer's rows, each padded to whole blocks: block
    # i holds elements [c0, c0 + B) of row i // row_blocks, zero past the row's end.
    in_row = (rows % row_blocks) * B
    pos = in_row[:, None, None] + offs - rows[:, None, None] * B
    g_offs = (rows // row_blocks)[:, None, None] * row_numel + pos
    in_buf = row_ok[:, None, None] & (pos < row_numel) & (g_offs < numel)
    g = tl.load(g_ptr + g_offs, mask=in_buf, other=0.0).to(tl.float32)
    if HAS_ERR:
        ok3 = row_ok[:, None, None] & (offs >= 0)
        e8 = tl.load(err_ptr + offs, mask=ok3, other=0).to(tl.float32)
        es = tl.load(err_s_ptr + rows, mask=row_ok, other=0.0)
        h = _mul(e8, es[:, None, None], NO_FMA) + g  # same product and sum as torch.mul(...).add_(g)
    else:
        h = g
    s = tl.math.div_rn(_block_absmax(h), QMAX * 1.0)
    q = _codes(h, s, QMAX)
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
        new_e = tl.fma(resid, alpha, _mul(h - g, beta, NO_FMA))
        new_s = tl.math.div_rn(_block_absmax(new_e), 127.0)
        new_q = _codes(new_e, new_s, 127)
        ok3 = row_ok[:, None, None] & (offs >= 0)
        tl.store(new_err_ptr + offs, new_q.to(tl.int8), mask=ok3)
        tl.store(new_err_s_ptr + rows, new_s, mask=row_ok)
        e_sq = tl.sum(tl.sum(new_e * new_e, axis=2), axis=1)
    else:
        e_sq = r_sq * 0.0
    tl.store(stats_ptr + rows * 3 + 0, e_sq, mask=row_ok)
    tl.store(stats_ptr + rows * 3 + 1, r_sq, mask=row_ok)
    tl.store(stats_ptr + rows * 3 + 2, h_sq, mask=row_ok)


@triton.jit
def _decompress_sum_kernel(recv_ptr, recv_f32_ptr, out_ptr, shard, shard_blocks, row_bytes, code_bytes, scale,
                           WORLD: tl.constexpr, BITS: tl.constexpr, B: tl.constexpr, ROWS: tl.constexpr,
                           OUT_BF16: tl.constexpr, NO_FMA: tl.constexpr):
    K: tl.constexpr = 8 // BITS
    BK: tl.constexpr = B // K
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    MASK: tl.constexpr = (1 << BITS) - 1
    rows, offs = _tile(tl.program_id(0), ROWS, K, BK)
    row_ok = rows < shard_blocks
    plane = tl.arange(0, K)
    col = tl.arange(0, BK)
    byte_offs = rows[:, None] * BK + col[None, :].to(tl.int64)
    row_bytes64 = row_bytes.to(tl.int64)
    shift = (plane * BITS)[None, :, None]
    acc = tl.zeros((ROWS, K, BK), dtype=tl.float32)
    for r in range(WORLD):  # rank order: the same fp32 additions as the reference
        packed = tl.load(recv_ptr + r * row_bytes64 + byte_offs, mask=row_ok[:, None] & (col[None, :] >= 0),
                         other=0).to(tl.int32)
        q = ((packed[:, None, :] >> shift) & MASK) - OFFSET
        s = tl.load(recv_f32_ptr + (r * row_bytes64 + code_bytes) // 4 + rows, mask=row_ok, other=0.0)
        # 0 + x == x exactly, so starting from zeros matches the reference's acc = part_0.
        acc += _mul(q.to(tl.float32), s[:, None, None], NO_FMA)
    acc = acc * scale  # exact when scale == 1.0
    if OUT_BF16:
        # fp32 -> bf16 rounding to nearest even on the bits, as torch's copy_ does (and
        # the same in the interpreter, whose own cast truncates); NaN stays a quiet NaN.
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + offs, tl.where(acc != acc, 0x7FC0, rounded).to(tl.uint16), mask=offs < shard)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < shard)


def _no_fma(t: torch.Tensor) -> bool:
    """Compiled for an NVIDIA GPU (PTX inline assembly available); the interpreter and
    ROCm take the plain product."""
    return t.is_cuda and torch.version.hip is None and not triton_interpreted()


def triton_interpreted() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1, chosen before import)."""
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
    return isinstance(_compress_kernel, InterpretedFunction)


def _rows(t: torch.Tensor) -> int:
    """Quantisation blocks per program: a 1024-element tile on a GPU (B=256); on CPU, under
    the interpreter, big tiles, since there every program costs Python overhead."""
    return 4 if t.is_cuda else 64


def compress(g: torch.Tensor, err, err_scales, beta: float, bits: int, block_size: int,
             new_err, new_err_scales, stats: torch.Tensor, row_numel: int = None,
             row_blocks: int = None, num_blocks: int = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused compress of flat ``g`` (``numel`` elements in rows of ``row_numel``,
    each padded to ``row_blocks`` whole blocks; default: one row).

    ``err``/``err_scales``: int8 ``[nb, B]`` and fp32 ``[nb]`` (None without error
    feedback); ``new_err``/``new_err_scales`` receive the updated error; ``stats`` fp32
    ``[nb, 3]`` receives per-block ``(sum e_new^2, sum resid^2, sum h^2)``. Returns
    ``(codes, scales)`` as :func:`quantize_blockwise` does.
    """
    numel = g.numel()
    row_numel = numel if row_numel is None else row_numel
    row_blocks = -(-row_numel // block_size) if row_blocks is None else row_blocks
    nb = (-(-numel // row_numel) * row_blocks if numel else 0) if num_blocks is None else num_blocks
    codes = torch.empty(nb * block_size * bits // 8, dtype=torch.uint8, device=g.device)
    scales = torch.empty(nb, dtype=torch.float32, device=g.device)
    has_err = err is not None
    dummy = scales  # never dereferenced when HAS_ERR is False
    rows = _rows(g)
    _compress_kernel[(triton.cdiv(nb, rows),)](
        g.reshape(-1), err if has_err else dummy, err_scales if has_err else dummy, codes, scales,
        new_err if has_err else dummy, new_err_scales if has_err else dummy, stats, numel, nb, row_numel, row_blocks, float(beta), 1.0 - beta,
        BITS=bits, B=block_size, ROWS=rows, HAS_ERR=has_err, NO_FMA=_no_fma(g))
    return codes, scales


def decompress_sum(recv: torch.Tensor, layout, out: torch.Tensor, scale: float = 1.0) -> None:
    """Write ``scale * sum_r D(row r)`` of ``recv`` (uint8 ``[W, row_bytes]``) into ``out``
    (this rank's shard: its first ``out.numel() <= layout.shard`` elements, any float dtype)."""
    assert recv.is_contiguous() and layout.row_bytes % 4 == 0 and layout.code_bytes % 4 == 0
    assert out.dtype in (torch.float32, torch.bfloat16, torch.float16), out.dtype
    bf16 = out.dtype == torch.bfloat16
    rows = _rows(recv)
    _decompress_sum_kernel[(triton.cdiv(layout.shard_blocks, rows),)](
        recv, recv.view(torch.float32), out.view(torch.uint16) if bf16 else out, out.numel(), layout.shard_blocks, layout.row_bytes,
        layout.code_bytes, float(scale), WORLD=layout.world, BITS=layout.bits, B=layout.block_size, ROWS=rows,
        OUT_BF16=bf16, NO_FMA=_no_fma(recv))
