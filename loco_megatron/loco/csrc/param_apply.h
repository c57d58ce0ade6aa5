// Fused decode-and-apply of the compressed parameter all-gather (--param-gather-bits,
// loco_megatron/loco/param_gather.py). Included by loco_cpu.cpp inside its anonymous
// namespace, after the decompress-and-sum kernels: it uses their ISA attributes
// (LOCO_AVX2, LOCO_AVX512), kChunkBlocks, kMaxBlock, bf16_to_float, decode_block,
// unrotate_signs, pick_isa and quant_options.h's unrotate, and like them is compiled with -ffp-contract=off.
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

template <typename T, int BITS, bool OWN>
LOCO_AVX512 void apply_avx512(const ApplyArgs& a, int64_t b0, int64_t b1, double* part) {
  apply_range<T, BITS, OWN>(a, b0, b1, part);
}

template <typename T, int BITS, bool OWN>
LOCO_AVX2 void apply_avx2(const ApplyArgs& a, int64_t b0, int64_t b1, double* part) {
  apply_range<T, BITS, OWN>(a, b0, b1, part);
}

template <typename T, int BITS, bool OWN>
__attribute__((flatten)) void apply_base(const ApplyArgs& a, int64_t b0, int64_t b1, double* part) {
  apply_range<T, BITS, OWN>(a, b0, b1, part);
}

// Blocks [b0, b1) in chunks of kChunkBlocks (one work item and one norms partial each).
template <typename T, int BITS, bool OWN>
void apply_all(const ApplyArgs& a, int64_t b0, int64_t b1) {
  const int64_t chunks = (b1 - b0 + kChunkBlocks - 1) / kChunkBlocks;
  const int isa = a.isa;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = b0 + c * kChunkBlocks, hi = std::min(b1, lo + kChunkBlocks);
      double* part = a.partials + 2 * c;
      if (isa == 2) apply_avx512<T, BITS, OWN>(a, lo, hi, part);
      else if (isa == 1) apply_avx2<T, BITS, OWN>(a, lo, hi, part);
      else apply_base<T, BITS, OWN>(a, lo, hi, part);
    }
  });
}

template <typename T, bool OWN>
void apply_bits(const ApplyArgs& a, int64_t b0, int64_t b1, int64_t bits) {
  if (bits == 2) apply_all<T, 2, OWN>(a, b0, b1);
  else if (bits == 4) apply_all<T, 4, OWN>(a, b0, b1);
  else apply_all<T, 8, OWN>(a, b0, b1);  // param_apply checked it is 8
}

template <typename T>
void apply_dtype(const ApplyArgs& a, int64_t b0, int64_t b1, int64_t bits) {
  if (a.newv != nullptr) apply_bits<T, true>(a, b0, b1, bits);
  else apply_bits<T, false>(a, b0, b1, bits);
}

// Blocks [b0, b1) of one gathered row applied to its shard (see the top of this file).
// codes: uint8, at least b1 blocks' packed codes (the row itself will do: its scale bytes
// follow and are not read); scales: fp32 [>= b1]; src, dst: contiguous [numel], fp32,
// bf16 or fp16, the same dtype; newv, dst2: the own shard's (undefined or empty: in place).
// Returns {sum (result - newv)^2, sum newv^2} of the blocks (zeros in place).
std::vector<double> param_apply(const at::Tensor& codes, const at::Tensor& scales, int64_t b0, int64_t b1,
                                int64_t bits, int64_t block_size, const at::Tensor& src, at::Tensor dst,
                                const at::Tensor& newv, const at::Tensor& dst2, bool swap, int64_t isa,
                                const at::Tensor& signs, double rot_scale) {
  TORCH_CHECK(block_size > 0 && block_size % 8 == 0 && block_size <= kMaxBlock, "unsupported block_size");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  const int64_t numel = src.numel();
  TORCH_CHECK(0 <= b0 && b0 <= b1 && (b1 - 1) * block_size < std::max<int64_t>(numel, 1),
              "blocks [", b0, ", ", b1, ") are not blocks of ", numel, " elements");
  TORCH_CHECK(codes.device().is_cpu() && codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                  codes.numel() >= b1 * block_size * bits / 8,
              "codes must be contiguous uint8 on CPU with ", b1 * block_size * bits / 8, " bytes or more");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() >= b1,
              "scales must be contiguous fp32 with ", b1, " elements or more");
  const auto dtype = src.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "params must be fp32, bf16 or fp16");
  auto same = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype && t.numel() == numel, name,
                " must be a contiguous CPU tensor of src's dtype with ", numel, " elements");
  };
  same(src, "src");
  same(dst, "dst");
  const bool own = newv.defined() && newv.numel() > 0;
  if (own) same(newv, "newv");
  const bool has_dst2 = dst2.defined() && dst2.numel() > 0;
  if (has_dst2) {
    TORCH_CHECK(own, "dst2 is the own shard's (needs newv)");
    same(dst2, "dst2");
  }
  const int64_t chunks = (b1 - b0 + kChunkBlocks - 1) / kChunkBlocks;
  std::vector<double> partials(2 * chunks, 0.0);
  ApplyArgs a{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), numel, block_size, src.data_ptr(),
              dst.data_ptr(), own ? newv.data_ptr() : nullptr, has_dst2 ? dst2.data_ptr() : nullptr, swap,
              partials.data(), pick_isa(isa), unrotate_signs(signs, block_size), static_cast<float>(rot_scale)};
  switch (dtype) {
    case at::kFloat: apply_dtype<float>(a, b0, b1, bits); break;
    case at::kBFloat16: apply_dtype<c10::BFloat16>(a, b0, b1, bits); break;
    default: apply_dtype<c10::Half>(a, b0, b1, bits); break;
  }
  std::vector<double> sums{0.0, 0.0};
  for (int64_t c = 0; c < chunks; ++c) {
    sums[0] += partials[2 * c];
    sums[1] += partials[2 * c + 1];
  }
  return sums;
}
