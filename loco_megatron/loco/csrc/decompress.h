// The decompress-and-sum kernels' hot loops (included by isa_copy.h, once per
// instruction-set copy): out = scale * sum over ranks, in rank order, of float(q) * s,
// fp32 sums; with the Hadamard rotation the sum is unrotated before the scaling, as the
// reference (collectives.decompress_into) does. decode_block is shared with param_apply.h.
#pragma once

#include "kernels.h"

namespace loco_cpu {

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

}  // namespace loco_cpu
