// One instruction-set copy of every hot loop: the entry points kernels.h declares, for
// the copy the including unit names with LOCO_ISA_ATTR (its attributes: LOCO_BASE,
// LOCO_AVX2 or LOCO_AVX512) and LOCO_ISA_SUFFIX (base, avx2 or avx512), and their explicit
// instantiations for every type, width and flag the dispatch (loco_cpu.cpp,
// param_apply.cpp) calls. Each isa_*.cpp includes this once: three units that ninja
// compiles in parallel.
#pragma once

#include "compress.h"
#include "decompress.h"
#include "kernels.h"
#include "param_apply.h"

#if !defined(LOCO_ISA_ATTR) || !defined(LOCO_ISA_SUFFIX)
#error "define LOCO_ISA_ATTR and LOCO_ISA_SUFFIX before including isa_copy.h"
#endif

#define LOCO_PASTE2(a, b) a##b
#define LOCO_PASTE(a, b) LOCO_PASTE2(a, b)
#define LOCO_RUN_CHUNK LOCO_PASTE(run_chunk_, LOCO_ISA_SUFFIX)
#define LOCO_DECOMP LOCO_PASTE(decomp_, LOCO_ISA_SUFFIX)
#define LOCO_APPLY LOCO_PASTE(apply_, LOCO_ISA_SUFFIX)

namespace loco_cpu {

template <typename T, bool HAS_ERR, int BITS, bool SK>
LOCO_ISA_ATTR void LOCO_RUN_CHUNK(const CompressArgs& a, int64_t b0, int64_t b1, double* part, bool scales_only) {
  run_chunk_body<T, HAS_ERR, BITS, SK>(a, b0, b1, part, scales_only);
}

template <typename OUT, int BITS>
LOCO_ISA_ATTR void LOCO_DECOMP(const DecompArgs& a, int64_t b0, int64_t b1) {
  decomp_range<OUT, BITS>(a, b0, b1);
}

template <typename T, int BITS, bool OWN>
LOCO_ISA_ATTR void LOCO_APPLY(const ApplyArgs& a, int64_t b0, int64_t b1, double* part) {
  apply_range<T, BITS, OWN>(a, b0, b1, part);
}

// compress: {fp32, bf16} gradients x {error feedback, none} x {2, 4, 8} bits x {scales known, not}.
#define LOCO_RUN_CHUNK_1(T, E, BITS, SK) \
  template void LOCO_RUN_CHUNK<T, E, BITS, SK>(const CompressArgs&, int64_t, int64_t, double*, bool);
#define LOCO_RUN_CHUNK_SK(T, E, BITS) LOCO_RUN_CHUNK_1(T, E, BITS, true) LOCO_RUN_CHUNK_1(T, E, BITS, false)
#define LOCO_RUN_CHUNK_BITS(T, E) LOCO_RUN_CHUNK_SK(T, E, 2) LOCO_RUN_CHUNK_SK(T, E, 4) LOCO_RUN_CHUNK_SK(T, E, 8)
LOCO_RUN_CHUNK_BITS(float, true)
LOCO_RUN_CHUNK_BITS(float, false)
LOCO_RUN_CHUNK_BITS(c10::BFloat16, true)
LOCO_RUN_CHUNK_BITS(c10::BFloat16, false)

// decompress-and-sum: {fp32, bf16, fp16} output x {2, 4, 8} bits.
#define LOCO_DECOMP_1(OUT, BITS) template void LOCO_DECOMP<OUT, BITS>(const DecompArgs&, int64_t, int64_t);
#define LOCO_DECOMP_BITS(OUT) LOCO_DECOMP_1(OUT, 2) LOCO_DECOMP_1(OUT, 4) LOCO_DECOMP_1(OUT, 8)
LOCO_DECOMP_BITS(float)
LOCO_DECOMP_BITS(c10::BFloat16)
LOCO_DECOMP_BITS(c10::Half)

// decode-and-apply: {fp32, bf16, fp16} parameters x {2, 4, 8} bits x {own shard, in place}.
#define LOCO_APPLY_1(T, BITS, OWN) \
  template void LOCO_APPLY<T, BITS, OWN>(const ApplyArgs&, int64_t, int64_t, double*);
#define LOCO_APPLY_OWN(T, BITS) LOCO_APPLY_1(T, BITS, true) LOCO_APPLY_1(T, BITS, false)
#define LOCO_APPLY_BITS(T) LOCO_APPLY_OWN(T, 2) LOCO_APPLY_OWN(T, 4) LOCO_APPLY_OWN(T, 8)
LOCO_APPLY_BITS(float)
LOCO_APPLY_BITS(c10::BFloat16)
LOCO_APPLY_BITS(c10::Half)

}  // namespace loco_cpu
