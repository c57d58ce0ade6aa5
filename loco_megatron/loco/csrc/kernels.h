// Shared declarations of LoCo's fused CPU kernels (the extension loco_cpu_kernels). The
// extension is several translation units so that ninja compiles them in parallel (one
// unit holding every hot loop three times was one compiler process of 4-6 minutes):
//
//   loco_cpu.cpp      the Python module: compress and decompress-and-sum (argument
//                     checks, dispatch on dtype, width and instruction set, threads)
//   param_apply.cpp   the same for the parameter gather's decode-and-apply
//   isa_base.cpp, isa_avx2.cpp, isa_avx512.cpp
//                     one instruction-set copy each of every hot loop (compress.h,
//                     decompress.h, param_apply.h, instantiated by isa_copy.h)
//
// Every unit is compiled with the same flags (cpu_kernels.CFLAGS, -ffp-contract=off
// among them) and each hot loop is instantiated in exactly one unit per copy, with the
// code it had in the single unit: the copies compute the same bits as before.
//
// Offsets are int64_t everywhere.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "quant_options.h"

namespace loco_cpu {

constexpr float kMagic = 12582912.0f;  // 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 half to even
constexpr int64_t kChunkBlocks = 64;   // blocks per parallel work item (and per stats partial)
constexpr int kMaxBlock = 8192;        // per-thread block buffers live on the stack

#define LOCO_INLINE inline __attribute__((always_inline))

// The highest instruction-set copy compiled in (2 AVX-512, 1 AVX2+FMA, 0 baseline):
// cpu_kernels.py leaves out isa_avx512.cpp, and passes -DLOCO_MAX_ISA=1, on a build machine
// without AVX-512 (its slowest unit, never run there; the build folder's name differs by
// this flag, so a shared extensions folder holds one build per kind of CPU).
#ifndef LOCO_MAX_ISA
#define LOCO_MAX_ISA 2
#endif

// Function-level target attributes (no -march): the .so runs on any x86-64 CPU and the
// dispatch (loco_cpu.cpp's pick_isa) never calls a copy the CPU lacks. A declaration
// carries the same attributes as its definition: in C++, GCC would read a differing
// target attribute as another version of the function (multiversioning).
#if defined(__x86_64__)
#define LOCO_AVX2 __attribute__((target("avx2,fma"), flatten))
#define LOCO_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512"), flatten))
#else  // other architectures: three baseline copies (isa_level() is 0, only the first runs)
#define LOCO_AVX2 __attribute__((flatten))
#define LOCO_AVX512 __attribute__((flatten))
#endif
#define LOCO_BASE __attribute__((flatten))

LOCO_INLINE float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

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

struct ApplyArgs {
  const uint8_t* codes;  // the row's packed codes: block b's at b * B * bits / 8
  const float* scales;   // [blocks]; zero for a row that is not finite
  int64_t numel, B;      // shard elements (the last block may be partial), block size
  const void* src;       // [numel] the agreed values
  void* dst;             // [numel] the new agreed values (src itself in place)
  const void* newv;      // [numel] the optimizer's new values (own shard), or null: in place
  void* dst2;            // [numel] newv (swap) or the result, or null
  bool swap;
  double* partials;      // [chunks, 2] own shard's norms
  int isa;
  const float* signs;    // Hadamard signs [B]: unrotate the delta (null: no rotation)
  float rot_scale;
};

// The entry points of one instruction-set copy (defined and instantiated by isa_copy.h in
// isa_<SUFFIX>.cpp; `flatten` inlines every helper into the target-specific body):
//   run_chunk: compress blocks [b0, b1) (T: float or c10::BFloat16 gradients; SK: the
//              scales are already in a.scales); part: that chunk's 3 metric sums
//   decomp:    decompress-and-sum blocks [b0, b1) into OUT (float, BFloat16, Half)
//   apply:     decode-and-apply blocks [b0, b1) of one row (T: the parameter dtype;
//              OWN: the own shard); part: that chunk's 2 norms
#define LOCO_DECLARE_ISA(ATTR, SUFFIX)                                                                      \
  template <typename T, bool HAS_ERR, int BITS, bool SK>                                                   \
  ATTR void run_chunk_##SUFFIX(const CompressArgs& a, int64_t b0, int64_t b1, double* part, bool scales_only); \
  template <typename OUT, int BITS>                                                                        \
  ATTR void decomp_##SUFFIX(const DecompArgs& a, int64_t b0, int64_t b1);                                  \
  template <typename T, int BITS, bool OWN>                                                                \
  ATTR void apply_##SUFFIX(const ApplyArgs& a, int64_t b0, int64_t b1, double* part);
LOCO_DECLARE_ISA(LOCO_BASE, base)
LOCO_DECLARE_ISA(LOCO_AVX2, avx2)
LOCO_DECLARE_ISA(LOCO_AVX512, avx512)
#undef LOCO_DECLARE_ISA

}  // namespace loco_cpu
