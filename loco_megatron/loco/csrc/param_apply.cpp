// The parameter gather's decode-and-apply (the contract: param_apply.h): argument checks,
// the dispatch on dtype, width and instruction set, threads. Its own unit, compiled in
// parallel with the others.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "kernels.h"
#include "module.h"

namespace loco_cpu {

// Blocks [b0, b1) in chunks of kChunkBlocks (one work item and one norms partial each).
template <typename T, int BITS, bool OWN>
void apply_all(const ApplyArgs& a, int64_t b0, int64_t b1) {
  const int64_t chunks = (b1 - b0 + kChunkBlocks - 1) / kChunkBlocks;
  const int isa = a.isa;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = b0 + c * kChunkBlocks, hi = std::min(b1, lo + kChunkBlocks);
      double* part = a.partials + 2 * c;
#if LOCO_MAX_ISA >= 2
      if (isa == 2) apply_avx512<T, BITS, OWN>(a, lo, hi, part);
      else
#endif
      if (isa == 1) apply_avx2<T, BITS, OWN>(a, lo, hi, part);
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

}  // namespace loco_cpu
