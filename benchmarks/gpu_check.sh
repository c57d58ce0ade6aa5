#!/usr/bin/env bash
# The one prepared GPU check (at most 10 minutes on one H200: each step has its own time limit, 600 s in all). Everything a single GPU can
# tell us today, each step bounded in time and recorded even when an earlier one fails:
#   1. the device and the versions in use;
#   2. the Triton kernel tests on CUDA (compiled, not interpreted): codes, scales, error
#      buffers and decompress-and-sum against the torch reference, for the original
#      scheme and (option_tests) every quantiser option, the 2-bit default included;
#   3. kernel throughput (compress, decompress-and-sum) against a device-to-device copy
#      and the torch reference, 16M..256M elements, 4 bits and 2 bits (the 2-bit default
#      options: uniform grid, mse scale, Hadamard rotation);
#   4. the kernels at training shapes (benchmarks/shapes_check.py): 8 data-parallel ranks
#      simulated on the one GPU compress a 64M-element bucket (a ragged last row), route the
#      rows as the all-to-all would, decompress and sum, then encode and apply a parameter
#      gather, on the Triton kernels and on torch from the same inputs, for the 4-bit and
#      2-bit defaults: whether they agree (bit for bit, or within the documented bound) and
#      each phase's time against a device copy (the compression a one-GPU run never does);
#   4b. LoCo's per-bucket hot path (compress, reduce-scatter launch and decompress-and-sum,
#      parameter-gather encode and apply) under torch.cuda.set_sync_debug_mode("error"), on
#      the Triton kernels and on torch, 4 bits and the 2-bit default (benchmarks/sync_check.py):
#      any blocking host-device synchronisation fails the step;
#   5. a one-GPU training smoke run of pretrain_gpt.py on NCCL (megatron-core on CUDA,
#      LoCo hooks installed; a DP group of one sends nothing, so this checks the GPU
#      path of the model, buckets and optimizer, not compression on the wire);
#   6. the same smoke run with TransformerEngine layers (--transformer-impl transformer_engine,
#      megatron-core's TE layer spec), skipped with a line when TE is not importable;
#   7. several ranks on the one GPU over gloo (benchmarks/gpu_ranks.py: every rank on cuda:0,
#      the collectives gloo lacks for CUDA tensors staged through host copies by the
#      platform layer): 2 ranks with LoCo 4-bit and the 4-bit parameter gather overlapped
#      (Triton kernels, real buckets) for 6 steps, the same 3 steps with a save and 3 more
#      resumed from it (gloo_resume_check: the resumed losses must equal the unbroken run's,
#      bit for bit); 4 ranks with the 2-bit default and the 2-bit parameter gather; and
#      Megatron-FSDP on 2 ranks with its overlapped parameter gathers.
# Output goes to $OUT (or ./gpu_results), one file per step, and a summary line each.
#   bash benchmarks/gpu_check.sh
# Packages: a GPU machine that cannot reach a registry gets wheels carried in .whl/
# (installed to /tmp/site, never replacing the machine's torch); otherwise it must already
# have the runtime's packages (requirements.txt without touching its CUDA torch).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-gpu_results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
summary="$OUT/summary.txt"
: > "$summary"
step() {  # step NAME TIMEOUT_S CMD...: run, keep its output, record rc and seconds
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: rc $rc in $((SECONDS - t0)) s" | tee -a "$summary"
    tail -n 25 "$OUT/$name.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"

step kernel_tests 70 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "not training"
step option_tests 80 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_options.py -k "not sm90"
step kernels_4bit 35 "$PY" benchmarks/kernels.py --sizes 16M,64M,256M --bits 4 --kernels auto
step kernels_2bit 40 "$PY" benchmarks/kernels.py --sizes 16M,64M --bits 2 --kernels auto
step sync_debug 40 "$PY" benchmarks/sync_check.py --kernels triton,torch --bits 4,2
step shapes 50 "$PY" benchmarks/shapes_check.py --kernels triton --numel 67108861 --world 8 --steps 3
step train_1gpu 50 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_gpt.py \
    --train-iters 30 --eval-interval 10 --eval-iters 2 --log-interval 5 --loco-bits 4 --bf16 \
    --data-cache-path /tmp/loco_cache --metrics-jsonl "$OUT/train_1gpu.jsonl"
if "$PY" -c "import transformer_engine.pytorch" > "$OUT/te_import.txt" 2>&1; then
    step train_1gpu_te 40 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_gpt.py \
        --transformer-impl transformer_engine --train-iters 20 --eval-interval 10 --eval-iters 2 --log-interval 5 \
        --loco-bits 4 --bf16 --data-cache-path /tmp/loco_cache --metrics-jsonl "$OUT/train_1gpu_te.jsonl"
else
    echo "train_1gpu_te: skipped, TransformerEngine is not importable ($(tail -n 1 "$OUT/te_import.txt"))" | tee -a "$summary"
fi

# 7. Several ranks on the one GPU over gloo (see the header); tiny model, Triton kernels.
TINY=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2
      --global-batch-size 8 --lr-warmup-iters 2 --eval-interval 0 --log-interval 1 --ddp-bucket-size 40000
      --data-cache-path /tmp/loco_cache)
GPU_RANKS=("$PY" -m torch.distributed.run --standalone)
ONE_GPU=(benchmarks/gpu_ranks.py "${TINY[@]}")
LOCO4=(--loco-bits 4 --param-gather-bits 4 --overlap-param-gather --bf16 --ckpt-format torch --lr-decay-iters 6)
step gloo_2r_loco4 45 "${GPU_RANKS[@]}" --nproc_per_node 2 "${ONE_GPU[@]}" "${LOCO4[@]}" --train-iters 6 \
    --metrics-jsonl "$OUT/gloo_2r_loco4.jsonl"
rm -rf /tmp/loco_gloo_ck
step gloo_2r_save 35 "${GPU_RANKS[@]}" --nproc_per_node 2 "${ONE_GPU[@]}" "${LOCO4[@]}" --train-iters 3 \
    --save /tmp/loco_gloo_ck --metrics-jsonl "$OUT/gloo_2r_save.jsonl"
step gloo_2r_resume 35 "${GPU_RANKS[@]}" --nproc_per_node 2 "${ONE_GPU[@]}" "${LOCO4[@]}" --train-iters 6 \
    --load /tmp/loco_gloo_ck --metrics-jsonl "$OUT/gloo_2r_resume.jsonl"
step gloo_resume_check 10 "$PY" benchmarks/gpu_ranks.py --compare "$OUT/gloo_2r_loco4.jsonl" "$OUT/gloo_2r_resume.jsonl"
step gloo_4r_loco2 45 "${GPU_RANKS[@]}" --nproc_per_node 4 "${ONE_GPU[@]}" --loco-bits 2 --param-gather-bits 2 \
    --overlap-param-gather --bf16 --train-iters 4 --lr-decay-iters 4 --metrics-jsonl "$OUT/gloo_4r_loco2.jsonl"
step gloo_2r_fsdp 35 "${GPU_RANKS[@]}" --nproc_per_node 2 "${ONE_GPU[@]}" --use-megatron-fsdp --train-iters 4 \
    --lr-decay-iters 4 --metrics-jsonl "$OUT/gloo_2r_fsdp.jsonl"
cat "$summary"
