#!/usr/bin/env bash
# The one prepared GPU check (about 5 minutes on an H200): the kernel tests on CUDA
# (compiled, not interpreted), then kernel throughput vs device-to-device copy and the
# speedup over the torch reference, into $OUT (or ./gpu_results).
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
mkdir -p "$OUT"
pip install -q -r requirements-test.txt
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
# Kernel bit-compatibility on CUDA (the training test needs gloo+CPU ranks; skip it here).
timeout 300 python -m pytest -q tests/test_triton_kernels.py -k "not training" 2>&1 | tee "$OUT/kernel_tests.txt"
timeout 400 python benchmarks/kernels.py --sizes 1M,4M,16M,64M,256M --kernels auto 2>&1 | tee "$OUT/kernels_gpu.txt"
