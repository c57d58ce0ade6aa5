// Quantiser options of the fused CPU kernels (included by loco_cpu.cpp only): the uniform
// grid, the MSE-clipped scale, the block Walsh-Hadamard rotation and stochastic rounding.
//
// Each helper is the torch reference (loco_megatron/loco/quantize.py, rotation.py)
// operation for operation, so results are bit-identical: the same fp32 operations on the
// same operands in the same order (this file is compiled with -ffp-contract=off, like the
// rest, so no multiply-add is fused unless written as std::fma).
#pragma once

// v8f values pass between always-inlined helpers only, never across an ABI boundary.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace loco_opts {

#define LOCO_OPT_INLINE inline __attribute__((always_inline))

constexpr float kMagic = 12582912.0f;  // 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 half to even
constexpr int kNumClip = 6;  // even: the search takes the candidates two at a time
// quantize.MSE_CLIP_RATIOS as fp32 (torch multiplies an fp32 tensor by fp32(c)).
constexpr float kClip[kNumClip] = {1.0f, 0.9f, 0.8f, 0.7f, 0.6f, 0.5f};
// fp32(1 / fp32(c)), correctly rounded, as torch divides two fp32 scalars.
constexpr float kInvClip[kNumClip] = {1.0f / 1.0f, 1.0f / 0.9f, 1.0f / 0.8f, 1.0f / 0.7f, 1.0f / 0.6f, 1.0f / 0.5f};

struct Options {
  bool uniform;        // all 2**bits codes, signed scale -m / 2**(bits-1)
  bool mse;            // the clip ratio of kClip with the least squared error (tree sum)
  const float* signs;  // [B] Hadamard signs (+-1), or null: no rotation
  float rot_scale;     // fp32(B ** -0.5), as torch's mul_ by a Python float
  bool stochastic;     // floor(x / d + u), u hashed from (key, element index)
  uint32_t key;        // quantize.noise_key(seed, stream, step)
};

// Eight floats as one GCC vector: each instruction-set copy lowers it to its own registers
// (two SSE halves, one AVX register). Blocks are a multiple of 8 elements.
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

LOCO_OPT_INLINE v8f ld8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

LOCO_OPT_INLINE void st8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

// One butterfly pass of stride h < 8 within each group of 8: the partner p of every lane,
// then p + v (the low lane: u + w) or p + (-v) (the high lane: u - w), the same roundings
// as the reference's a + b and a - b (v * -1 is exact; x + (-y) is x - y in IEEE).
LOCO_OPT_INLINE v8f butterfly8(v8f v, v8i partner, v8f sign) { return __builtin_shuffle(v, partner) + v * sign; }

// Unnormalised fast Walsh-Hadamard transform of one block: rotation._wht's butterfly
// passes h = 1, 2, 4, ... in that order (each output is the same expression). The first
// sweep takes its input from load(j) (8 values at j, any multiply before the transform
// already applied) and the last sweep hands its output to store(k, v) (8 values at k,
// before any multiply after it), so that a caller can fuse its own load, scaling and
// next step into them; the sweeps between work in place in x. Passes 1, 2, 4 run in
// registers per group of 8; the rest two at a time (h and 2h over 4 vectors), so the
// block is swept about log4(B) times.
template <typename Load, typename Store>
LOCO_OPT_INLINE void fwht_io(float* x, int B, Load load, Store store) {
  const v8i p1 = {1, 0, 3, 2, 5, 4, 7, 6}, p2 = {2, 3, 0, 1, 6, 7, 4, 5}, p4 = {4, 5, 6, 7, 0, 1, 2, 3};
  const v8f s1 = {1, -1, 1, -1, 1, -1, 1, -1}, s2 = {1, 1, -1, -1, 1, 1, -1, -1}, s4 = {1, 1, 1, 1, -1, -1, -1, -1};
  for (int j = 0; j < B; j += 8) {
    const v8f v = butterfly8(butterfly8(butterfly8(load(j), p1, s1), p2, s2), p4, s4);
    if (B == 8) store(j, v);
    else st8(x + j, v);
  }
  int h = 8;
  for (; 4 * h <= B; h *= 4) {
    const bool last = 4 * h == B;
    for (int j = 0; j < B; j += 4 * h)
      for (int k = j; k < j + h; k += 8) {
        const v8f a = ld8(x + k), b = ld8(x + k + h), c = ld8(x + k + 2 * h), d = ld8(x + k + 3 * h);
        const v8f ab = a + b, amb = a - b, cd = c + d, cmd = c - d;  // pass h
        const v8f r0 = ab + cd, r1 = amb + cmd, r2 = ab - cd, r3 = amb - cmd;  // pass 2h
        if (last) store(k, r0), store(k + h, r1), store(k + 2 * h, r2), store(k + 3 * h, r3);
        else st8(x + k, r0), st8(x + k + h, r1), st8(x + k + 2 * h, r2), st8(x + k + 3 * h, r3);
      }
  }
  if (2 * h == B)  // one pass left, the last
    for (int k = 0; k < h; k += 8) {
      const v8f u = ld8(x + k), w = ld8(x + k + h);
      store(k, u + w);
      store(k + h, u - w);
    }
}

// rotation.rotate in place: H (d * x) * fp32(B^-0.5).
LOCO_OPT_INLINE void rotate(float* x, const Options& o, int B) {
  const float* d = o.signs;
  const float scale = o.rot_scale;
  fwht_io(x, B, [x, d](int j) { return ld8(x + j) * ld8(d + j); },
          [x, scale](int k, v8f v) { st8(x + k, v * scale); });
}

// rotation.unrotate in place: (H y) * fp32(B^-0.5) * d.
LOCO_OPT_INLINE void unrotate(float* x, const float* signs, float rot_scale, int B) {
  fwht_io(x, B, [x](int j) { return ld8(x + j); },
          [x, signs, rot_scale](int k, v8f v) { st8(x + k, (v * rot_scale) * ld8(signs + k)); });
}

// Eight fp32 or bf16 values as floats (bf16: its bits are the float's upper half; exact).
template <typename T>
LOCO_OPT_INLINE v8f ld8_any(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return ld8(reinterpret_cast<const float*>(p));
  } else {
    typedef uint16_t v8s __attribute__((vector_size(16)));
    v8s u;
    std::memcpy(&u, p, sizeof u);
    return reinterpret_cast<v8f>(__builtin_convertvector(u, v8i) << 16);
  }
}

// x = R(g) of a whole block read straight from the gradient src ([B] fp32 or bf16, every
// element in range): load_g and rotate in the transform's sweeps (one pass fewer).
template <typename T>
LOCO_OPT_INLINE void rotate_load(const T* src, const Options& o, float* x, int B) {
  const float* d = o.signs;
  const float scale = o.rot_scale;
  fwht_io(x, B, [src, d](int j) { return ld8_any(src + j) * ld8(d + j); },
          [x, scale](int k, v8f v) { st8(x + k, v * scale); });
}

// quantize.tree_sum_: halve the length L by adding x[m + i] into x[i] (m = ceil(L/2))
// until one element is left; a fixed order that torch and this code both follow.
LOCO_OPT_INLINE float tree_sum(float* x, int L) {
  while (L > 1) {
    const int m = (L + 1) / 2;
#pragma omp simd
    for (int i = 0; i < L - m; ++i) x[i] += x[m + i];
    L = m;
  }
  return x[0];
}

// tree_sum of two arrays at once, for a power-of-two L >= 8: the halvings above 8
// elements as whole vectors, the last three within one vector (the same additions in the
// same order; the two independent chains overlap).
LOCO_OPT_INLINE void tree_sum2(float* x, float* y, int L, float* sx, float* sy) {
  while (L > 8) {
    L /= 2;
    for (int i = 0; i < L; i += 8) {
      st8(x + i, ld8(x + i) + ld8(x + L + i));
      st8(y + i, ld8(y + i) + ld8(y + L + i));
    }
  }
  v8f u = ld8(x), v = ld8(y);
  const v8i h4 = {4, 5, 6, 7, 4, 5, 6, 7}, h2 = {2, 3, 2, 3, 2, 3, 2, 3}, h1 = {1, 1, 1, 1, 1, 1, 1, 1};
  u = u + __builtin_shuffle(u, h4), v = v + __builtin_shuffle(v, h4);
  u = u + __builtin_shuffle(u, h2), v = v + __builtin_shuffle(v, h2);
  u = u + __builtin_shuffle(u, h1), v = v + __builtin_shuffle(v, h1);
  *sx = u[0];
  *sy = v[0];
}

// tree_sum of one array for a power-of-two L >= 8, the same additions as tree_sum2's.
LOCO_OPT_INLINE float tree_sum1(float* x, int L) {
  while (L > 8) {
    L /= 2;
    for (int i = 0; i < L; i += 8) st8(x + i, ld8(x + i) + ld8(x + L + i));
  }
  v8f u = ld8(x);
  const v8i h4 = {4, 5, 6, 7, 4, 5, 6, 7}, h2 = {2, 3, 2, 3, 2, 3, 2, 3}, h1 = {1, 1, 1, 1, 1, 1, 1, 1};
  u = u + __builtin_shuffle(u, h4);
  u = u + __builtin_shuffle(u, h2);
  u = u + __builtin_shuffle(u, h1);
  return u[0];
}

// max |x| of a block; *nan: whether it holds a NaN (torch.amax propagates it).
LOCO_OPT_INLINE float max_abs(const float* x, int B, bool* nan) {
  float m = 0.0f;
  int any_nan = 0;
#pragma omp simd reduction(max : m) reduction(| : any_nan)
  for (int i = 0; i < B; ++i) {
    const float v = std::fabs(x[i]);
    m = v > m ? v : m;
    any_nan |= (v != v);
  }
  *nan = any_nan != 0;
  return m;
}

// max |x| of a block (*nan: whether it holds a NaN) and *first, the first element of that
// magnitude with its sign (quantize._signed_extreme; a zero block gives x[0], signed), in
// one sweep: per lane the largest magnitude seen, its first value and position (-1 starts
// below every magnitude, so each lane takes its first element), then, among the lanes
// holding the block's max, the lowest position.
LOCO_OPT_INLINE float max_abs_first(const float* x, int B, bool* nan, float* first) {
  const v8i abs_mask = {0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF,
                        0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF};
  v8f mv = {-1, -1, -1, -1, -1, -1, -1, -1}, fv = {};
  v8i jv = {}, nv = {};
  for (int j = 0; j < B; j += 8) {
    const v8f v = ld8(x + j);
    const v8f a = reinterpret_cast<v8f>(reinterpret_cast<v8i>(v) & abs_mask);
    const v8i gt = a > mv;
    mv = gt ? a : mv;
    fv = gt ? v : fv;
    jv = gt ? j : jv;
    nv |= v != v;
  }
  float m = mv[0];
  int any_nan = nv[0];
  for (int l = 1; l < 8; ++l) {
    m = mv[l] > m ? mv[l] : m;
    any_nan |= nv[l];
  }
  int pos = B;
  for (int l = 0; l < 8; ++l)
    if (mv[l] == m && jv[l] + l < pos) {
      pos = jv[l] + l;
      *first = fv[l];
    }
  *nan = any_nan != 0;
  return m;
}

// quantize.divisor: s, or +inf where s == 0 (NaN stays NaN: its codes become 0).
LOCO_OPT_INLINE float divisor(float s) { return s != 0.0f ? s : std::numeric_limits<float>::infinity(); }

// Nearest levels clamp(round(x / d), lo, hi), NaN -> 0 (quantize.levels_).
LOCO_OPT_INLINE void nearest_levels(const float* x, float s, float lo, float hi, float* q, int B) {
  const float d = divisor(s);
#pragma omp simd
  for (int i = 0; i < B; ++i) {
    float v = (x[i] / d + kMagic) - kMagic;
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    q[i] = v != v ? 0.0f : v;
  }
}

LOCO_OPT_INLINE uint32_t mix32(uint32_t x) {
  x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  return (x >> 16) ^ x;
}

// Stochastic levels clamp(floor(x / d + u)), u = quantize.uniform_noise at element index
// first + i of the buffer's block space. The hash goes into q first (an integer loop that
// vectorises), then the float loop reads it back.
LOCO_OPT_INLINE void stochastic_levels(const float* x, float s, float lo, float hi, uint32_t key, int64_t first,
                                       float* q, int B) {
  const float d = divisor(s);
  const uint64_t f = static_cast<uint64_t>(first);
#pragma omp simd
  for (int i = 0; i < B; ++i) {
    const uint64_t idx = f + static_cast<uint64_t>(i);
    const uint32_t h = mix32(mix32(static_cast<uint32_t>(idx) ^ key) + static_cast<uint32_t>(idx >> 32));
    q[i] = static_cast<float>(static_cast<int32_t>(h >> 8)) * 5.9604644775390625e-08f;  // 2**-24, exact
  }
  // In GCC vectors (B is a multiple of 8): as a plain loop GCC left it scalar on AVX2 (a
  // select after an FP compare is "control flow" to it without AVX-512's masks; 5x slower).
  const v8f one = {1, 1, 1, 1, 1, 1, 1, 1}, zero = {};
  for (int i = 0; i < B; i += 8) {
    const v8f y = ld8(x + i) / d + ld8(q + i);
    // floor(y) for |y| < 2**22 (y is a level plus u here): round half to even, then one
    // down where that went up (v - 0 is v, -0.0 included); exact, and NaN stays NaN.
    v8f v = (y + kMagic) - kMagic;
    v = v - (v > y ? one : zero);
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    st8(q + i, v != v ? zero : v);
  }
}

constexpr int32_t kMagicBits = 0x4B400000;  // the bits of kMagic: those of kMagic + k are kMagicBits + k

// clamp(round-half-even(y), lo, hi) as a float, lo/hi given as kMagicBits + level: y + M
// holds the rounded level in its low bits (|y| < 2**22), so the clamp is two integer
// max/min instructions; beyond 2**22 the bits still order like y and clamp to the same
// end. A NaN y gives lo or hi: callers that keep NaN (as 0) test y themselves.
LOCO_OPT_INLINE float round_clamp(float y, int32_t lo_bits, int32_t hi_bits) {
  int32_t u = __builtin_bit_cast(int32_t, y + kMagic);
  u = u > lo_bits ? u : lo_bits;
  u = u < hi_bits ? u : hi_bits;
  return __builtin_bit_cast(float, u) - kMagic;
}

// The first three tree halvings of candidates c and c + 1's squared errors (t - q*c)^2,
// q the clamped nearest level of t * fp32(1/c), into e0 and e1 ([B/8] each; t: [B], B a
// multiple of 8, so each halving splits an even length: element i of the third level is
// ((sq[i] + sq[i+4E]) + (sq[i+2E] + sq[i+6E])) + ((sq[i+E] + sq[i+5E]) + (sq[i+3E] + sq[i+7E])),
// E = B/8, exactly what tree_sum adds). 2-bit levels are 0, +-1 or +-2, so q*c is exact
// and t - q*c has one rounding whether the product is rounded first (the reference) or
// fused (std::fma, one instruction).
template <int BITS, int NC>
LOCO_OPT_INLINE void candidate_errors(const float* t, int B, float lo, float hi, int c, float* e0, float* e1) {
  static_assert(NC == 1 || NC == 2, "one or two candidates per sweep");
  const float c0 = kClip[c], i0 = kInvClip[c], c1 = kClip[c + NC - 1], i1 = kInvClip[c + NC - 1];
  const int E = B / 8;
  const int32_t lo_bits = kMagicBits + static_cast<int32_t>(lo), hi_bits = kMagicBits + static_cast<int32_t>(hi);
  auto sq = [lo_bits, hi_bits](float x, float cc, float inv) {
    const float v = round_clamp(x * inv, lo_bits, hi_bits);  // a NaN t has a NaN error with any level
    const float r = BITS == 2 ? std::fma(v, -cc, x) : x - v * cc;  // else two roundings (mul, then sub)
    return r * r;
  };
#pragma omp simd
  for (int i = 0; i < E; ++i) {
    const float x0 = t[i], x1 = t[i + E], x2 = t[i + 2 * E], x3 = t[i + 3 * E];
    const float x4 = t[i + 4 * E], x5 = t[i + 5 * E], x6 = t[i + 6 * E], x7 = t[i + 7 * E];
    e0[i] = ((sq(x0, c0, i0) + sq(x4, c0, i0)) + (sq(x2, c0, i0) + sq(x6, c0, i0))) +
            ((sq(x1, c0, i0) + sq(x5, c0, i0)) + (sq(x3, c0, i0) + sq(x7, c0, i0)));
    if constexpr (NC == 2)
      e1[i] = ((sq(x0, c1, i1) + sq(x4, c1, i1)) + (sq(x2, c1, i1) + sq(x6, c1, i1))) +
              ((sq(x1, c1, i1) + sq(x5, c1, i1)) + (sq(x3, c1, i1) + sq(x7, c1, i1)));
  }
}

// Candidate c's error: its first three tree halvings (candidate_errors), then the rest of
// quantize.tree_sum_ over the B/8 partial sums in e ([B/8], overwritten).
template <int BITS>
LOCO_OPT_INLINE float candidate_error(const float* t, int B, float lo, float hi, int c, float* e) {
  candidate_errors<BITS, 1>(t, B, lo, hi, c, e, nullptr);
  const int H = B / 8;
  return H >= 8 && (H & (H - 1)) == 0 ? tree_sum1(e, H) : tree_sum(e, H);
}

// quantize.option_scales of one block: the absmax (or signed-extreme) scale `base`; for
// mse the candidate base * c, c in kClip, whose nearest levels have the least squared
// error, searched in units of the base (t = x / base, one division per element; level
// round(t * fp32(1/c)), error (t - q*c)^2 summed by tree_sum), chosen by the descent of
// quantize.mse_choice. t and e: B floats each.
template <int BITS>
LOCO_OPT_INLINE float option_scale(const float* x, const Options& o, float* t, float* e, int B) {
  constexpr int bits = BITS;
  bool nan;
  float extreme = 0.0f;
  const float m = o.uniform ? max_abs_first(x, B, &nan, &extreme) : max_abs(x, B, &nan);
  float base;
  if (nan) base = std::numeric_limits<float>::quiet_NaN();
  else if (o.uniform) base = extreme / -static_cast<float>(1 << (bits - 1));
  else base = m / static_cast<float>((1 << (bits - 1)) - 1);
  if (!o.mse) return base;
  const float lo = o.uniform ? -static_cast<float>(1 << (bits - 1)) : -static_cast<float>((1 << (bits - 1)) - 1);
  const float hi = static_cast<float>((1 << (bits - 1)) - 1);
  const float d = divisor(base);
#pragma omp simd
  for (int i = 0; i < B; ++i) t[i] = x[i] / d;
  const int H = B / 8;  // the tree's first three halvings are fused into the sweep
  // Two candidates per sweep over t (t is read once for both): first 0.8 and 0.7, then
  // the pair on the winning side (quantize.mse_choice: a descent, four of the six).
  float* e2 = e + H;
  const bool pow2 = H >= 8 && (H & (H - 1)) == 0;
  // err8/err7, then on the winning side one ratio at a time, and the last only when the
  // rule reads it: going up, 1.0 is compared only when 0.9 is at least as good as 0.8;
  // going down, 0.5 only when 0.6 is strictly better than 0.7 (the same choice as reading
  // all four; one candidate fewer when the descent stops after one step, the usual case).
  float err8, err7;
  candidate_errors<BITS, 2>(t, B, lo, hi, 2, e, e2);
  if (pow2) tree_sum2(e, e2, H, &err8, &err7);
  else err8 = tree_sum(e, H), err7 = tree_sum(e2, H);
  int best;
  if (err8 <= err7) {  // towards larger ratios: ties move (keep the larger)
    const float err9 = candidate_error<BITS>(t, B, lo, hi, 1, e);
    best = err9 <= err8 ? (candidate_error<BITS>(t, B, lo, hi, 0, e) <= err9 ? 0 : 1) : 2;
  } else {  // only strictly better; NaN stops at 0.7
    const float err6 = candidate_error<BITS>(t, B, lo, hi, 4, e);
    best = err6 < err7 ? (candidate_error<BITS>(t, B, lo, hi, 5, e) < err6 ? 5 : 4) : 3;
  }
  return base * kClip[best];
}

}  // namespace loco_opts
