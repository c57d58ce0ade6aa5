// Fused decode-and-apply of the compressed parameter all-gather (--param-gather-bits,
// loco_megatron/loco/param_gather.py): the hot loop, included by isa_copy.h once per
// instruction-set copy (param_apply.cpp has the argument checks and the dispatch). It
// uses decompress.h's decode_block and quant_options.h's unrotate, and like them is
// compiled with -ffp-contract=off.
//
// One gathered row (packed codes of whole blocks; one fp32 scale per block, zeroed when
// the row is not finite: param_delta.row_scales) updates blocks [b0, b1) of its shard:
//
//     dst = cast(float(src) + D(codes, s))
//
// D as param_delta.decode_chunk computes it: float(q) * s (one rounding; q * 0 is a
// signed zero), then, with the Hadamard rotation, the unrotate of quant_options.h (the
// reference's butterfly order). The sum float(src) + D is one fp32 rounding, the cast one
// rounding to the parameter dtype (nearest even): exactly what torch's add_ of an fp32
// delta into an fp32/bf16/fp16 tensor computes (in fp32, rounded once) and what
// param_delta.add_delta computes. The delta lives in one block on the stack: no fp32
// temporary of the chunk, no copy of the row.
//
// Two modes:
//  * in place (the other ranks' shards: newv null, dst == src). A block whose scale is
//    zero (the shard did not move there, or its row is not finite) has a delta of signed
//    zeros, and x + (+-0) == x bit for bit for every x except x = -0.0 (-0.0 + +0.0 is
//    +0.0). Such a block is skipped - no decode, no write - unless its source holds a
//    -0.0; only then is it computed, so the result stays bit-identical to the reference
//    for the price of one read of the block's source (which the -0.0 makes necessary: the
//    reference's result depends on it). NaN sources, whose payload a cast may change, do
//    not arise: the agreed parameters start finite, an applied delta is finite (a
//    non-finite row is zeroed) and an overflowing sum is an infinity, which +-0 keeps.
//  * own shard (newv set): dst gets the result, dst2 (if set) the block's new values
//    (swap: an fp32 model keeps the exact main shard there) or the result; a block's new
//    values are copied before any of it is written, so newv may be dst and dst2 may be
//    src (AgreedShard.finish_slice's moves, fused). It also sums the metric norms
//    ||float(result) - float(newv)||^2 and ||float(newv)||^2: in fp32 per block, in
//    float64 per chunk of kChunkBlocks blocks and then in chunk order, so they do not
//    depend on the thread count (they are metrics: another order than torch's norm).
#pragma once

#include "decompress.h"
#include "kernels.h"

namespace loco_cpu {

// A parameter dtype as its raw bits: fp32 <-> bits exactly; bf16 is fp32's top half, cast
// to nearest even on the bits (c10::BFloat16's rule, NaN -> 0x7FC0), as a plain integer
// expression so the loops vectorise; fp16 through c10::Half's own (exact) conversions.
template <typename T>
struct ParamBits;

template <>
struct ParamBits<float> {
  using raw = uint32_t;
  static constexpr raw kNegZero = 0x80000000u;
  static LOCO_INLINE float load(raw u) { return __builtin_bit_cast(float, u); }
  static LOCO_INLINE raw store(float x) { return __builtin_bit_cast(raw, x); }
};

template <>
struct ParamBits<c10::BFloat16> {
  using raw = uint16_t;
  static constexpr raw kNegZero = 0x8000u;
  static LOCO_INLINE float load(raw u) { return bf16_to_float(u); }
  static LOCO_INLINE raw store(float x) {
    const uint32_t u = __builtin_bit_cast(uint32_t, x);
    return static_cast<raw>(x != x ? 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};

template <>
struct ParamBits<c10::Half> {
  using raw = uint16_t;
  static constexpr raw kNegZero = 0x8000u;
  static LOCO_INLINE float load(raw u) { return static_cast<float>(c10::Half(u, c10::Half::from_bits())); }
  static LOCO_INLINE raw store(float x) { return c10::Half(x).x; }
};

template <typename raw>
LOCO_INLINE bool has_neg_zero(const raw* x, int n, raw neg_zero) {
  int any = 0;
#pragma omp simd reduction(| : any)
  for (int i = 0; i < n; ++i) any |= x[i] == neg_zero;
  return any != 0;
}

template <typename T, int BITS, bool OWN>
LOCO_INLINE void apply_range(const ApplyArgs& a, int64_t b0, int64_t b1, double* part) {
  using P = ParamBits<T>;
  using raw = typename P::raw;
  alignas(64) float acc[kMaxBlock];
  alignas(64) raw kept[kMaxBlock];  // own shard: the block's new values, read before dst is written
  const int B = static_cast<int>(a.B);
  const int64_t block_bytes = a.B * BITS / 8;
  double d2 = 0.0, n2 = 0.0;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t first = b * a.B;
    const int n = static_cast<int>(std::min<int64_t>(a.B, a.numel - first));
    const raw* src = static_cast<const raw*>(a.src) + first;
    raw* dst = static_cast<raw*>(a.dst) + first;
    const float s = a.scales[b];
    if (!OWN && s == 0.0f && !has_neg_zero<raw>(src, n, P::kNegZero)) {  // x + (+-0) == x
      if (dst != src) std::memcpy(dst, src, n * sizeof(raw));  // out of place (tests): the values still move
      continue;
    }
    decode_block<BITS>(a.codes + b * block_bytes, s, acc, B);
    // The rotation is unrotated over the whole block (zero padding included), as the
    // reference decodes whole blocks before it cuts the chunk to its elements.
    if (a.signs != nullptr) loco_opts::unrotate(acc, a.signs, a.rot_scale, B);
    if constexpr (OWN) {
      std::memcpy(kept, static_cast<const raw*>(a.newv) + first, n * sizeof(raw));
      float ds = 0.0f, ns = 0.0f;
#pragma omp simd reduction(+ : ds, ns)
      for (int i = 0; i < n; ++i) {
        const raw r = P::store(P::load(src[i]) + acc[i]);
        dst[i] = r;
        const float diff = P::load(r) - P::load(kept[i]), nv = P::load(kept[i]);
        ds += diff * diff;
        ns += nv * nv;
      }
      d2 += ds;
      n2 += ns;
      if (a.dst2 != nullptr)  // after src's block was read (dst2 may be src)
        std::memcpy(static_cast<raw*>(a.dst2) + first, a.swap ? kept : dst, n * sizeof(raw));
    } else {
#pragma omp simd
      for (int i = 0; i < n; ++i) dst[i] = P::store(P::load(src[i]) + acc[i]);
    }
  }
  if constexpr (OWN) {
    part[0] += d2;
    part[1] += n2;
  }
}

}  // namespace loco_cpu
