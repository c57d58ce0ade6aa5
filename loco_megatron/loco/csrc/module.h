// The torch-facing functions of the extension that loco_cpu.cpp (the Python module) and
// param_apply.cpp share.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace loco_cpu {

// 2: AVX-512 (F/BW/VL/DQ), 1: AVX2+FMA, 0: baseline (the best copy this CPU runs).
int isa_level();

// The instruction-set copy to run: `requested` when the CPU has it (tests force each
// copy), else the best the CPU has.
int pick_isa(int64_t requested);

// The Hadamard signs [B] a decode unrotates with, or null (undefined or empty: no rotation).
const float* unrotate_signs(const at::Tensor& signs, int64_t block_size);

std::vector<at::Tensor> compress(const at::Tensor& g, const at::Tensor& err, const at::Tensor& err_scales,
                                 double beta, int64_t bits, int64_t block_size, bool two_pass,
                                 const at::Tensor& err_scratch, const at::Tensor& err_s_scratch,
                                 double numel_stat, int64_t isa, int64_t rows_arg, int64_t quantizer,
                                 bool mse, const at::Tensor& signs, double rot_scale, bool stochastic,
                                 int64_t key);

void decompress_sum(const at::Tensor& recv, int64_t code_bytes, int64_t shard, int64_t bits, int64_t block_size,
                    at::Tensor out, double scale, int64_t isa, const at::Tensor& signs, double rot_scale);

// Blocks [b0, b1) of one gathered row applied to its shard (param_apply.cpp, param_apply.h).
std::vector<double> param_apply(const at::Tensor& codes, const at::Tensor& scales, int64_t b0, int64_t b1,
                                int64_t bits, int64_t block_size, const at::Tensor& src, at::Tensor dst,
                                const at::Tensor& newv, const at::Tensor& dst2, bool swap, int64_t isa,
                                const at::Tensor& signs, double rot_scale);

}  // namespace loco_cpu
