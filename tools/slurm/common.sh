#!/usr/bin/env bash
# Shared body of the sbatch templates: environment, one torchrun per node through srun,
# and checkpoint-then-requeue on the signal Slurm sends before the time limit (or on
# preemption). Sourced by pretrain_gpt.sbatch / pretrain_moe.sbatch, which set:
#   CONFIG    configs/*.yaml with the model and training options
#   RUN_DIR   folder of this run: checkpoints/, metrics.jsonl, STOP (kept across requeues)
#   OVERRIDES array of extra pretrain_gpt.py flags (optional)
# and read from the submitter's environment:
#   SETUP      shell code run on every node before training, e.g. "source venv/bin/activate"
#              or "module load cuda; conda activate loco" (optional)
#   DATA_PATH  indexed dataset prefix (tools/preprocess_data.py --output-prefix) and
#   TOKENIZER  its tokenizer model: required unless the config is a tiny_* one or sets
#              data-path itself (else a 1.3B model would train on the built-in corpus)
#   DILOCO_REPLICAS  DiLoCo: split the job into this many replicas of whole nodes
#              (--diloco-replicas; e.g. 2 for two sites; docs/diloco.md) (optional)

set -euo pipefail

: "${CONFIG:?set CONFIG to a configs/*.yaml file}"
: "${RUN_DIR:?set RUN_DIR}"
if [[ ! -f "$CONFIG" ]]; then
    echo "error: CONFIG=$CONFIG does not exist" >&2
    exit 2
fi
if [[ -n "${DATA_PATH:-}" || -n "${TOKENIZER:-}" ]]; then
    if [[ -z "${DATA_PATH:-}" || -z "${TOKENIZER:-}" ]]; then
        echo "error: set both DATA_PATH and TOKENIZER (the dataset and the tokenizer it was made with)" >&2
        exit 2
    fi
    OVERRIDES=(--data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER" "${OVERRIDES[@]}")
elif [[ "$(basename "$CONFIG")" != tiny_* ]] && ! grep -q '^data-path:' "$CONFIG"; then
    echo "error: $CONFIG needs real data: set DATA_PATH (indexed dataset prefix) and TOKENIZER (its tokenizer model)" >&2
    exit 2
fi
if [[ -n "${DILOCO_REPLICAS:-}" ]]; then
    NODES="${SLURM_NNODES:-1}"
    if ! [[ "$DILOCO_REPLICAS" =~ ^[1-9][0-9]*$ ]] || (( NODES % DILOCO_REPLICAS )); then
        echo "error: DILOCO_REPLICAS=$DILOCO_REPLICAS does not divide the job's $NODES nodes (replicas are whole nodes)" >&2
        exit 2
    fi
    OVERRIDES=(--diloco-replicas "$DILOCO_REPLICAS" "${OVERRIDES[@]}")
fi
# SETUP (see srun below), tried once here first: a SETUP that fails is one line, not one per node.
if [[ -n "${SETUP:-}" ]] && ! setup_err="$(bash -c "$SETUP" 2>&1 >/dev/null)"; then
    echo "error: SETUP failed on $(hostname): $(tail -n 1 <<< "${setup_err:-its exit status was not 0}")" >&2
    exit 2
fi
mkdir -p "$RUN_DIR"
STOP_FILE="$RUN_DIR/STOP"
rm -f "$STOP_FILE"  # a fresh start or a requeued one: train until told otherwise

# NCCL across nodes; override what your fabric needs (e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA).
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
# wandb: logs online with WANDB_API_KEY, else offline into RUN_DIR (wandb sync later).
export WANDB_DIR="${WANDB_DIR:-$RUN_DIR}"

echo "job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-?} (${SLURM_NNODES:-?} nodes): $CONFIG -> $RUN_DIR"

# In-job restarts (torchrun --max-restarts, MAX_RESTARTS below): torch 2.13's shared
# rendezvous TCP store makes a restarted worker group fail with "Gloo connectFullMesh
# failed"; a separate store per rendezvous round restarts cleanly.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# Seconds torchrun lets its workers finish (save) after forwarding a SIGTERM, before
# SIGKILL. Slurm's own KillWait (scancel, preemption; 30 s by default) still bounds it.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"

STOP_REQUESTED=0
# shellcheck disable=SC2329  # invoked by the trap below
on_signal() {
    # Slurm's --signal=B:USR1@N (or a preemption SIGTERM) reaches this batch shell: ask
    # the training to save a checkpoint and stop; the job is requeued once it has. (A
    # SIGTERM also reaches the workers directly, which then save and stop by themselves.)
    echo "signal received: asking training to checkpoint and stop"
    STOP_REQUESTED=1
    touch "$STOP_FILE"
}
trap on_signal USR1 TERM

# --cpus-per-task: Slurm 22.05+ no longer hands sbatch's value down to srun, which would
# pin each node's torchrun (and all its ranks) to one core. --label prefixes every output
# line with its node. SETUP runs in the node's own shell before launch.py starts.
export SETUP="${SETUP:-}"
# shellcheck disable=SC2016  # $SETUP and $@ are expanded by each node's shell, not here
srun --kill-on-bad-exit=1 --ntasks-per-node=1 --label ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} \
    bash -c 'eval "$SETUP" && exec "$@"' loco-node \
    python tools/launch.py exec --config "$CONFIG" --run-dir "$RUN_DIR" ${NPROC_PER_NODE:+--nproc-per-node "$NPROC_PER_NODE"} \
    --max-restarts "${MAX_RESTARTS:-2}" \
    -- "${OVERRIDES[@]}" &
SRUN_PID=$!
# Until srun has finished: keep a requested stop's file in place. A signal that comes while
# the training is still starting (Slurm sends --signal up to a minute early) finds its file
# older than the training process, which discards it as left over from an earlier job; the
# file made again here is newer, and honoured.
while kill -0 "$SRUN_PID" 2>/dev/null; do
    if [[ $STOP_REQUESTED -eq 1 && ! -e "$STOP_FILE" ]]; then touch "$STOP_FILE"; fi
    sleep 1
done
rc=0
wait "$SRUN_PID" || rc=$?

# Training removes the stop file once it has honoured it, so remember the request here.
if [[ $STOP_REQUESTED -eq 1 && $rc -eq 0 ]]; then
    rm -f "$STOP_FILE"
    echo "checkpoint written; requeueing job ${SLURM_JOB_ID:-?}"
    scontrol requeue "${SLURM_JOB_ID:?}"
fi
exit "$rc"
