// Fused CPU kernels for LoCo, the Python module: compress (compensate, block absmax,
// quantise, pack, residual, error update, int8 re-quantisation) and decompress-and-sum, for
// the original scheme and for every quantiser option (quant_options.h), and the parameter
// gather's decode-and-apply (param_apply.cpp). This unit checks arguments and dispatches
// on dtype, width and instruction set; the hot loops are compress.h, decompress.h and
// param_apply.h, compiled once per instruction set in isa_base.cpp, isa_avx2.cpp and
// isa_avx512.cpp (kernels.h says why several units).
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

#include <vector>

#include "kernels.h"
#include "module.h"

namespace loco_cpu {

#if defined(__x86_64__)
// 2: AVX-512 (F/BW/VL/DQ), 1: AVX2+FMA, 0: baseline x86-64.
int isa_level() {
  static const int level = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
                               ? 2
                               : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
  return std::min(level, LOCO_MAX_ISA);
}
#else  // other architectures: the baseline copy only
int isa_level() { return 0; }
#endif

template <typename T, bool HAS_ERR, int BITS, bool SK>
void run_all(const CompressArgs& a, int64_t nb, bool scales_only) {
  const int64_t chunks = (nb + kChunkBlocks - 1) / kChunkBlocks;
  const int isa = a.isa;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b0 = c * kChunkBlocks, b1 = std::min(nb, b0 + kChunkBlocks);
      double* part = a.partials + 3 * c;
#if LOCO_MAX_ISA >= 2
      if (isa == 2) run_chunk_avx512<T, HAS_ERR, BITS, SK>(a, b0, b1, part, scales_only);
      else
#endif
      if (isa == 1) run_chunk_avx2<T, HAS_ERR, BITS, SK>(a, b0, b1, part, scales_only);
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

template <typename OUT, int BITS>
void decomp_all(const DecompArgs& a, int64_t nb) {
  const int isa = a.isa;
  at::parallel_for(0, nb, kChunkBlocks, [&](int64_t b0, int64_t b1) {
#if LOCO_MAX_ISA >= 2
    if (isa == 2) decomp_avx512<OUT, BITS>(a, b0, b1);
    else
#endif
    if (isa == 1) decomp_avx2<OUT, BITS>(a, b0, b1);
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

}  // namespace loco_cpu

namespace {
int64_t isa() { return loco_cpu::isa_level(); }
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("compress", &loco_cpu::compress, "LoCo fused compress (see loco_cpu.cpp)");
  m.def("decompress_sum", &loco_cpu::decompress_sum, "LoCo fused decompress-and-sum");
  m.def("param_apply", &loco_cpu::param_apply, "parameter gather: decode one row and apply it (see param_apply.h)");
  m.def("isa", &isa, "the best instruction-set copy this CPU runs: 2 AVX-512, 1 AVX2+FMA, 0 baseline");
}
