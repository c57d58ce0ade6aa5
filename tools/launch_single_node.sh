#!/usr/bin/env bash
# One machine, all its GPUs (or CPU ranks): the common 8-GPU-box case.
#   tools/launch_single_node.sh configs/gpt_1.3b.yaml --loco-bits 4
#   NPROC_PER_NODE=4 tools/launch_single_node.sh configs/tiny_moe.yaml --expert-model-parallel-size 2
# Extra arguments go to pretrain_gpt.py after the config.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 || ! -f "$1" ]]; then
    echo "usage: $0 CONFIG.yaml [pretrain_gpt.py flags...] (config '${1:-}' not found)" >&2
    exit 2
fi
CONFIG="$1"
shift
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        NPROC_PER_NODE="$(nvidia-smi --list-gpus | wc -l)"
    else
        NPROC_PER_NODE=2
    fi
fi
exec torchrun --standalone --nproc-per-node "$NPROC_PER_NODE" pretrain_gpt.py --config "$CONFIG" "$@"
