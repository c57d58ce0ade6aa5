// The compress kernels' hot loops (included by isa_copy.h, once per instruction-set copy):
// compensate, block absmax, quantise, pack, residual, error update, int8
// re-quantisation, for the original scheme and for every quantiser option (uniform grid,
// mse scale, Hadamard rotation, stochastic rounding: quant_options.h and the
// compress_range_opts path below).
//
// Semantics are those of the torch reference (loco_megatron/loco/quantize.py,
// compressor.py, collectives.py), operation for operation, so codes and scales are
// bit-identical: fp32 throughout, scale = amax / qmax (a division), code =
// round-half-even(h / s) (a division, not a reciprocal multiply), s == 0 -> divisor
// inf -> code 0, NaN -> code 0, clamp to [-qmax, qmax]; residual h - q*s with one
// rounding (std::fma, as torch.addcmul's kernel), and e' = (h-g)*beta + resid*(1-beta)
// with the last multiply-add fused as torch's add_(alpha=) does. Built with
// -ffp-contract=off so that the compiler never fuses a multiply and an add the
// reference rounds twice.
#pragma once

#include "kernels.h"

namespace loco_cpu {

// g of block b as fp32 into gb (zero past the row's end).
// FB: the block size as a constant (the options path's 256), or 0: a.B.
template <typename T, int FB = 0>
LOCO_INLINE void load_g(const CompressArgs& a, int64_t b, float* gb) {
  const int64_t bpr = a.P / a.B;
  const int64_t row = b / bpr, col0 = (b % bpr) * a.B;
  // A ragged last row (a bucket that does not divide by the rows) ends at a.total.
  int64_t valid = std::min<int64_t>(a.B, std::min<int64_t>(a.S - col0, a.total - row * a.S - col0));
  if (valid < 0) valid = 0;
  const T* src = static_cast<const T*>(a.g) + row * a.S + col0;
  const int B = FB ? FB : static_cast<int>(a.B);
  if constexpr (std::is_same<T, float>::value) {
#pragma omp simd
    for (int64_t i = 0; i < valid; ++i) gb[i] = src[i];
  } else {
    const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < valid; ++i) gb[i] = bf16_to_float(s16[i]);
  }
  for (int64_t i = valid; i < B; ++i) gb[i] = 0.0f;
}

// h = e*s + gb (two roundings, as torch.mul(...).add_(g)), or gb without error feedback.
template <bool HAS_ERR, int FB = 0>
LOCO_INLINE void add_err(const CompressArgs& a, int64_t b, const float* gb, float* h) {
  const int B = FB ? FB : static_cast<int>(a.B);
  if constexpr (HAS_ERR) {
    const int8_t* e = a.err + b * a.B;
    const float es = a.err_s[b];
#pragma omp simd
    for (int i = 0; i < B; ++i) h[i] = static_cast<float>(e[i]) * es + gb[i];
  } else {
#pragma omp simd
    for (int i = 0; i < B; ++i) h[i] = gb[i];
  }
}

template <typename T, bool HAS_ERR>
LOCO_INLINE void load_h(const CompressArgs& a, int64_t b, float* gb, float* h) {
  load_g<T>(a, b, gb);
  add_err<HAS_ERR>(a, b, gb, h);
}

// max|x| / qmax, NaN-propagating like torch.amax.
LOCO_INLINE float block_scale(const float* x, int B, float qmax) {
  bool nan;
  const float m = loco_opts::max_abs(x, B, &nan);
  return nan ? std::numeric_limits<float>::quiet_NaN() : m / qmax;
}

// clamp(round(x / d)) with d = s or inf (s == 0 or NaN), NaN -> 0.
LOCO_INLINE void round_codes(const float* x, float s, float qmax, float* q, int B) {
  const float d = s > 0.0f ? s : std::numeric_limits<float>::infinity();
#pragma omp simd
  for (int i = 0; i < B; ++i) {
    float v = (x[i] / d + kMagic) - kMagic;
    v = v < -qmax ? -qmax : v;
    v = v > qmax ? qmax : v;
    q[i] = v != v ? 0.0f : v;
  }
}

template <int BITS>
LOCO_INLINE void pack(const float* q, uint8_t* out, int B) {
  constexpr int K = 8 / BITS;
  constexpr int OFF = 1 << (BITS - 1);
  const int BK = B / K;
#pragma omp simd
  for (int j = 0; j < BK; ++j) {
    int byte = 0;
    for (int p = 0; p < K; ++p) byte |= (static_cast<int>(q[p * BK + j]) + OFF) << (p * BITS);
    out[j] = static_cast<uint8_t>(byte);
  }
}

// The rest of a block's step, shared by both paths: pack the levels q, the residual
// r = h - q*s and, with error feedback, e' = e*beta + r*(1 - beta) from the old error in e
// (overwritten with e'), re-quantised to int8 into err_out. Adds to the metric sums.
// One sweep computes r, e', the sums and e''s absmax (the int8 scale), a second writes
// the int8 codes: the reference's operations, per element in the same order.
template <bool HAS_ERR, int BITS, int FB = 0>
LOCO_INLINE void finish_block(const CompressArgs& a, int64_t b, const float* h, float* q, float s, float* r,
                              float* e, double& e2, double& r2, double& h2) {
  (void)r;
  const int B = FB ? FB : static_cast<int>(a.B);
  pack<BITS>(q, a.codes + b * (a.B * BITS / 8), B);
  float rs = 0.0f, hs = 0.0f;
  if constexpr (!HAS_ERR) {
#pragma omp simd reduction(+ : rs, hs)
    for (int i = 0; i < B; ++i) {
      const float ri = std::fma(-q[i], s, h[i]);  // h - q*s, one rounding (torch.addcmul)
      rs += ri * ri;
      hs += h[i] * h[i];
    }
  } else {
    // The reference's mul_(beta) and add_(resid, alpha=1 - beta), whose kernel fuses the
    // last multiply-add (one rounding); then amax(|e'|) (NaN-propagating, as torch.amax).
    float es = 0.0f, m = 0.0f;
    int any_nan = 0;
#pragma omp simd reduction(+ : rs, hs, es) reduction(max : m) reduction(| : any_nan)
    for (int i = 0; i < B; ++i) {
      const float ri = std::fma(-q[i], s, h[i]);
      rs += ri * ri;
      hs += h[i] * h[i];
      const float ne = std::fma(ri, a.omb, e[i] * a.beta);
      e[i] = ne;
      es += ne * ne;
      const float v = std::fabs(ne);
      m = v > m ? v : m;
      any_nan |= (v != v);
    }
    e2 += es;
    if (a.err_out != nullptr) {
      const float s8 = any_nan ? std::numeric_limits<float>::quiet_NaN() : m / 127.0f;
      const float d = s8 > 0.0f ? s8 : std::numeric_limits<float>::infinity();  // as round_codes
      int8_t* dst = a.err_out + b * a.B;
#pragma omp simd
      for (int i = 0; i < B; ++i) {
        float v = (e[i] / d + kMagic) - kMagic;
        v = v < -127.0f ? -127.0f : v;
        v = v > 127.0f ? 127.0f : v;
        dst[i] = static_cast<int8_t>(v != v ? 0.0f : v);
      }
      a.err_s_out[b] = s8;
    }
  }
  r2 += rs;
  h2 += hs;
}

// Pass 1 of the two-pass scheme: block scales only.
template <typename T, bool HAS_ERR, int BITS>
LOCO_INLINE void scales_range(const CompressArgs& a, int64_t b0, int64_t b1) {
  alignas(64) float gb[kMaxBlock];
  alignas(64) float h[kMaxBlock];
  const int B = static_cast<int>(a.B);
  const float qmax = static_cast<float>((1 << (BITS - 1)) - 1);
  for (int64_t b = b0; b < b1; ++b) {
    load_h<T, HAS_ERR>(a, b, gb, h);
    a.scales[b] = block_scale(h, B, qmax);
  }
}

// Codes (and, with error feedback, the new int8 error into err_out) of blocks [b0, b1).
// SCALES_KNOWN: a.scales already holds the blocks' scales (two-pass scheme).
template <typename T, bool HAS_ERR, int BITS, bool SCALES_KNOWN>
LOCO_INLINE void compress_range(const CompressArgs& a, int64_t b0, int64_t b1, double* part) {
  alignas(64) float gb[kMaxBlock];
  alignas(64) float h[kMaxBlock];
  alignas(64) float q[kMaxBlock];
  alignas(64) float r[kMaxBlock];
  const int B = static_cast<int>(a.B);
  const float qmax = static_cast<float>((1 << (BITS - 1)) - 1);
  double e2 = 0.0, r2 = 0.0, h2 = 0.0;
  for (int64_t b = b0; b < b1; ++b) {
    load_h<T, HAS_ERR>(a, b, gb, h);
    const float s = SCALES_KNOWN ? a.scales[b] : block_scale(h, B, qmax);
    if (!SCALES_KNOWN) a.scales[b] = s;
    round_codes(h, s, qmax, q, B);
    if constexpr (HAS_ERR) {
#pragma omp simd
      for (int i = 0; i < B; ++i) gb[i] = h[i] - gb[i];  // the old error e = h - g
    }
    finish_block<HAS_ERR, BITS>(a, b, h, q, s, r, gb, e2, r2, h2);
  }
  part[0] += e2;
  part[1] += r2;
  part[2] += h2;
}

// ------------------------------------------------ quantiser options (quant_options.h)
// h of block b in the options' domain: gb = R(g) with the rotation (the reference rotates
// the zero-padded g, then adds the stored, rotated error), h = e*s + gb. With the rotation
// and error feedback the same sweep then overwrites gb with the block's old error as the
// reference re-reads it (e*s + 0: the product, -0.0 made +0.0; h - R(g) would round
// differently) and returns true; otherwise gb stays R(g) or g.
template <typename T, bool HAS_ERR, int FB>
LOCO_INLINE bool load_h_opts(const CompressArgs& a, int64_t b, float* gb, float* h) {
  const int B = FB ? FB : static_cast<int>(a.B);
  if (a.opt.signs == nullptr) {
    load_g<T, FB>(a, b, gb);
    add_err<HAS_ERR, FB>(a, b, gb, h);
    return false;
  }
  const int64_t bpr = a.P / a.B;
  const int64_t row = b / bpr, col0 = (b % bpr) * a.B;
  if (col0 + B <= a.S && row * a.S + col0 + B <= a.total) {  // a whole block: read g in the first sweep
    loco_opts::rotate_load(static_cast<const T*>(a.g) + row * a.S + col0, a.opt, gb, B);
  } else {  // zero-padded
    load_g<T, FB>(a, b, gb);
    loco_opts::rotate(gb, a.opt, B);
  }
  if constexpr (HAS_ERR) {
    const int8_t* e = a.err + b * a.B;
    const float es = a.err_s[b];
#pragma omp simd
    for (int i = 0; i < B; ++i) {
      const float p = static_cast<float>(e[i]) * es;
      h[i] = p + gb[i];
      gb[i] = p + 0.0f;
    }
  } else {
    add_err<false, FB>(a, b, gb, h);
  }
  return HAS_ERR;
}

template <typename T, bool HAS_ERR, int BITS, int FB>
LOCO_INLINE void scales_range_opts(const CompressArgs& a, int64_t b0, int64_t b1) {
  alignas(64) float gb[kMaxBlock];
  alignas(64) float h[kMaxBlock];
  alignas(64) float t[kMaxBlock];
  const int B = FB ? FB : static_cast<int>(a.B);
  for (int64_t b = b0; b < b1; ++b) {
    load_h_opts<T, HAS_ERR, FB>(a, b, gb, h);
    a.scales[b] = loco_opts::option_scale<BITS>(h, a.opt, gb, t, B);
  }
}

// compress_range with quantiser options: the reference's LoCoCompressor.compress with
// options (quantize.option_scales / levels_), operation for operation.
template <typename T, bool HAS_ERR, int BITS, int FB>
LOCO_INLINE void compress_range_opts(const CompressArgs& a, int64_t b0, int64_t b1, double* part,
                                     bool scales_known) {
  alignas(64) float gb[kMaxBlock];
  alignas(64) float h[kMaxBlock];
  alignas(64) float q[kMaxBlock];
  alignas(64) float r[kMaxBlock];
  const int B = FB ? FB : static_cast<int>(a.B);
  const float lo = a.opt.uniform ? -static_cast<float>(1 << (BITS - 1)) : -static_cast<float>((1 << (BITS - 1)) - 1);
  const float hi = static_cast<float>((1 << (BITS - 1)) - 1);
  double e2 = 0.0, r2 = 0.0, h2 = 0.0;
  for (int64_t b = b0; b < b1; ++b) {
    const bool old_ready = load_h_opts<T, HAS_ERR, FB>(a, b, gb, h);
    float s;
    if (scales_known) s = a.scales[b];
    else {
      s = loco_opts::option_scale<BITS>(h, a.opt, q, r, B);  // q, r: scratch here
      a.scales[b] = s;
    }
    if (a.opt.stochastic) loco_opts::stochastic_levels(h, s, lo, hi, a.opt.key, b * a.B, q, B);
    else loco_opts::nearest_levels(h, s, lo, hi, q, B);
    if constexpr (HAS_ERR) {
      // The old error e: h - g without rotation, as compress_range (with it, load_h_opts
      // has put it in gb).
      if (!old_ready) {
#pragma omp simd
        for (int i = 0; i < B; ++i) gb[i] = h[i] - gb[i];
      }
    }
    finish_block<HAS_ERR, BITS, FB>(a, b, h, q, s, r, gb, e2, r2, h2);
  }
  part[0] += e2;
  part[1] += r2;
  part[2] += h2;
}

// The options path of blocks [b0, b1). A 2-bit bucket with the default 256-element
// blocks runs a copy with B a constant (the block loops and the tree sums' lengths are
// known at compile time: about 10% less time); other sizes and widths take a.B.
template <typename T, bool HAS_ERR, int BITS>
LOCO_INLINE void opts_range(const CompressArgs& a, int64_t b0, int64_t b1, double* part, bool scales_only,
                            bool scales_known) {
  if constexpr (BITS == 2) {
    if (a.B == 256) {
      if (scales_only) scales_range_opts<T, HAS_ERR, BITS, 256>(a, b0, b1);
      else compress_range_opts<T, HAS_ERR, BITS, 256>(a, b0, b1, part, scales_known);
      return;
    }
  }
  if (scales_only) scales_range_opts<T, HAS_ERR, BITS, 0>(a, b0, b1);
  else compress_range_opts<T, HAS_ERR, BITS, 0>(a, b0, b1, part, scales_known);
}

// One chunk of blocks [b0, b1): the body of every instruction-set copy of run_chunk.
template <typename T, bool HAS_ERR, int BITS, bool SK>
LOCO_INLINE void run_chunk_body(const CompressArgs& a, int64_t b0, int64_t b1, double* part, bool scales_only) {
  if (a.has_opts) opts_range<T, HAS_ERR, BITS>(a, b0, b1, part, scales_only, SK);
  else if (scales_only) scales_range<T, HAS_ERR, BITS>(a, b0, b1);
  else compress_range<T, HAS_ERR, BITS, SK>(a, b0, b1, part);
}

}  // namespace loco_cpu
