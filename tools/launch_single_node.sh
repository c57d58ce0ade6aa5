#!/usr/bin/env bash
# One machine, all its GPUs (or CPU ranks): the common 8-GPU-box case.
#   tools/launch_single_node.sh configs/gpt_1.3b.yaml --loco-bits 4
#   NPROC_PER_NODE=4 tools/launch_single_node.sh configs/tiny_moe.yaml --expert-model-parallel-size 2
#   MAX_RESTARTS=2 tools/launch_single_node.sh configs/gpt_1.3b.yaml --save ck --load ck --save-interval 500
# Extra arguments go to pretrain_gpt.py after the config. MAX_RESTARTS (default 0): torchrun
# restarts the worker group after a worker dies; each restart resumes from --load, so pass
# --save and --load the same folder. SIGTERM (docker stop, kill): torchrun forwards it, the
# workers save at the end of the current step (given --save) and exit 0.
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
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # restarted groups reconnect (torch 2.13, see tools/launch.py)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"  # time to save after SIGTERM
exec python tools/torchrun.py --max-restarts "${MAX_RESTARTS:-0}" --standalone --nproc-per-node "$NPROC_PER_NODE" pretrain_gpt.py --config "$CONFIG" "$@"
