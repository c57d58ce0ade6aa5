"""@triton.jit helpers of the fused kernels: each one is an operation of the torch reference
(:mod:`..quantize`, :mod:`..rotation`) with the same fp32 operations on the same operands in
the same order, so the kernels' results are bit-identical to it.

Two rules keep them so on a GPU, where the interpreter (CPU tests) cannot tell:

* the compiler contracts ``a * b + c`` into one FMA (one rounding) where the reference
  rounds the product first: every product that feeds an addition goes through
  :func:`mul` (an explicit ``mul.rn``, never contracted) when ``NO_FMA``;
* a global read inside a @triton.jit function must be a ``tl.constexpr`` (the compiler
  refuses anything else; the interpreter accepts it).

Block-local permutations (the Walsh-Hadamard butterflies, the halvings of the tree sum)
are reshapes of the ``[ROWS, B]`` tile into ``[n, 2, h]`` and a pick of each half by an
integer sum over the axis of 2 on the values' bits (exact, and keeps the sign of a zero,
which a float sum starting from +0 would not).
"""

from __future__ import annotations

import triton
import triton.language as tl

# A global read inside @triton.jit must be a tl.constexpr: the compiler (unlike the CPU
# interpreter) refuses any other global, so a plain float here passed every interpreted test
# and failed to compile on the first real GPU.
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (x + M) - M rounds fp32 |x| < 2**22 half to even
# quantize.MSE_CLIP_RATIOS as fp32 and fp32(1 / fp32(c)) (torch divides two fp32 scalars);
# the values are exact fp32 numbers written as Python floats (see test_mse_constants).
CLIP0, INV0 = tl.constexpr(1.0), tl.constexpr(1.0)
CLIP1, INV1 = tl.constexpr(0.8999999761581421), tl.constexpr(1.1111111640930176)
CLIP2, INV2 = tl.constexpr(0.800000011920929), tl.constexpr(1.25)
CLIP3, INV3 = tl.constexpr(0.699999988079071), tl.constexpr(1.4285714626312256)
CLIP4, INV4 = tl.constexpr(0.6000000238418579), tl.constexpr(1.6666666269302368)
CLIP5, INV5 = tl.constexpr(0.5), tl.constexpr(2.0)
_HASH_MUL = tl.constexpr(0x45D9F3B)
_TWO_M24 = tl.constexpr(5.9604644775390625e-08)  # 2**-24, exact


@triton.jit
def round_half_even(x):
    # IEEE addition rounds to nearest even; |x| <= qmax here, far below 2**22.
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def mul(a, b, NO_FMA: tl.constexpr):
    """``a * b`` rounded on its own. The GPU compiler contracts ``a * b + c`` into one FMA
    (one rounding), where torch's reference rounds the product and then the sum; the
    explicit ``mul.rn`` of PTX is never contracted. The interpreter never contracts."""
    if NO_FMA:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def block_absmax(x):
    """max |x| over a block's planes (``[ROWS, K, BK]`` -> ``[ROWS]``), NaN-propagating like
    torch.amax (tl.max is not, and a NaN must give a NaN scale so the overflow stays
    visible). Two built-in reductions rather than a custom combine function, which the
    interpreter runs element by element."""
    m = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    nans = tl.sum(tl.sum((x != x).to(tl.int32), axis=2), axis=1)
    return tl.where(nans > 0, float("nan"), m)


@triton.jit
def signed_extreme(x, idx, m, B: tl.constexpr):
    """quantize.scales._signed_extreme of ``[ROWS, K, BK]`` blocks: the first element (block index
    ``idx``, ``[1, K, BK]``) of magnitude ``m`` (``[ROWS]``, :func:`block_absmax`), with its
    sign; NaN where ``m`` is NaN. Picked on the bits, so a -0.0 stays -0.0."""
    hit = tl.abs(x) == m[:, None, None]
    first = tl.min(tl.min(tl.where(hit, idx, B), axis=2), axis=1)
    bits = tl.where(idx == first[:, None, None], x.to(tl.int32, bitcast=True), 0)
    v = tl.sum(tl.sum(bits, axis=2), axis=1).to(tl.float32, bitcast=True)
    return tl.where(m != m, float("nan"), v)


@triton.jit
def divisor(s):
    """quantize.divisor: ``s``, or +inf where ``s == 0`` (NaN stays NaN)."""
    return tl.where(s != 0, s, float("inf"))


@triton.jit
def halves(x3):
    """``(x3[:, 0, :], x3[:, 1, :])`` of ``[n, 2, h]``, exactly (signed zeros included)."""
    sel = tl.arange(0, 2)[None, :, None]
    bits = x3.to(tl.int32, bitcast=True)
    a = tl.sum(tl.where(sel == 0, bits, 0), axis=1).to(tl.float32, bitcast=True)
    b = tl.sum(tl.where(sel == 1, bits, 0), axis=1).to(tl.float32, bitcast=True)
    return a, b


@triton.jit
def wht(x, ROWS: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr):
    """rotation._wht of every row of fp32 ``[ROWS, B]``: the butterfly passes h = 1, 2, 4, ...
    in that order, ``(a + b, a - b)`` of each pair (adds and subtracts only: nothing to
    contract)."""
    for i in tl.static_range(LOG_B):
        # pass h = 2**i; the shapes written inline (a local bound to 1 << i would not stay a constexpr)
        a, b = halves(tl.reshape(x, (ROWS * B // (2 << i), 2, 1 << i)))
        sel = tl.arange(0, 2)[None, :, None]
        x = tl.reshape(tl.where(sel == 0, (a + b)[:, None, :], (a - b)[:, None, :]), (ROWS, B))
    return x


@triton.jit
def tree_sum(x, ROWS: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr):
    """quantize.tree_sum_ of every row of fp32 ``[ROWS, B]`` (B a power of two):
    ``x[i] += x[i + L/2]`` while ``L > 1``; ``[ROWS]``."""
    for i in tl.static_range(LOG_B):
        a, b = halves(tl.reshape(x, (ROWS, 2, B >> (i + 1))))  # L = B >> i
        x = a + b
    return tl.reshape(x, (ROWS,))


@triton.jit
def clip_ratios(k):
    """``(c, fp32(1/c))`` of candidate ``k`` (int32 tensor, 0..7; 6 and 7 repeat the last
    ratio to make the axis a power of two and are never picked)."""
    c = tl.where(k == 0, CLIP0, tl.where(k == 1, CLIP1, tl.where(k == 2, CLIP2, tl.where(
        k == 3, CLIP3, tl.where(k == 4, CLIP4, CLIP5)))))
    inv = tl.where(k == 0, INV0, tl.where(k == 1, INV1, tl.where(k == 2, INV2, tl.where(
        k == 3, INV3, tl.where(k == 4, INV4, INV5)))))
    return c.to(tl.float32), inv.to(tl.float32)


@triton.jit
def column(err, k, j: tl.constexpr):
    """Column ``j`` of ``[ROWS, 8]`` (``k = arange(8)``) as ``[ROWS]``: x + 0.0 + ... == x,
    NaN stays NaN."""
    return tl.sum(tl.where(k[None, :] == j, err, 0.0), axis=1)


@triton.jit
def mse_scale(h, base, LO: tl.constexpr, HI: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr,
              LOG_B: tl.constexpr, NO_FMA: tl.constexpr):
    """quantize.option_scales' mse search of ``[ROWS, B]`` blocks around ``base`` ``[ROWS]``:
    in units of the base, ``t = h / base``; candidate ``c``'s error ``sum_tree((t - q*c)^2)``
    with ``q = clamp(round(t * fp32(1/c)))`` (all candidates as one ``[ROWS, 8, B]`` tile, so
    the tree's halvings run once); then the descent of ``quantize.mse_choice`` (a NaN ``t``
    has a NaN error whatever level the clamp makes of it, and a NaN error never wins)."""
    t = tl.math.div_rn(h, divisor(base)[:, None])[:, None, :]
    k = tl.arange(0, 8)
    c, inv = clip_ratios(k)
    q = round_half_even(mul(t, inv[None, :, None], NO_FMA))
    q = tl.minimum(tl.maximum(q, LO * 1.0), HI * 1.0)
    r = t - mul(q, c[None, :, None], NO_FMA)
    err = tl.reshape(tree_sum(tl.reshape(mul(r, r, NO_FMA), (ROWS * 8, B)), ROWS * 8, B, LOG_B), (ROWS, 8))
    # The tile computes all six (cheap on a GPU); the choice reads the four a CPU kernel evaluates.
    best_c = tl.sum(tl.where(k[None, :] == mse_pick(err, k)[:, None], c[None, :], 0.0), axis=1)
    return mul(base, best_c, NO_FMA)


@triton.jit
def mse_pick(err, k):
    """``quantize.mse_choice`` of ``[ROWS, 8]`` candidate errors (columns 0-5 in the order
    of the ratios; ``k = arange(8)``): 0.8 vs 0.7 (ties go up), then up while at least as
    good, down only while strictly better; NaN compares false. int32 ``[ROWS]``."""
    e0, e1, e2, e3 = column(err, k, 0), column(err, k, 1), column(err, k, 2), column(err, k, 3)
    e4, e5 = column(err, k, 4), column(err, k, 5)
    up = tl.where(e1 <= e2, tl.where(e0 <= e1, 0, 1), 2)
    down = tl.where(e4 < e3, tl.where(e5 < e4, 5, 4), 3)
    return tl.where(e2 <= e3, up, down)


@triton.jit
def mix32(x):
    """quantize.rounding._mix32 on uint32 (the products wrap mod 2**32 as the reference masks them)."""
    x = ((x >> 16) ^ x) * _HASH_MUL
    x = ((x >> 16) ^ x) * _HASH_MUL
    return (x >> 16) ^ x


@triton.jit
def uniform_noise(idx, key):
    """quantize.uniform_noise at int64 element indices ``idx`` of the buffer's block space
    (``key``: uint32): fp32 in [0, 1)."""
    lo = (idx & 0xFFFFFFFF).to(tl.uint32)
    hi = (idx >> 32).to(tl.uint32)
    h = mix32(mix32(lo ^ key) + hi)
    return (h >> 8).to(tl.int32).to(tl.float32) * _TWO_M24


@triton.jit
def levels(h, s, noise, LO: tl.constexpr, HI: tl.constexpr, STOCHASTIC: tl.constexpr):
    """quantize.levels_ of ``[ROWS, K, BK]`` blocks with scales ``s`` ``[ROWS]``:
    ``clamp(round(h / s))`` or ``clamp(floor(h / s + u))``, ``s == 0`` -> code 0, NaN -> 0
    (tested before the clamp: the GPU's min/max drop a NaN)."""
    y = tl.math.div_rn(h, divisor(s)[:, None, None])
    if STOCHASTIC:
        q = tl.floor(y + noise)
    else:
        q = round_half_even(y)
    q = tl.where(q == q, q, 0.0)
    return tl.minimum(tl.maximum(q, LO * 1.0), HI * 1.0)


@triton.jit
def tile(pid, ROWS: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Block indices ``[ROWS]`` of program ``pid`` and the ``[ROWS, K, BK]`` element
    offsets of its tile in block space, in int64: a bucket of 2**31 elements or more
    (one stage as one bucket with --no-overlap-grad-reduce) would overflow int32."""
    blocks = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    plane = tl.arange(0, K).to(tl.int64)
    col = tl.arange(0, BK).to(tl.int64)
    offs = blocks[:, None, None] * (K * BK) + plane[None, :, None] * BK + col[None, None, :]
    return blocks, offs


@triton.jit
def rotate(x2, d, rot_scale, ROWS: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr, INVERSE: tl.constexpr,
           NO_FMA: tl.constexpr):
    """rotation.rotate (``H (d * x) * fp32(B**-0.5)``) or, ``INVERSE``, rotation.unrotate
    (``H y * fp32(B**-0.5) * d``) of fp32 ``[ROWS, B]`` blocks; ``d``: fp32 ``[B]`` signs."""
    if not INVERSE:
        x2 = x2 * d[None, :]  # exact (+-1)
    x2 = mul(wht(x2, ROWS, B, LOG_B), rot_scale, NO_FMA)
    if INVERSE:
        x2 = x2 * d[None, :]
    return x2


@triton.jit
def bf16_bits(x):
    """fp32 -> bf16 bits (uint16) rounded to nearest even on the bits, as torch's casts
    round (the interpreter's own cast truncates); NaN becomes the quiet NaN 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def param_load(raw, DTYPE: tl.constexpr):
    """Parameters as loaded (``DTYPE`` 0: fp32, 1: bf16 as its uint16 bits, 2: fp16) ->
    ``(fp32 values, whether each is -0.0)``, both exact (on the bits)."""
    if DTYPE == 1:
        x = (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        neg_zero = raw == 0x8000
    elif DTYPE == 2:
        x = raw.to(tl.float32)
        neg_zero = raw.to(tl.uint16, bitcast=True) == 0x8000
    else:
        x = raw
        neg_zero = raw.to(tl.uint32, bitcast=True) == 0x80000000
    return x, neg_zero


@triton.jit
def param_cast(x, DTYPE: tl.constexpr):
    """fp32 -> the parameter dtype as stored (see :func:`param_load`), one rounding to
    nearest even (fp16: the cast's default rounding, nearest even on a GPU and in numpy)."""
    if DTYPE == 1:
        return bf16_bits(x)
    elif DTYPE == 2:
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def dequant(ptr, byte_offs, mask, s, BITS: tl.constexpr, K: tl.constexpr, NO_FMA: tl.constexpr):
    """``float(q) * s`` (fp32 ``[ROWS, K, BK]``) of the packed codes at ``ptr + byte_offs``
    (``[ROWS, BK]`` bytes, planar: byte j holds plane i's code j in bits [i*BITS, ...),
    offset binary; masked bytes read 0) and the scales ``s`` ``[ROWS]``. The product
    feeds an add in every caller: an explicit ``mul.rn`` (:func:`mul`)."""
    packed = tl.load(ptr + byte_offs, mask=mask, other=0).to(tl.int32)
    shift = (tl.arange(0, K) * BITS)[None, :, None]
    q = ((packed[:, None, :] >> shift) & ((1 << BITS) - 1)) - (1 << (BITS - 1))
    return mul(q.to(tl.float32), s[:, None, None], NO_FMA)
