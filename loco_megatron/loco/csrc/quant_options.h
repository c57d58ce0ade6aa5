// Quantiser options of the fused CPU kernels (included by loco_cpu.cpp only): the uniform
// grid, the MSE-clipped scale, the block Walsh-Hadamard rotation and stochastic rounding.
//
// Each helper is the torch reference (loco_megatron/loco/quantize.py, rotation.py)
// operation for operation, so results are bit-identical: the same fp32 operations on the
// same operands in the same order (this file is compiled with -ffp-contract=off, like the
// rest, so no multiply-add is fused unless written as std::fma).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace loco_opts {

#define LOCO_OPT_INLINE inline __attribute__((always_inline))

constexpr float kMagic = 12582912.0f;  // 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 half to even
constexpr int kNumClip = 6;
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

// Unnormalised fast Walsh-Hadamard transform of one block in place: rotation._wht's
// butterfly passes h = 1, 2, 4, ... in that order (each output is the same expression).
LOCO_OPT_INLINE void fwht(float* x, int B) {
  // h = 1, 2, 4 within each group of 8, unrolled (the reference's first three passes;
  // blocks are a multiple of 8 elements).
  for (int j = 0; j < B; j += 8) {
    float* v = x + j;
    const float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    const float a4 = v[4] + v[5], a5 = v[4] - v[5], a6 = v[6] + v[7], a7 = v[6] - v[7];
    const float b0 = a0 + a2, b1 = a1 + a3, b2 = a0 - a2, b3 = a1 - a3;
    const float b4 = a4 + a6, b5 = a5 + a7, b6 = a4 - a6, b7 = a5 - a7;
    v[0] = b0 + b4; v[1] = b1 + b5; v[2] = b2 + b6; v[3] = b3 + b7;
    v[4] = b0 - b4; v[5] = b1 - b5; v[6] = b2 - b6; v[7] = b3 - b7;
  }
  for (int h = 8; h < B; h *= 2)
    for (int j = 0; j < B; j += 2 * h) {
      float* lo = x + j;
      float* hi = x + j + h;
#pragma omp simd
      for (int k = 0; k < h; ++k) {
        const float u = lo[k], w = hi[k];
        lo[k] = u + w;
        hi[k] = u - w;
      }
    }
}

// rotation.rotate: H (d * x) * fp32(B^-0.5).
LOCO_OPT_INLINE void rotate(float* x, const Options& o, int B) {
#pragma omp simd
  for (int i = 0; i < B; ++i) x[i] *= o.signs[i];
  fwht(x, B);
#pragma omp simd
  for (int i = 0; i < B; ++i) x[i] *= o.rot_scale;
}

// rotation.unrotate: (H y) * fp32(B^-0.5) * d.
LOCO_OPT_INLINE void unrotate(float* x, const float* signs, float rot_scale, int B) {
  fwht(x, B);
#pragma omp simd
  for (int i = 0; i < B; ++i) x[i] = (x[i] * rot_scale) * signs[i];
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
#pragma omp simd
  for (int i = 0; i < B; ++i) {
    const float y = x[i] / d + q[i];
    // floor(y) for |y| < 2**22 (y is a level plus u here): round half to even, then one
    // down where that went up; exact, and NaN stays NaN.
    float v = (y + kMagic) - kMagic;
    v = v > y ? v - 1.0f : v;
    v = v < lo ? lo : v;
    v = v > hi ? hi : v;
    q[i] = v != v ? 0.0f : v;
  }
}

// quantize.option_scales of one block: the absmax (or signed-extreme) scale `base`; for
// mse the candidate base * c, c in kClip, whose nearest levels have the least squared
// error, searched in units of the base (t = x / base, one division per element; level
// round(t * fp32(1/c)), error (t - q*c)^2 summed by tree_sum). Ties keep the larger c; a
// NaN error never wins (a non-finite or zero base keeps c = 1). t and e: B floats each.
LOCO_OPT_INLINE float option_scale(const float* x, const Options& o, int bits, float* t, float* e, int B) {
  bool nan;
  const float m = max_abs(x, B, &nan);
  float base;
  if (nan) base = std::numeric_limits<float>::quiet_NaN();
  else if (o.uniform) {
    int first = B;  // the first element of largest magnitude, with its sign
#pragma omp simd reduction(min : first)
    for (int i = 0; i < B; ++i) first = (std::fabs(x[i]) == m && i < first) ? i : first;
    base = x[first] / -static_cast<float>(1 << (bits - 1));
  } else {
    base = m / static_cast<float>((1 << (bits - 1)) - 1);
  }
  if (!o.mse) return base;
  const float lo = o.uniform ? -static_cast<float>(1 << (bits - 1)) : -static_cast<float>((1 << (bits - 1)) - 1);
  const float hi = static_cast<float>((1 << (bits - 1)) - 1);
  const float d = divisor(base);
#pragma omp simd
  for (int i = 0; i < B; ++i) t[i] = x[i] / d;
  int best = 0;
  float best_e = 0.0f;
  const int H = B / 2;  // B is even (a multiple of 8): the tree's first halving is fused below
  for (int c = 0; c < kNumClip; ++c) {
    const float cc = kClip[c], inv = kInvClip[c];
#pragma omp simd
    for (int i = 0; i < H; ++i) {
      float v = (t[i] * inv + kMagic) - kMagic, w = (t[i + H] * inv + kMagic) - kMagic;
      v = v < lo ? lo : v;
      v = v > hi ? hi : v;
      w = w < lo ? lo : w;
      w = w > hi ? hi : w;
      const float r = t[i] - v * cc, u = t[i + H] - w * cc;  // two roundings (mul, then sub)
      e[i] = r * r + u * u;  // tree_sum's first step over the B squares
    }
    const float err = tree_sum(e, H);
    if (c == 0 || err < best_e) {
      best = c;
      best_e = err;
    }
  }
  return base * kClip[best];
}

}  // namespace loco_opts
