// Fused CPU kernels for LoCo: compress (compensate, block absmax, quantise, pack,
// residual, error update, int8 re-quantisation) and decompress-and-sum, for the original
// scheme and for every quantiser option (uniform grid, mse scale, Hadamard rotation and,
// on the receiving side, unrotation, stochastic rounding: quant_options.h and the
// compress_range_opts path below); and the parameter gather's decode-and-apply
// (param_apply.h).
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
//
// ISA: every hot loop is compiled three times, for baseline x86-64, AVX2+FMA and
// AVX-512 (function-level target attributes; no -march), and the best copy the CPU
// supports is chosen at run time with __builtin_cpu_supports - so the .so runs on any
// x86-64 CPU and never executes an instruction the CPU lacks.
// Threads: at::parallel_for over chunks of blocks (torch.get_num_threads()); the
// metric sums are reduced per fixed-size chunk and then in chunk order, so they do
// not depend on the thread count.
//
// Offsets are int64_t everywhere.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "quant_options.h"

namespace {

constexpr float kMagic = 12582912.0f;  // 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 half to even
constexpr int64_t kChunkBlocks = 64;   // blocks per parallel work item (and per stats partial)
constexpr int kMaxBlock = 8192;        // per-thread block buffers live on the stack

#define LOCO_INLINE inline __attribute__((always_inline))

struct CompressArgs {
  const void* g;          // [rows, S] fp32 or bf16
  int64_t rows, S, P, B;  // P = ceil(S/B)*B
  int64_t total;          // elements of g (rows * S, or fewer: the last rows are shorter)
  const int8_t* err;      // [nb, B] or null (no error feedback)
  const float* err_s;     // [nb]
  int8_t* err_out;        // where the new error goes (err itself, or scratch), null: skip
  float* err_s_out;
  uint8_t* codes;         // [nb * B * bits / 8]
  float* scales;          // [nb]
  float beta, omb;        // beta and (1 - beta), each rounded to fp32 as torch does
  double* partials;       // [num_chunks, 3]
  int isa;                // isa_level() or lower (tests run every copy)
  bool has_opts;          // quantiser options in use (compress_range_opts)
  loco_opts::Options opt;
};

LOCO_INLINE float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

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

#if defined(__x86_64__)
#define LOCO_AVX2 __attribute__((target("avx2,fma"), flatten))
#define LOCO_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512"), flatten))
// 2: AVX-512 (F/BW/VL/DQ), 1: AVX2+FMA, 0: baseline x86-64.
int isa_level() {
  static const int level = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
                               ? 2
                               : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
  return level;
}
#else  // other architectures: the baseline copy only
#define LOCO_AVX2 __attribute__((flatten))
#define LOCO_AVX512 __attribute__((flatten))
int isa_level() { return 0; }
#endif

// One instantiation per ISA: `flatten` inlines every helper into the target-specific body.
template <typename T, bool HAS_ERR, int BITS, bool SK>
LOCO_AVX512 void run_chunk_avx512(const CompressArgs& a, int64_t b0, int64_t b1, double* part, bool scales_only) {
  if (a.has_opts) opts_range<T, HAS_ERR, BITS>(a, b0, b1, part, scales_only, SK);
  else if (scales_only) scales_range<T, HAS_ERR, BITS>(a, b0, b1);
  else compress_range<T, HAS_ERR, BITS, SK>(a, b0, b1, part);
}

template <typename T, bool HAS_ERR, int BITS, bool SK>
LOCO_AVX2 void run_chunk_avx2(const CompressArgs& a, int64_t b0, int64_t b1,
                                                                 double* part, bool scales_only) {
  if (a.has_opts) opts_range<T, HAS_ERR, BITS>(a, b0, b1, part, scales_only, SK);
  else if (scales_only) scales_range<T, HAS_ERR, BITS>(a, b0, b1);
  else compress_range<T, HAS_ERR, BITS, SK>(a, b0, b1, part);
}

template <typename T, bool HAS_ERR, int BITS, bool SK>
__attribute__((flatten)) void run_chunk_base(const CompressArgs& a, int64_t b0, int64_t b1, double* part,
                                             bool scales_only) {
  if (a.has_opts) opts_range<T, HAS_ERR, BITS>(a, b0, b1, part, scales_only, SK);
  else if (scales_only) scales_range<T, HAS_ERR, BITS>(a, b0, b1);
  else compress_range<T, HAS_ERR, BITS, SK>(a, b0, b1, part);
}

template <typename T, bool HAS_ERR, int BITS, bool SK>
void run_all(const CompressArgs& a, int64_t nb, bool scales_only) {
  const int64_t chunks = (nb + kChunkBlocks - 1) / kChunkBlocks;
  const int isa = a.isa;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b0 = c * kChunkBlocks, b1 = std::min(nb, b0 + kChunkBlocks);
      double* part = a.partials + 3 * c;
      if (isa == 2) run_chunk_avx512<T, HAS_ERR, BITS, SK>(a, b0, b1, part, scales_only);
      else if (isa == 1) run_chunk_avx2<T, HAS_ERR, BITS, SK>(a, b0, b1, part, scales_only);
      else run_chunk_base<T, HAS_ERR, BITS, SK>(a, b0, b1, part, scales_only);
    }
  });
}

template <typename T, bool HAS_ERR>
void dispatch_bits(const CompressArgs& a, int64_t nb, int64_t bits, bool scales_known, bool scales_only) {
#define LOCO_CASE(BITS)                                                              \
  if (bits == BITS) {                                                                \
    if (scales_known) run_all<T, HAS_ERR, BITS, true>(a, nb, scales_only);           \
    else run_all<T, HAS_ERR, BITS, false>(a, nb, scales_only);                       \
    return;                                                                          \
  }
  LOCO_CASE(2)
  LOCO_CASE(4)
  LOCO_CASE(8)
#undef LOCO_CASE
  TORCH_CHECK(false, "bits must be 2, 4 or 8");
}

void dispatch(const CompressArgs& a, int64_t nb, int64_t bits, bool bf16, bool scales_known, bool scales_only) {
  const bool has_err = a.err != nullptr;
  if (bf16) {
    if (has_err) dispatch_bits<c10::BFloat16, true>(a, nb, bits, scales_known, scales_only);
    else dispatch_bits<c10::BFloat16, false>(a, nb, bits, scales_known, scales_only);
  } else {
    if (has_err) dispatch_bits<float, true>(a, nb, bits, scales_known, scales_only);
    else dispatch_bits<float, false>(a, nb, bits, scales_known, scales_only);
  }
}

bool all_finite(const float* s, int64_t n) {
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= !(std::fabs(s[i]) <= std::numeric_limits<float>::max());
  return !bad;
}

// The instruction-set copy to run: `requested` when the CPU has it (tests force each
// copy), else the best the CPU has.
int pick_isa(int64_t requested) {
  return requested >= 0 && requested <= isa_level() ? static_cast<int>(requested) : isa_level();
}

// Compress g ([rows, S] or [N] = one row; each row zero-padded to whole blocks).
// err/err_scales: int8 [nb, B] / fp32 [nb], updated in place when every scale of the
// buffer is finite (else left exactly as they were); undefined tensors = no error
// feedback. two_pass: scales first (whole-buffer verdict), then codes and the error in
// place; otherwise one pass into err_scratch/err_s_scratch, copied over when finite.
// Returns (codes uint8, scales fp32 [nb], stats fp32 [4] = (sum e'^2, sum resid^2,
// sum h^2, numel_stat), all zero when not finite). isa: -1 = the best copy (see pick_isa).
std::vector<at::Tensor> compress(const at::Tensor& g, const at::Tensor& err, const at::Tensor& err_scales,
                                 double beta, int64_t bits, int64_t block_size, bool two_pass,
                                 const at::Tensor& err_scratch, const at::Tensor& err_s_scratch,
                                 double numel_stat, int64_t isa, int64_t rows_arg, int64_t quantizer,
                                 bool mse, const at::Tensor& signs, double rot_scale, bool stochastic,
                                 int64_t key) {
  TORCH_CHECK(g.device().is_cpu() && g.is_contiguous(), "g must be a contiguous CPU tensor");
  TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16, "g must be fp32 or bf16");
  TORCH_CHECK(g.dim() == 1 || g.dim() == 2, "g must be 1-D or 2-D");
  TORCH_CHECK(block_size > 0 && block_size % 8 == 0 && block_size <= kMaxBlock,
              "block_size must be a multiple of 8 up to ", kMaxBlock);
  // rows_arg > 0: g is flat, split into rows_arg rows of ceil(N / rows_arg) (the last shorter).
  const int64_t rows = rows_arg > 0 ? rows_arg : (g.dim() == 2 ? g.size(0) : 1);
  const int64_t S = rows_arg > 0 ? (g.numel() + rows - 1) / rows : (g.dim() == 2 ? g.size(1) : g.numel());
  const int64_t P = (S + block_size - 1) / block_size * block_size;
  const int64_t nb = rows * P / block_size;
  auto codes = at::empty({nb * block_size * bits / 8}, g.options().dtype(at::kByte));
  auto scales = at::empty({nb}, g.options().dtype(at::kFloat));
  const bool has_err = err.defined() && err.numel() > 0;  // empty: no error feedback
  if (has_err) {
    TORCH_CHECK(err.scalar_type() == at::kChar && err.numel() == nb * block_size && err.is_contiguous(),
                "err must be contiguous int8 with ", nb * block_size, " elements");
    TORCH_CHECK(err_scales.scalar_type() == at::kFloat && err_scales.numel() == nb && err_scales.is_contiguous(),
                "err_scales must be contiguous fp32 with ", nb, " elements");
    if (!two_pass)
      TORCH_CHECK(err_scratch.numel() >= nb * block_size && err_s_scratch.numel() >= nb,
                  "one-pass compress needs int8/fp32 scratch");
  }
  const int64_t chunks = (nb + kChunkBlocks - 1) / kChunkBlocks;
  std::vector<double> partials(3 * chunks, 0.0);
  CompressArgs a{g.data_ptr(), rows, S, P, block_size, g.numel(),
                 has_err ? err.data_ptr<int8_t>() : nullptr,
                 has_err ? err_scales.data_ptr<float>() : nullptr,
                 nullptr, nullptr, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                 static_cast<float>(beta), static_cast<float>(1.0 - beta), partials.data(), pick_isa(isa),
                 false, loco_opts::Options{quantizer == 1, mse, nullptr, static_cast<float>(rot_scale), stochastic,
                                           static_cast<uint32_t>(key)}};
  if (signs.defined() && signs.numel() > 0) {
    TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.numel() == block_size && signs.is_contiguous(),
                "signs must be contiguous fp32 with ", block_size, " elements");
    TORCH_CHECK((block_size & (block_size - 1)) == 0, "the Hadamard rotation needs a power-of-two block size");
    a.opt.signs = signs.data_ptr<float>();
  }
  a.has_opts = a.opt.uniform || a.opt.mse || a.opt.signs != nullptr || a.opt.stochastic;
  const bool bf16 = g.scalar_type() == at::kBFloat16;
  bool finite;
  if (two_pass) {
    dispatch(a, nb, bits, bf16, false, /*scales_only=*/true);
    finite = all_finite(a.scales, nb);
    if (has_err && finite) {
      a.err_out = err.data_ptr<int8_t>();  // each block reads its old error before writing it
      a.err_s_out = err_scales.data_ptr<float>();
    }
    dispatch(a, nb, bits, bf16, true, false);
  } else {
    if (has_err) {
      a.err_out = err_scratch.data_ptr<int8_t>();
      a.err_s_out = err_s_scratch.data_ptr<float>();
    }
    dispatch(a, nb, bits, bf16, false, false);
    finite = all_finite(a.scales, nb);
    if (has_err && finite) {
      int8_t* dst = err.data_ptr<int8_t>();
      const int8_t* src = a.err_out;
      at::parallel_for(0, nb, 4096, [&](int64_t b0, int64_t b1) {
        std::memcpy(dst + b0 * block_size, src + b0 * block_size, (b1 - b0) * block_size);
      });
      std::memcpy(err_scales.data_ptr<float>(), a.err_s_out, nb * sizeof(float));
    }
  }
  auto stats = at::zeros({4}, g.options().dtype(at::kFloat));
  if (finite) {
    double sums[3] = {0.0, 0.0, 0.0};
    for (int64_t c = 0; c < chunks; ++c)
      for (int k = 0; k < 3; ++k) sums[k] += partials[3 * c + k];
    float* st = stats.data_ptr<float>();
    for (int k = 0; k < 3; ++k) st[k] = static_cast<float>(sums[k]);
    st[3] = static_cast<float>(numel_stat);
  }
  return {codes, scales, stats};
}

// ---------------------------------------------------------------- decompress-and-sum
struct DecompArgs {
  const uint8_t* recv;
  int64_t world, row_bytes, code_bytes, shard, B;
  float scale;
  bool apply_scale;
  void* out;
  int isa;
  const float* signs;  // Hadamard signs [B]: unrotate the sum (null: no rotation)
  float rot_scale;
};

// One block's dequantised codes float(q) * s (one rounding each) into acc, from its packed
// bytes c (planar: byte j holds the codes j, j + B/K, ... of the block).
template <int BITS>
LOCO_INLINE void decode_block(const uint8_t* c, float s, float* acc, int B) {
  constexpr int K = 8 / BITS;
  constexpr int OFF = 1 << (BITS - 1);
  constexpr int MASK = (1 << BITS) - 1;
  const int BK = B / K;
  for (int p = 0; p < K; ++p) {
    float* dst = acc + p * BK;
#pragma omp simd
    for (int j = 0; j < BK; ++j) dst[j] = static_cast<float>(((c[j] >> (p * BITS)) & MASK) - OFF) * s;
  }
}

template <typename OUT, int BITS>
LOCO_INLINE void decomp_range(const DecompArgs& a, int64_t b0, int64_t b1) {
  constexpr int K = 8 / BITS;
  constexpr int OFF = 1 << (BITS - 1);
  constexpr int MASK = (1 << BITS) - 1;
  alignas(64) float acc[kMaxBlock];
  const int B = static_cast<int>(a.B);
  const int BK = B / K;
  const int64_t block_bytes = a.B * BITS / 8;
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t r = 0; r < a.world; ++r) {
      const uint8_t* row = a.recv + r * a.row_bytes;
      float s;
      std::memcpy(&s, row + a.code_bytes + 4 * b, 4);
      const uint8_t* c = row + b * block_bytes;
      if (r == 0) {  // the reference starts from rank 0's part itself
        decode_block<BITS>(c, s, acc, B);
        continue;
      }
      for (int p = 0; p < K; ++p) {
        float* dst = acc + p * BK;
#pragma omp simd
        for (int j = 0; j < BK; ++j) dst[j] += static_cast<float>(((c[j] >> (p * BITS)) & MASK) - OFF) * s;
      }
    }
    const int64_t valid = std::min<int64_t>(a.B, a.shard - b * a.B);
    OUT* out = static_cast<OUT*>(a.out) + b * a.B;
    // The rotation is linear: the reference unrotates the sum once, before the scaling.
    if (a.signs != nullptr) loco_opts::unrotate(acc, a.signs, a.rot_scale, B);
    if (a.apply_scale) {
#pragma omp simd
      for (int i = 0; i < B; ++i) acc[i] *= a.scale;
    }
    if constexpr (std::is_same<OUT, float>::value) {
#pragma omp simd
      for (int64_t i = 0; i < valid; ++i) out[i] = acc[i];
    } else {
      for (int64_t i = 0; i < valid; ++i) out[i] = OUT(acc[i]);  // round to nearest even
    }
  }
}

template <typename OUT, int BITS>
LOCO_AVX512 void decomp_avx512(const DecompArgs& a, int64_t b0, int64_t b1) {
  decomp_range<OUT, BITS>(a, b0, b1);
}

template <typename OUT, int BITS>
LOCO_AVX2 void decomp_avx2(const DecompArgs& a, int64_t b0, int64_t b1) {
  decomp_range<OUT, BITS>(a, b0, b1);
}

template <typename OUT, int BITS>
__attribute__((flatten)) void decomp_base(const DecompArgs& a, int64_t b0, int64_t b1) {
  decomp_range<OUT, BITS>(a, b0, b1);
}

template <typename OUT, int BITS>
void decomp_all(const DecompArgs& a, int64_t nb) {
  const int isa = a.isa;
  at::parallel_for(0, nb, kChunkBlocks, [&](int64_t b0, int64_t b1) {
    if (isa == 2) decomp_avx512<OUT, BITS>(a, b0, b1);
    else if (isa == 1) decomp_avx2<OUT, BITS>(a, b0, b1);
    else decomp_base<OUT, BITS>(a, b0, b1);
  });
}

template <typename OUT>
void decomp_bits(const DecompArgs& a, int64_t nb, int64_t bits) {
  if (bits == 2) decomp_all<OUT, 2>(a, nb);
  else if (bits == 4) decomp_all<OUT, 4>(a, nb);
  else if (bits == 8) decomp_all<OUT, 8>(a, nb);
  else TORCH_CHECK(false, "bits must be 2, 4 or 8");
}

// The Hadamard signs [B] a decode unrotates with, or null (undefined or empty: no rotation).
const float* unrotate_signs(const at::Tensor& signs, int64_t block_size) {
  if (!signs.defined() || signs.numel() == 0) return nullptr;
  TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.numel() == block_size && signs.is_contiguous() &&
                  (block_size & (block_size - 1)) == 0,
              "signs must be contiguous fp32 with ", block_size, " elements (a power of two)");
  return signs.data_ptr<float>();
}

// out (shard elements, fp32/bf16/fp16) = scale * sum over r in rank order of D(recv[r]).
void decompress_sum(const at::Tensor& recv, int64_t code_bytes, int64_t shard, int64_t bits, int64_t block_size,
                    at::Tensor out, double scale, int64_t isa, const at::Tensor& signs, double rot_scale) {
  TORCH_CHECK(recv.device().is_cpu() && recv.is_contiguous() && recv.scalar_type() == at::kByte && recv.dim() == 2,
              "recv must be contiguous uint8 [W, row_bytes] on CPU");
  TORCH_CHECK(out.is_contiguous() && out.numel() == shard, "out must be contiguous with ", shard, " elements");
  TORCH_CHECK(block_size > 0 && block_size % 8 == 0 && block_size <= kMaxBlock, "unsupported block_size");
  const int64_t nb = (shard + block_size - 1) / block_size;
  DecompArgs a{recv.data_ptr<uint8_t>(), recv.size(0), recv.size(1), code_bytes, shard, block_size,
               static_cast<float>(scale), scale != 1.0, out.data_ptr(), pick_isa(isa),
               unrotate_signs(signs, block_size), static_cast<float>(rot_scale)};
  switch (out.scalar_type()) {
    case at::kFloat: decomp_bits<float>(a, nb, bits); break;
    case at::kBFloat16: decomp_bits<c10::BFloat16>(a, nb, bits); break;
    case at::kHalf: decomp_bits<c10::Half>(a, nb, bits); break;
    default: TORCH_CHECK(false, "out must be fp32, bf16 or fp16");
  }
}

// The parameter gather's fused decode-and-apply (uses the helpers above).
#include "param_apply.h"

}  // namespace

int64_t isa() { return isa_level(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("compress", &compress, "LoCo fused compress (see loco_cpu.cpp)");
  m.def("decompress_sum", &decompress_sum, "LoCo fused decompress-and-sum");
  m.def("param_apply", &param_apply, "parameter gather: decode one row and apply it (see param_apply.h)");
  m.def("isa", &isa, "the best instruction-set copy this CPU runs: 2 AVX-512, 1 AVX2+FMA, 0 baseline");
}
