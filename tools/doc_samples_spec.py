"""What each console sample of the docs shows (``tools/doc_samples.py`` runs and renders it).

:data:`RUNS`: each command as a page shows it (bash, run in the scratch folder), with what
it needs that the page does not show (``setup``), the runs whose files it reads
(``after``), its exit code and, for a fault the page shows, the signal sent on cue.
:data:`SAMPLES`: each marked block: which runs' commands it shows and which of their
output lines (``picks``: regular expressions, a line is shown when one matches; None:
every line), in one of :data:`FENCES`' styles. Several samples may read one run: the
start-up lines, the memory line and the end-of-run summary of the README's first command
come from one 200-step run.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Signal:
    """Sent once, when the run prints a line matching ``when`` (re.search): to its whole
    process group (``rank`` None, as Slurm or ``docker stop`` signal a job) or to the
    torchrun worker of that rank."""

    when: str
    signum: int
    rank: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Run:
    command: str
    """bash, exactly as the page shows it (continuation lines included)."""
    setup: str = ""
    """bash run first in the same shell, not shown: inputs the page makes elsewhere or a
    variable another shown command defined."""
    after: tuple[str, ...] = ()
    """Runs whose files this one reads (they run first, in the same folder)."""
    exit_code: int = 0
    """What the command exits with (a sample of an error shows a non-zero one)."""
    signal: Optional[Signal] = None
    env: tuple[tuple[str, str], ...] = ()
    unset: tuple[str, ...] = ()
    """Environment variables removed for the run."""
    timeout: int = 1200
    """Seconds before the run is killed and reported."""
    folder: str = ""
    """Subfolder of the scratch folder to run in (runs of two pages that both write ``ck``)."""


@dataclasses.dataclass(frozen=True)
class Part:
    run: str
    picks: Optional[tuple[str, ...]] = None
    """Output lines shown: those matching one of these (re.search); None: all; (): none."""
    command: bool = True
    """Show the run's command before its lines."""
    log: str = ""
    """Show this file's lines (in the scratch folder, after the run) instead of its output."""


@dataclasses.dataclass(frozen=True)
class Sample:
    parts: tuple[Part, ...]
    style: str = "console"
    """console: ``$ command`` then its lines; bash and python: the command as code, its lines
    as ``# `` comments; output: the lines only (the command is in the text above)."""


FENCES = {"console": "```", "output": "```", "bash": "```bash", "python": "```python"}

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
        "--global-batch-size 8")
START_UP = (r"^LoCo memory", r"^model:", r"^layout:", r"^batch:", r"^LoCo:", r"^kernels:")
SUMMARY = (r"^run summary:", r"^  (final loss|gradients sent|parameters all-gathered|last checkpoint):")
FSDP_ARGS = ('ARGS="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 1 \\\n'
             '  --global-batch-size 8 --lr-warmup-iters 2 --eval-interval 0 --log-interval 1 --ddp-bucket-size 40000 \\\n'
             '  --train-iters 4 --use-megatron-fsdp --ckpt-format fsdp_dtensor"')
CKPT_ARGS = ('A="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2\n'
             '   --global-batch-size 8 --lr-warmup-iters 2 --log-interval 2 --eval-interval 0 --loco-bits 4"')
DATA_ARGS = ('ARGS="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 \\\n'
             '  --global-batch-size 8 --train-iters 10 --lr-warmup-iters 2 --eval-interval 10 --eval-iters 1 '
             '--log-interval 5 \\\n'
             '  --data-path data/corpus_text_document --tokenizer-type HuggingFaceTokenizer --tokenizer-model data/hf_tok \\\n'
             '  --loco-bits 4 --save runs/hf_demo/ckpt"')
HF_TOKENIZER = "--tokenizer-type HuggingFaceTokenizer --tokenizer-model data/hf_tok"
ELASTIC_SITES = """mkdir -p runs
torchft_lighthouse --min_replicas 1 --bind "[::]:29510" --quorum_tick_ms 100 \\
    --join_timeout_ms 10000 --heartbeat_timeout_ms 5000 > runs/lighthouse.log 2>&1 &
site() {  # replica $1, a job of its own (more flags after it)
  torchrun --standalone --nproc_per_node 1 pretrain_gpt.py --global-batch-size 12 --micro-batch-size 2 \\
      --diloco-replicas 3 --diloco-replica-id $1 --diloco-lighthouse http://localhost:29510 \\
      --diloco-inner-steps 32 --train-iters 640 --save runs/site$1 --save-interval 32 "${@:2}" > runs/site$1.log 2>&1
}
site 0 & site 1 & site 2 &
# replica 2 lost (every rank killed) in its fifth outer interval
until grep -q "^iter 150/" runs/site2.log; do sleep 1; done
pkill -KILL -f "diloco-replica-id [2]"
# restarted from its own last checkpoint once the others have seen it leave
until grep -q "replica 2 left" runs/site0.log; do sleep 1; done
mv runs/site2.log runs/site2.killed.log
site 2 --load runs/site2 &
wait %2 %3 %5; kill %1"""
"""diloco.md's elastic example: a lighthouse and three replica jobs on one machine, one
replica killed mid-interval and restarted (the pkill pattern's ``[2]`` keeps it from
matching the shell that runs these lines)."""

ELASTIC_UNEQUAL = """mkdir -p runs
torchft_lighthouse --min_replicas 1 --bind "[::]:29511" > runs/lighthouse2.log 2>&1 &
site() {  # replica $1 with $2 ranks (more flags after them)
  torchrun --standalone --nproc_per_node $2 pretrain_gpt.py --global-batch-size 12 --micro-batch-size 2 \\
      --diloco-replicas 2 --diloco-replica-id $1 --diloco-lighthouse http://localhost:29511 \\
      --diloco-outer-ranks 1 --diloco-batch-split throughput --train-iters 192 --diloco-inner-steps 16 \\
      "${@:3}" > runs/unequal$1.log 2>&1
}
site 0 2 --tensor-model-parallel-size 2 & site 1 1 & wait %2 %3; kill %1"""
"""diloco.md's unequal sites: a 2-rank TP 2 replica and a 1-rank replica on one machine."""

RUNS: dict[str, Run] = {
    # README, training.md, loco.md: the README's first command, 200 steps
    "default": Run("torchrun --standalone --nproc_per_node 2 pretrain_gpt.py --loco-bits 4"),
    "cp-error": Run("python pretrain_gpt.py --context-parallel-size 2", exit_code=2),
    "profile": Run(
        "torchrun --standalone --nproc_per_node 2 pretrain_gpt.py --num-layers 2 --hidden-size 64 "
        "--num-attention-heads 4 \\\n    --seq-length 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 4 "
        "--log-interval 2 --loco-bits 4 \\\n    --profile --profile-step-start 2 --profile-step-end 3 --profile-ranks 0,1 "
        "--profile-dir prof \\\n    --tensorboard-dir tb --peak-tflops 1.0"),
    "latin": Run("python tools/preprocess_data.py --input latin.jsonl --tokenizer-model tok.model --output-prefix out/d",
                 setup="printf '{\"text\": \"ok\"}\\n{\"text\": \"caf\\xe9 au lait\"}\\n' > latin.jsonl\n"
                       "cp \"$(ls ~/.cache/loco_megatron/*/*.model | head -1)\" tok.model",
                 after=("default",), exit_code=2),
    # parallelism.md, README: dry runs
    "mixtral-32": Run("python pretrain_gpt.py --config configs/mixtral_8x7b.yaml --dry-run --world-size 32"),
    "mixtral-16": Run("python pretrain_gpt.py --config configs/mixtral_8x7b.yaml --dry-run --world-size 16; echo rc=$?"),
    "mixtral-etp2": Run("python pretrain_gpt.py --config configs/mixtral_8x7b.yaml --expert-tensor-parallel-size 2 "
                        "--dry-run --world-size 32", exit_code=2),
    "tiny-moe-dry": Run("python pretrain_gpt.py --config configs/tiny_moe.yaml --dry-run --world-size 4 "
                        "--tensor-model-parallel-size 2 \\\n    --expert-model-parallel-size 4 "
                        "--expert-tensor-parallel-size 1 --sequence-parallel"),
    "llama-header": Run("python pretrain_gpt.py --config configs/llama2_7b.yaml --dry-run"),
    # training.md: Muon
    "muon-dry": Run("python pretrain_gpt.py --dry-run --world-size 2 --optimizer muon --loco-bits 4"),
    # diloco.md: what the link between replicas needs (projected, nothing measured)
    "link-needs": Run("python benchmarks/link_needs.py"),
    "link-dry": Run("python pretrain_gpt.py --config configs/llama2_7b.yaml --dry-run --world-size 128 "
                    "--diloco-replicas 2 --diloco-eager --diloco-link-gbps 1"),
    "lr-defaults": Run("python - <<'EOF'\nfrom loco_megatron.cli import parse_config\n"
                       'for flags in ("", "--optimizer muon", "--diloco-replicas 2", "--diloco-replicas 2 --optimizer muon"):\n'
                       "    o, d = (c := parse_config(flags.split())).optimizer, c.diloco\n"
                       '    print(f"{flags or \'(no flags)\':<38} --lr {o.lr:g}  --muon-extra-scale-factor '
                       '{o.muon_extra_scale_factor:g}"\n'
                       '          + (f"  --diloco-outer-lr {d.diloco_outer_lr:g}" if d.enabled else ""))\nEOF'),
    "muon-refused": Run("python pretrain_gpt.py --optimizer muon --param-gather-bits 4", exit_code=2),
    "render-error": Run("SLURM_JOB_NODELIST=a,b SLURM_NNODES=2 SLURM_GPUS_ON_NODE=8 python tools/launch.py render \\\n"
                        "    --config configs/mixtral_8x7b.yaml --run-dir runs/x; echo rc=$?"),
    # README, export.md: a PP 2 checkpoint and its export
    "pp-train": Run("torchrun --standalone --nproc_per_node 2 pretrain_gpt.py --pipeline-model-parallel-size 2 \\\n"
                    "    --train-iters 20 --eval-interval 0 --save ckpt/tiny"),
    "export": Run("python tools/export_hf.py --load ckpt/tiny --out hf/tiny", after=("pp-train",)),
    "export-load": Run("python -c \"from transformers import AutoModelForCausalLM, AutoTokenizer; "
                       "m = AutoModelForCausalLM.from_pretrained('hf/tiny'); t = AutoTokenizer.from_pretrained('hf/tiny')\"",
                       after=("export",)),
    "export-again": Run("python tools/export_hf.py --load ckpt/tiny --out hf/tiny", after=("export",), exit_code=2),
    # loco.md
    "loco-2bit": Run("torchrun --standalone --nproc_per_node 2 pretrain_gpt.py --loco-bits 2 --loco-quantizer uniform "
                     "--loco-scale mse \\\n    --loco-rotation hadamard --loco-rounding stochastic --train-iters 20 "
                     "--log-interval 10 --eval-interval 20 --eval-iters 2"),
    # kernels.md: the kernels line of three configurations
    "kernels-4": Run("torchrun --standalone --nproc_per_node 2 pretrain_gpt.py --loco-bits 4 --param-gather-bits 4 "
                     "--train-iters 2"),
    "kernels-2": Run("torchrun --standalone --nproc_per_node 2 pretrain_gpt.py --loco-bits 2 --param-gather-bits 2 "
                     "--train-iters 2"),
    "kernels-16": Run("torchrun --standalone --nproc_per_node 2 pretrain_gpt.py --loco-bits 4 --loco-error-bits 16 "
                      "--train-iters 2"),
    "ahead": Run("python -m loco_megatron.loco.triton_kernels.ahead", unset=("TRITON_INTERPRET",)),
    # fsdp.md
    "fsdp-run": Run("OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 pretrain_gpt.py \\\n"
                    "  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\\n"
                    "  --micro-batch-size 1 --global-batch-size 8 --lr-warmup-iters 2 --eval-interval 0 \\\n"
                    "  --log-interval 1 --ddp-bucket-size 40000 --train-iters 6 \\\n"
                    "  --use-megatron-fsdp --num-distributed-optimizer-instances 2 --loco-ranks-per-node 2 \\\n"
                    "  --loco-bits 4 --ckpt-format torch --save runs/fsdp_doc/ck"),
    "fsdp-layout": Run("python pretrain_gpt.py --use-megatron-fsdp --num-distributed-optimizer-instances 2 "
                       "--loco-ranks-per-node 8 \\\n    --loco-bits 4 --ckpt-format fsdp_dtensor --global-batch-size 64 "
                       "--dry-run --world-size 16"),
    "fsdp-save": Run(f"{FSDP_ARGS}\nOMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 pretrain_gpt.py $ARGS \\\n"
                     "  --num-distributed-optimizer-instances 2 --loco-ranks-per-node 2 --loco-bits 4 --save ck "
                     "--save-interval 2", folder="fsdp"),
    "fsdp-rewind": Run("rm -r ck/iter_0000004; echo 2 > ck/latest_checkpointed_iteration.txt", after=("fsdp-save",),
                       folder="fsdp"),
    "fsdp-same": Run("OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 pretrain_gpt.py $ARGS \\\n"
                     "  --num-distributed-optimizer-instances 2 --loco-ranks-per-node 2 --loco-bits 4 --load ck",
                     setup=FSDP_ARGS, after=("fsdp-rewind",), folder="fsdp"),
    "fsdp-two": Run("OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 pretrain_gpt.py $ARGS \\\n"
                    "  --num-distributed-optimizer-instances 2 --loco-ranks-per-node 1 --loco-bits 4 --load ck",
                    setup=FSDP_ARGS, after=("fsdp-same",), folder="fsdp"),
    "fsdp-flat": Run("OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 pretrain_gpt.py $ARGS "
                     "--loco-bits 0 --load ck", setup=FSDP_ARGS, after=("fsdp-two",), folder="fsdp"),
    # checkpoints.md: save on 2 ranks, resume on 4
    "ckpt-save": Run(f"{CKPT_ARGS}\ntorchrun --standalone --nproc_per_node=2 pretrain_gpt.py $A --train-iters 4 "
                     "--save ck --save-interval 2 --async-save", folder="checkpoints"),
    "ckpt-reshard": Run("torchrun --standalone --nproc_per_node=4 pretrain_gpt.py $A --train-iters 6 --load ck",
                        setup=CKPT_ARGS, after=("ckpt-save",), folder="checkpoints"),
    # multinode.md: a worker killed, a job stopped
    "restart": Run("NPROC_PER_NODE=2 MAX_RESTARTS=1 tools/launch_single_node.sh configs/tiny_gpt.yaml --train-iters 12 "
                   "\\\n    --lr-warmup-iters 2 --log-interval 1 --save ck --load ck --save-interval 2",
                   signal=Signal(r"^iter 9/12 ", signal.SIGKILL, rank=1), folder="restart"),
    "sigterm": Run("tools/launch_single_node.sh configs/tiny_gpt.yaml --log-interval 1 --save ck --load ck",
                   signal=Signal(r"^iter 11/200 ", signal.SIGTERM), folder="stop"),
    # generation.md
    "gen-train": Run("torchrun --standalone --nproc_per_node 2 pretrain_gpt.py --train-iters 60 --lr 3e-3 --eval-interval 30 \\\n"
                     "      --eval-iters 1 --log-interval 20 --loco-bits 4 --save runs/gen_doc/ckpt"),
    "gen-greedy": Run('python tools/generate.py --load runs/gen_doc/ckpt --prompt "def main():" --max-new-tokens 40',
                      after=("gen-train",)),
    "gen-sampled": Run('python tools/generate.py --load runs/gen_doc/ckpt --prompt "import os" --max-new-tokens 30 \\\n'
                       "      --top-p 0.9 --temperature 0.8 --seed 1", after=("gen-train",)),
    "gen-missing": Run("python tools/generate.py --load runs/gen_doc/nowhere --prompt x; echo $?"),
    # data.md: parquet -> Hugging Face tokenizer -> indexed dataset -> 2-node run -> export
    "data-parquet": Run("mkdir -p data\npython - <<'EOF'\n"
                        "import pathlib, sysconfig, pyarrow as pa, pyarrow.parquet as pq\n"
                        'files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))\n'
                        'pq.write_table(pa.table({"path": [f.name for f in files],\n'
                        '                         "content": [f.read_text(errors="replace") for f in files]}), '
                        '"data/corpus.parquet")\nEOF'),
    "data-tokenizer": Run("python tools/train_tokenizer.py --tokenizer-type HuggingFaceTokenizer --input "
                          "data/corpus.parquet \\\n    --json-keys content --output-prefix data/hf_tok --vocab-size 8000",
                          after=("data-parquet",)),
    "data-preprocess": Run("python tools/preprocess_data.py --input data/corpus.parquet --json-keys content \\\n"
                           f"    {HF_TOKENIZER} \\\n    --output-prefix data/corpus_text_document --workers 2",
                           after=("data-tokenizer",)),
    "data-meta": Run("cat data/corpus_text_document.meta.json", after=("data-preprocess",)),
    "data-no-column": Run(f"python tools/preprocess_data.py --input data/corpus.parquet {HF_TOKENIZER} "
                          "--output-prefix data/x", after=("data-tokenizer",), exit_code=2),
    "data-not-parquet": Run(f"python tools/preprocess_data.py --input data/fake.parquet --json-keys content "
                            f"{HF_TOKENIZER} --output-prefix data/x", setup="echo 'not a table' > data/fake.parquet",
                            after=("data-tokenizer",), exit_code=2),
    "data-ints": Run(f"python tools/preprocess_data.py --input data/ints.parquet --json-keys content {HF_TOKENIZER} "
                     "--output-prefix data/x",
                     setup="python -c \"import pyarrow as pa, pyarrow.parquet as pq; "
                           "pq.write_table(pa.table({'content': [1, 2]}), 'data/ints.parquet')\"",
                     after=("data-tokenizer",), exit_code=2),
    "data-hf": Run("mkdir -p data/corpus_hf && cp data/corpus.parquet data/corpus_hf/train.parquet\n"
                   "python tools/preprocess_data.py --hf-dataset data/corpus_hf --json-keys content \\\n"
                   f"    {HF_TOKENIZER} \\\n    --output-prefix data/corpus_hf_text_document",
                   after=("data-preprocess",)),
    "data-same": Run("cmp data/corpus_hf_text_document.bin data/corpus_text_document.bin && echo same",
                     after=("data-hf",)),
    "data-nodes": Run(f"{DATA_ARGS}\nfor NODE in 0 1; do\n"
                      "  OMP_NUM_THREADS=1 torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 1 \\\n"
                      "      --master-addr 127.0.0.1 --master-port 29533 pretrain_gpt.py $ARGS > node$NODE.log 2>&1 &\n"
                      "done\nwait", after=("data-preprocess",)),
    "data-render": Run("SLURM_JOB_NODELIST=node1,node2 SLURM_NNODES=2 SLURM_JOB_ID=42 python tools/launch.py render \\\n"
                       "    --config configs/tiny_gpt.yaml --run-dir runs/hf_demo2 --nproc-per-node 8 -- \\\n"
                       f"    --data-path data/corpus_text_document {HF_TOKENIZER} \\\n"
                       "    --loco-bits 4 --global-batch-size 64", after=("data-preprocess",)),
    "data-export": Run("python tools/export_hf.py --load runs/hf_demo/ckpt --out runs/hf_demo/hf", after=("data-nodes",)),
    "data-ids": Run("python - <<'EOF'\nfrom transformers import AutoTokenizer\n"
                    "from loco_megatron.data.tokenizer import load_tokenizer\n"
                    'hf = AutoTokenizer.from_pretrained("runs/hf_demo/hf")\n'
                    'train = load_tokenizer("data/hf_tok", "HuggingFaceTokenizer")\n'
                    'text = "def add(a, b):\\n    return a + b\\n"\n'
                    'print(hf(text)["input_ids"] == train.tokenize(text), hf(text)["input_ids"][:8])\nEOF',
                    after=("data-export",)),
    # diloco.md: two replicas in one job; three replica jobs on torchft, one killed and restarted
    "diloco-run": Run("torchrun --standalone --nproc_per_node 4 pretrain_gpt.py --loco-bits 4 --diloco-replicas 2 \\\n"
                      "    --diloco-inner-steps 32 --train-iters 256"),
    # diloco.md: the same run with SparseLoCo's outer exchange, and its dry run
    "diloco-sparse": Run("torchrun --standalone --nproc_per_node 4 pretrain_gpt.py --loco-bits 4 --diloco-replicas 2 \\\n"
                         "    --diloco-inner-steps 32 --diloco-outer-topk 64 --train-iters 256"),
    "diloco-sparse-dry": Run("python pretrain_gpt.py --loco-bits 4 --diloco-replicas 2 --diloco-inner-steps 32 "
                             "--diloco-outer-topk 64 \\\n    --dry-run --world-size 4"),
    "diloco-sites": Run(ELASTIC_SITES, timeout=1800, folder="sites"),
    "diloco-unequal": Run(ELASTIC_UNEQUAL, timeout=1800, folder="unequal"),
}

SAMPLES: dict[str, Sample] = {
    "readme-summary": Sample((Part("default", SUMMARY, command=False),), "output"),
    "readme-dry-run": Sample((Part("mixtral-32", (r"^layout:", r"^memory per GPU")),), "bash"),
    "readme-export": Sample((Part("pp-train", ()), Part("export")), "bash"),
    "training-startup": Sample((Part("default", START_UP[1:], command=False),), "output"),
    "training-cp-error": Sample((Part("cp-error", (r"error:",)),), "console"),
    "training-latin": Sample((Part("latin"),), "console"),
    "training-muon-dry": Sample((Part("muon-dry", (r"^optimizer:", r"^memory per GPU")),), "console"),
    "training-lr-defaults": Sample((Part("lr-defaults"),), "bash"),
    "training-muon-refused": Sample((Part("muon-refused", (r"error:",)),), "console"),
    "training-profile": Sample((Part("profile", (r"^iter \d+/", r"^profile:")),), "bash"),
    "loco-2bit": Sample((Part("loco-2bit", (r"^LoCo:", r"^iter 20 \| eval")),), "bash"),
    "loco-memory": Sample((Part("default", (r"^LoCo memory",), command=False),), "output"),
    "kernels-lines": Sample(tuple(Part(r, (r"^kernels:",)) for r in ("kernels-4", "kernels-2", "kernels-16")),
                            "console"),
    "kernels-ahead": Sample((Part("ahead", command=False),), "output"),
    "parallelism-dry-runs": Sample((Part("mixtral-32"), Part("mixtral-16"), Part("mixtral-etp2"),
                                    Part("tiny-moe-dry")), "console"),
    "parallelism-header": Sample((Part("llama-header", (r"^dry run:",)),), "console"),
    "parallelism-render-error": Sample((Part("render-error"),), "console"),
    "export-tiny": Sample((Part("pp-train", ()), Part("export"), Part("export-load", ())), "bash"),
    "export-error": Sample((Part("export-again"),), "console"),
    "fsdp-run": Sample((Part("fsdp-run", (r"^LoCo memory", r"^model:", r"^iter \d+/", r"checkpoint \d+ ")),),
                       "console"),
    "fsdp-layout": Sample((Part("fsdp-layout", (r"^layout:",)),), "console"),
    "fsdp-resume": Sample((
        Part("fsdp-save", (r"^iter [34]/4", r"checkpoint \d+ ")),
        Part("fsdp-rewind", ()),
        Part("fsdp-same", (r"^checkpoint:", r"checkpoint \d+ loaded", r"^iter [34]/4")),
        Part("fsdp-two", (r"^checkpoint:", r"checkpoint \d+ loaded", r"^iter [34]/4")),
        Part("fsdp-flat", (r"^checkpoint:", r"checkpoint \d+ loaded", r"^iter [34]/4"))), "console"),
    "checkpoints-reshard": Sample((
        Part("ckpt-save", (r"checkpoint \d+ (blocked|written)", r"^iter \d+/")),
        Part("ckpt-reshard", (r"^checkpoint:", r"^resuming from", r"checkpoint \d+ loaded", r"^iter \d+/"))), "bash"),
    "multinode-restart": Sample((Part("restart", (r"exitcode: -9", r"^resuming from", r"^iter 12/12")),), "bash"),
    "multinode-sigterm": Sample((Part("sigterm", (r"^stop requested", r"^  last checkpoint")),), "bash"),
    "generation-example": Sample((Part("gen-train", SUMMARY), Part("gen-greedy"), Part("gen-sampled"),
                                  Part("gen-missing")), "console"),
    "data-parquet": Sample((Part("data-parquet"),), "bash"),
    "data-tokenizer": Sample((Part("data-tokenizer"),), "bash"),
    "data-preprocess": Sample((Part("data-preprocess"), Part("data-meta")), "bash"),
    "data-errors": Sample((Part("data-no-column"), Part("data-not-parquet"), Part("data-ints")), "console"),
    "data-hf": Sample((Part("data-hf"), Part("data-same")), "bash"),
    "data-nodes": Sample((Part("data-nodes"),), "bash"),
    "data-node0": Sample((Part("data-nodes", START_UP[2:] + (r"^iter ",), command=False, log="node0.log"),), "output"),
    "data-render": Sample((Part("data-render"),), "bash"),
    "data-export": Sample((Part("data-export"),), "bash"),
    "data-ids": Sample((Part("data-ids"),), "bash"),
    "diloco-run": Sample((Part("diloco-run", (r"^DiLoCo: \d", r"^iter (32|64|256)/256 ", r"^DiLoCo: final outer",
                                              r"^  between replicas")),), "bash"),
    "diloco-sparse": Sample((Part("diloco-sparse", (r"^DiLoCo: \d", r"^iter (32|64|256)/256 ", r"^DiLoCo: final outer",
                                                    r"^  between replicas")),), "bash"),
    "diloco-sparse-dry": Sample((Part("diloco-sparse-dry", (r"^DiLoCo outer payload",)),), "bash"),
    "diloco-sites": Sample((Part("diloco-sites", ()),), "bash"),
    "diloco-link-needs": Sample((Part("link-needs"),), "console"),
    "diloco-link-dry": Sample((Part("link-dry", (r"^DiLoCo link:",)),), "console"),
    "diloco-left": Sample((Part("diloco-sites", (r"^DiLoCo: (replica 2 |\d replica)",), command=False,
                                log="runs/site0.log"),), "output"),
    "diloco-unequal": Sample((Part("diloco-unequal", ()),), "bash"),
    "diloco-unequal-lines": Sample((Part("diloco-unequal", (r"^DiLoCo: (batch split|replica \d joined)",
                                                           r"^  DiLoCo replica"), command=False, log="runs/unequal0.log"),
                                    Part("diloco-unequal", (r"^DiLoCo: batch split", r"^  DiLoCo replica"),
                                         command=False, log="runs/unequal1.log")), "output"),
    "diloco-join": Sample((Part("diloco-sites", (r"^resuming from", r"^DiLoCo: (replica 2 joins|replica \d joined|healed|the)",
                                                 r"^  DiLoCo replica"), command=False, log="runs/site2.log"),), "output"),
}
