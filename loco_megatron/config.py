"""Run configuration: one dataclass per concern, validated on construction.

Field names are Megatron-LM's flag names with ``-`` replaced by ``_``; the CLI
(:mod:`loco_megatron.cli`) derives its flags and their help text from these
dataclasses, so a field's docstring *is* its ``--help``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


class ConfigError(ValueError):
    """A bad flag or config value. The message names the flag."""


ALTERNATIVES = {"lr_warmup_iters": ("lr_warmup_fraction", None), "lr_warmup_fraction": ("lr_warmup_iters", 0)}
"""Flags that replace each other: setting one on the command line resets the other (to the
given value) when it came from the config file."""


def _require(cond: bool, flag: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"--{flag.replace('_', '-')}: {msg}")


@dataclasses.dataclass
class ModelConfig:
    num_layers: int = 4
    """Number of transformer layers."""
    hidden_size: int = 128
    """Transformer hidden size."""
    num_attention_heads: int = 4
    """Number of attention heads."""
    num_query_groups: Optional[int] = None
    """Key/value head groups for grouped-query attention (None = multi-head attention)."""
    ffn_hidden_size: Optional[int] = None
    """MLP hidden size (None = 4 x hidden size, or 8/3 x for SwiGLU rounded to 64)."""
    seq_length: int = 128
    """Tokens per training sample."""
    max_position_embeddings: Optional[int] = None
    """Longest sequence the position embedding supports (None = seq length)."""
    position_embedding_type: str = "rope"
    """'rope' (LLaMA) or 'learned_absolute' (GPT-2)."""
    swiglu: bool = True
    """SwiGLU MLP (LLaMA) instead of GeLU."""
    normalization: str = "RMSNorm"
    """'RMSNorm' (LLaMA) or 'LayerNorm' (GPT-2)."""
    untie_embeddings_and_output_weights: bool = True
    """Separate input embedding and output projection (LLaMA)."""
    hidden_dropout: float = 0.0
    """Dropout on the hidden state."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    num_experts: Optional[int] = None
    """Number of MoE experts per layer (None = dense MLP)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: Optional[int] = None
    """Hidden size of each expert's MLP (None = ffn hidden size)."""
    moe_aux_loss_coeff: float = 0.01
    """Weight of the MoE load-balancing loss."""
    bf16: bool = False
    """Train in bfloat16 mixed precision (fp32 main params in the optimizer)."""
    transformer_impl: str = "local"
    """'local' (megatron-core modules, no TransformerEngine) or 'transformer_engine'."""
    use_cpu_initialization: bool = True
    """Initialise weights on CPU from one full master weight, so TP=1 and TP=2 start identical."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation: 'selective' (attention core only) or 'full' (whole layers; needs
    --recompute-method). None = keep all activations."""
    recompute_method: Optional[str] = None
    """With full recomputation: 'uniform' (checkpoint groups of --recompute-num-layers layers) or
    'block' (checkpoint the first --recompute-num-layers layers of each pipeline stage)."""
    recompute_num_layers: Optional[int] = None
    """Layers per recomputation group ('uniform') or per stage ('block'); default 1."""

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            _require(getattr(self, name) > 0, name, "must be positive")
        _require(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
                 f"{self.hidden_size} is not divisible by --num-attention-heads {self.num_attention_heads}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        _require(self.max_position_embeddings >= self.seq_length, "max_position_embeddings",
                 "must be at least --seq-length")
        _require(self.position_embedding_type in ("rope", "learned_absolute"),
                 "position_embedding_type", "must be 'rope' or 'learned_absolute'")
        _require(self.normalization in ("RMSNorm", "LayerNorm"), "normalization",
                 "must be 'RMSNorm' or 'LayerNorm'")
        _require(self.transformer_impl in ("local", "transformer_engine"), "transformer_impl",
                 "must be 'local' or 'transformer_engine'")
        if self.num_query_groups is not None:
            _require(self.num_attention_heads % self.num_query_groups == 0, "num_query_groups",
                     "must divide --num-attention-heads")
        if self.ffn_hidden_size is None:
            if self.swiglu:
                self.ffn_hidden_size = ((8 * self.hidden_size // 3 + 63) // 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_experts is not None:
            _require(self.num_experts > 0, "num_experts", "must be positive")
            _require(0 < self.moe_router_topk <= self.num_experts, "moe_router_topk",
                     f"must be in [1, --num-experts={self.num_experts}]")
        for name in ("hidden_dropout", "attention_dropout"):
            _require(0.0 <= getattr(self, name) < 1.0, name, "must be in [0, 1)")
        _require(self.recompute_granularity in (None, "selective", "full"), "recompute_granularity",
                 f"{self.recompute_granularity!r} is not 'selective' or 'full'")
        _require(self.recompute_method in (None, "uniform", "block"), "recompute_method",
                 f"{self.recompute_method!r} is not 'uniform' or 'block'")
        if self.recompute_granularity == "full":
            _require(self.recompute_method is not None, "recompute_method",
                     "is required with --recompute-granularity full ('uniform' or 'block')")
            if self.recompute_num_layers is None:
                self.recompute_num_layers = 1
            _require(self.recompute_num_layers >= 1, "recompute_num_layers", "must be >= 1")
        else:
            _require(self.recompute_method is None and self.recompute_num_layers is None, "recompute_method",
                     "and --recompute-num-layers need --recompute-granularity full")


@dataclasses.dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks per model replica."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages per model replica."""
    expert_model_parallel_size: int = 1
    """Expert-parallel ranks (MoE experts are split across them)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state and main params across data-parallel ranks (ZeRO-1)."""
    overlap_grad_reduce: bool = True
    """Launch each gradient bucket's reduce-scatter as soon as its grads are ready."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather updated params bucket by bucket during
    the next forward pass instead of synchronously after the optimizer step."""
    grad_reduce_in_bf16: bool = False
    """Keep gradient buffers and their reduce-scatter in bf16."""
    ddp_bucket_size: Optional[int] = None
    """Elements per gradient bucket (None = megatron-core's default)."""
    sequence_parallel: bool = False
    """Split layer norms, dropout and residuals along the sequence across the TP ranks
    (Megatron's sequence parallelism; needs --tensor-model-parallel-size > 1)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank (interleaved 1F1B schedule; needs PP > 1)."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per model chunk; sets --virtual-pipeline-model-parallel-size to
    num_layers / PP / this."""
    context_parallel_size: int = 1
    """Context-parallel ranks (split each sequence across ranks). Only 1: megatron-core 0.16
    implements it in TransformerEngine's attention only."""

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size"):
            _require(getattr(self, name) >= 1, name, "must be >= 1")
        if self.ddp_bucket_size is not None:
            _require(self.ddp_bucket_size > 0, "ddp_bucket_size", "must be positive")
        if self.overlap_param_gather:
            _require(self.use_distributed_optimizer, "overlap_param_gather", "needs the distributed optimizer")
        _require(not self.sequence_parallel or self.tensor_model_parallel_size > 1, "sequence_parallel",
                 "needs --tensor-model-parallel-size > 1")
        _require(self.context_parallel_size == 1, "context_parallel_size",
                 "needs TransformerEngine: megatron-core 0.16 implements context parallelism only in "
                 "TEDotProductAttention (--transformer-impl transformer_engine), which loco-megatron does not wire")
        _require(self.virtual_pipeline_model_parallel_size is None
                 or self.num_layers_per_virtual_pipeline_stage is None, "num_layers_per_virtual_pipeline_stage",
                 "give either it or --virtual-pipeline-model-parallel-size, not both")
        for name in ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"):
            if getattr(self, name) is not None:
                _require(getattr(self, name) >= 1, name, "must be >= 1")
                _require(self.pipeline_model_parallel_size > 1, name, "needs --pipeline-model-parallel-size > 1")


@dataclasses.dataclass
class DataConfig:
    data_path: Optional[str] = None
    """Megatron indexed dataset(s) (PREFIX.bin/PREFIX.idx): 'PREFIX', 'P1 P2' (weighted by
    size) or 'W1 P1 W2 P2' (a blend drawn in proportion to the weights). None = the built-in corpus."""
    tokenizer_model: Optional[str] = None
    """sentencepiece .model file (required with --data-path)."""
    split: str = "98,2,0"
    """Train/validation/test split weights of the documents."""
    micro_batch_size: int = 4
    """Samples per micro batch per data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step across all data-parallel ranks."""
    data_cache_path: Optional[str] = None
    """Where built-in corpus and dataset index caches go (None = ~/.cache/loco_megatron)."""
    vocab_size: int = 4096
    """Vocabulary of the tokenizer trained for the built-in corpus."""
    train_data_path: Optional[str] = None
    """Training data only (Megatron's form: PREFIX, 'P1 P2' or 'W1 P1 W2 P2'); with
    --valid-data-path, replaces --data-path and --split."""
    valid_data_path: Optional[str] = None
    """Validation data (same form), with --train-data-path."""

    def __post_init__(self):
        _require(self.micro_batch_size > 0, "micro_batch_size", "must be positive")
        _require(self.global_batch_size > 0, "global_batch_size", "must be positive")
        parts = self.split.split(",")
        ok = len(parts) == 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts)
        _require(ok and sum(float(p) for p in parts) > 0, "split",
                 f"'{self.split}' is not three comma-separated non-negative weights")
        if self.data_path is not None:
            _require(self.tokenizer_model is not None, "tokenizer_model", "is required with --data-path")
        if self.train_data_path is not None or self.valid_data_path is not None:
            _require(self.train_data_path is not None and self.valid_data_path is not None, "train_data_path",
                     "and --valid-data-path go together")
            _require(self.data_path is None, "data_path", "give either it or --train-data-path/--valid-data-path")
            _require(self.tokenizer_model is not None, "tokenizer_model", "is required with --train-data-path")


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of decay."""
    lr_warmup_iters: int = 0
    """Linear warmup iterations (or use --lr-warmup-fraction)."""
    lr_decay_style: str = "cosine"
    """'constant', 'linear' or 'cosine'."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the LR decays (None = --train-iters)."""
    weight_decay: float = 0.1
    """Decoupled (AdamW) weight decay."""
    clip_grad: float = 1.0
    """Gradient-norm clipping threshold (0 = off)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    lr_warmup_fraction: Optional[float] = None
    """Linear warmup as a fraction of the decay iterations (Megatron-LM's flag); replaces
    --lr-warmup-iters. A flag given on the command line overrides the other one's value
    from the config file."""

    def __post_init__(self):
        _require(self.lr > 0, "lr", "must be positive")
        _require(0 <= self.min_lr <= self.lr, "min_lr", "must be in [0, --lr]")
        _require(self.lr_warmup_iters >= 0, "lr_warmup_iters", "must be >= 0")
        _require(self.lr_decay_style in ("constant", "linear", "cosine"), "lr_decay_style",
                 "must be 'constant', 'linear' or 'cosine'")
        _require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        _require(self.clip_grad >= 0, "clip_grad", "must be >= 0")
        if self.lr_warmup_fraction is not None:
            _require(0.0 <= self.lr_warmup_fraction < 1.0, "lr_warmup_fraction", "must be in [0, 1)")
            _require(self.lr_warmup_iters == 0, "lr_warmup_fraction", "give either it or --lr-warmup-iters, not both")

    def warmup_iters(self, decay_iters: int) -> int:
        """Warmup steps: --lr-warmup-iters, or --lr-warmup-fraction of ``decay_iters`` (rounded down)."""
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * decay_iters)
        return self.lr_warmup_iters


@dataclasses.dataclass
class TrainConfig:
    train_iters: int = 200
    """Optimizer steps to run."""
    eval_interval: int = 50
    """Evaluate on the validation split every this many steps (0 = never)."""
    eval_iters: int = 4
    """Validation batches (global batches) per evaluation."""
    seed: int = 1234
    """Random seed for weights, data order and dropout."""
    distributed_timeout_minutes: int = 10
    """Timeout of collectives; a dead rank fails the run after this long."""
    stop_file: Optional[str] = None
    """When this file exists, save a checkpoint after the current step and exit 0 (the Slurm
    templates' signal handler creates it before requeueing the job)."""
    inject_nan: Optional[str] = None
    """Fault injection for tests and drills: 'ITER:RANK' makes RANK's loss (so its gradient) NaN at
    iteration ITER as the console numbers it (1 = the first step); 'A-B:RANK' for A..B, 'A-:RANK' from A on."""
    max_skipped_consecutive: int = 20
    """Abort (non-zero exit, no save) after this many consecutive steps skipped for NaN/Inf
    gradients; earlier checkpoints are kept (0 = never abort)."""

    def __post_init__(self):
        _require(self.train_iters > 0, "train_iters", "must be positive")
        _require(self.eval_interval >= 0, "eval_interval", "must be >= 0")
        _require(self.eval_iters >= 0, "eval_iters", "must be >= 0")
        _require(self.distributed_timeout_minutes > 0, "distributed_timeout_minutes", "must be positive")
        _require(self.max_skipped_consecutive >= 0, "max_skipped_consecutive", "must be >= 0")
        if self.inject_nan is not None:
            _require(self._nan_range() is not None, "inject_nan",
                     f"'{self.inject_nan}' is not ITER:RANK, FIRST-LAST:RANK or FIRST-:RANK")

    def _nan_range(self) -> Optional[tuple[int, float, int]]:
        """(first, last, rank) of --inject-nan, None when malformed."""
        its, _, rank = (self.inject_nan or "").partition(":")
        first, dash, last = its.partition("-")
        if not (first.isdigit() and rank.isdigit() and (last.isdigit() or not last)):
            return None
        end = int(last) if last else float("inf") if dash else int(first)
        return int(first), end, int(rank)

    def nan_poisoned(self, iteration: int, rank: int) -> bool:
        """Whether ``rank``'s loss is made NaN at ``iteration`` (numbered as printed, from 1)."""
        if self.inject_nan is None:
            return False
        first, last, nan_rank = self._nan_range()
        return rank == nan_rank and first <= iteration <= last


@dataclasses.dataclass
class LoCoConfig:
    loco_bits: int = 0
    """Bits per transmitted gradient code: 0 = off (megatron-core's own reduce-scatter), 2, 4 or 8."""
    loco_beta: float = 0.8
    """Moving-average factor of the compression error: e <- beta*e + (1-beta)*(h - Q(h))."""
    loco_block_size: int = 256
    """Elements per quantisation block (one fp32 scale each); a positive multiple of 8."""
    loco_error_bits: int = 8
    """Storage of the error buffer: 8 (int8 + per-block scale), 16 (bf16) or 32 (fp32)."""
    loco_reset_interval: int = 1024
    """Zero the error every this many optimizer steps (0 = never)."""
    loco_warmup_iters: int = 0
    """Sync the first N iterations at full precision (megatron-core's reduce-scatter)."""
    loco_no_error_feedback: bool = False
    """Ablation: quantise the raw gradient with no compensation."""
    loco_hierarchical: Optional[bool] = None
    """Two-hop LoCo: reduce inside each node at --loco-intra-node-bits, then across nodes at
    --loco-bits, each hop with its own error state (default: on when a data-parallel group
    spans more than one node and holds several ranks per node)."""
    loco_intra_node_bits: int = 8
    """Bits of the intra-node hop of two-hop LoCo: 2, 4, 8 (compensated) or 16 (bf16, uncompressed)."""
    loco_ranks_per_node: Optional[int] = None
    """Ranks per node for two-hop LoCo (default: torchrun's LOCAL_WORLD_SIZE)."""
    loco_kernels: str = "auto"
    """Compress/decompress implementation: auto (fused Triton kernels on CUDA when triton is
    installed and the shape is supported; the fused C++ kernels on CPU when they build;
    else torch), torch (the reference), triton, or cpu (falls back to torch, with one
    line, when no C++ compiler is present)."""
    param_gather_bits: int = 0
    """Distributed optimizer's parameter all-gather: 0 = megatron-core's own (params at their
    dtype), 8 or 4 = block-wise quantised differences against the parameters every rank
    agrees on (--loco-block-size blocks); needs --use-distributed-optimizer."""

    def __post_init__(self):
        _require(self.loco_intra_node_bits in (2, 4, 8, 16), "loco_intra_node_bits",
                 f"{self.loco_intra_node_bits} is not one of 2, 4, 8, 16")
        _require(self.loco_ranks_per_node is None or self.loco_ranks_per_node >= 1, "loco_ranks_per_node",
                 "must be >= 1")
        _require(self.loco_kernels in ("auto", "torch", "triton", "cpu"), "loco_kernels",
                 f"{self.loco_kernels!r} is not one of auto, torch, triton, cpu")
        _require(self.loco_bits in (0, 2, 4, 8), "loco_bits", f"{self.loco_bits} is not one of 0, 2, 4, 8")
        _require(0.0 <= self.loco_beta < 1.0, "loco_beta", f"{self.loco_beta} is not in [0, 1)")
        _require(self.loco_block_size > 0 and self.loco_block_size % 8 == 0, "loco_block_size",
                 f"{self.loco_block_size} is not a positive multiple of 8")
        _require(self.loco_error_bits in (8, 16, 32), "loco_error_bits",
                 f"{self.loco_error_bits} is not one of 8, 16, 32")
        _require(self.loco_reset_interval >= 0, "loco_reset_interval", "must be >= 0")
        _require(self.loco_warmup_iters >= 0, "loco_warmup_iters", "must be >= 0")
        _require(self.param_gather_bits in (0, 4, 8), "param_gather_bits",
                 f"{self.param_gather_bits} is not one of 0, 8, 4")

    @property
    def enabled(self) -> bool:
        return self.loco_bits > 0


@dataclasses.dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to write checkpoints to."""
    save_interval: int = 0
    """Save every this many steps (0 = only at the end when --save is set)."""
    load: Optional[str] = None
    """Directory to resume from (its latest complete checkpoint)."""

    def __post_init__(self):
        _require(self.save_interval >= 0, "save_interval", "must be >= 0")


@dataclasses.dataclass
class LoggingConfig:
    log_interval: int = 10
    """Print and record metrics every this many steps."""
    metrics_jsonl: Optional[str] = None
    """Append one JSON object per logged iteration to this file."""
    wandb_project: Optional[str] = None
    """Log to this wandb project (offline without an API key or with WANDB_MODE=offline)."""
    wandb_exp_name: Optional[str] = None
    """wandb run name."""
    wandb_save_dir: Optional[str] = None
    """Directory for wandb's local files."""
    wandb_group: Optional[str] = None
    """wandb group, to compare runs side by side."""
    wandb_tags: Optional[str] = None
    """Comma-separated wandb tags."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one device for train/mfu (default: the dense bf16 peak of known NVIDIA
    GPUs; no MFU on CPU unless given)."""
    tensorboard_dir: Optional[str] = None
    """Also write every logged scalar to TensorBoard event files in this directory."""
    profile: bool = False
    """Record a torch.profiler trace (Chrome/Perfetto JSON) of steps --profile-step-start
    to --profile-step-end on --profile-ranks, with named ranges (NVTX ranges too on CUDA)."""
    profile_step_start: int = 3
    """First profiled iteration (1-based)."""
    profile_step_end: int = 4
    """Last profiled iteration."""
    profile_ranks: str = "0"
    """Comma-separated global ranks to profile."""
    profile_dir: str = "profile"
    """Where traces go: PROFILE_DIR/trace_rank{R}.json."""

    def __post_init__(self):
        _require(self.log_interval > 0, "log_interval", "must be positive")
        if self.peak_tflops is not None:
            _require(self.peak_tflops > 0, "peak_tflops", "must be positive")
        _require(1 <= self.profile_step_start <= self.profile_step_end, "profile_step_end",
                 "must be >= --profile-step-start >= 1")
        ranks = self.profile_ranks.split(",")
        _require(all(r.strip().isdigit() for r in ranks), "profile_ranks",
                 f"{self.profile_ranks!r} is not a comma-separated list of ranks")

    def profiled_ranks(self) -> set[int]:
        return {int(r) for r in self.profile_ranks.split(",")}


@dataclasses.dataclass
class Config:
    """The whole run. Cross-field checks that do not need the world size live here."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    loco: LoCoConfig = dataclasses.field(default_factory=LoCoConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def __post_init__(self):
        m, p = self.model, self.parallel
        heads = m.num_attention_heads
        _require(heads % p.tensor_model_parallel_size == 0, "num_attention_heads",
                 f"{heads} is not divisible by --tensor-model-parallel-size {p.tensor_model_parallel_size}")
        groups = m.num_query_groups or heads
        _require(groups % p.tensor_model_parallel_size == 0, "num_query_groups",
                 f"{groups} is not divisible by --tensor-model-parallel-size {p.tensor_model_parallel_size}")
        _require(m.num_layers % p.pipeline_model_parallel_size == 0, "num_layers",
                 f"{m.num_layers} is not divisible by --pipeline-model-parallel-size "
                 f"{p.pipeline_model_parallel_size}")
        if p.expert_model_parallel_size > 1:
            _require(m.num_experts is not None, "expert_model_parallel_size", "needs --num-experts")
        if m.num_experts is not None:
            _require(m.num_experts % p.expert_model_parallel_size == 0, "num_experts",
                     f"{m.num_experts} is not divisible by --expert-model-parallel-size "
                     f"{p.expert_model_parallel_size}")
        if p.grad_reduce_in_bf16:
            _require(m.bf16, "grad_reduce_in_bf16", "needs --bf16")
        if self.loco.param_gather_bits:
            _require(p.use_distributed_optimizer, "param_gather_bits", "needs --use-distributed-optimizer")
        decay = self.optimizer.lr_decay_iters or self.train.train_iters
        _require(self.optimizer.warmup_iters(decay) < decay, "lr_warmup_iters",
                 f"{self.optimizer.lr_warmup_iters} must be less than the decay iterations ({decay}); "
                 "--lr-warmup-fraction scales with the run")
        if p.num_layers_per_virtual_pipeline_stage is not None:
            per_stage = m.num_layers // p.pipeline_model_parallel_size
            _require(per_stage % p.num_layers_per_virtual_pipeline_stage == 0,
                     "num_layers_per_virtual_pipeline_stage",
                     f"{p.num_layers_per_virtual_pipeline_stage} does not divide the {per_stage} layers per stage")
            p.virtual_pipeline_model_parallel_size = per_stage // p.num_layers_per_virtual_pipeline_stage
            p.num_layers_per_virtual_pipeline_stage = None
        if p.virtual_pipeline_model_parallel_size is not None:
            vp = p.virtual_pipeline_model_parallel_size
            _require(m.num_layers % (p.pipeline_model_parallel_size * vp) == 0,
                     "virtual_pipeline_model_parallel_size",
                     f"--num-layers {m.num_layers} is not divisible by PP x VP = "
                     f"{p.pipeline_model_parallel_size} x {vp}")
        if m.recompute_num_layers is not None:
            per_chunk = m.num_layers // p.pipeline_model_parallel_size // (p.virtual_pipeline_model_parallel_size or 1)
            _require(m.recompute_num_layers <= per_chunk, "recompute_num_layers",
                     f"{m.recompute_num_layers} exceeds the {per_chunk} layers per model chunk")

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for ``world_size`` ranks; raises ConfigError when the layout does not fit."""
        p = self.parallel
        mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        if world_size % mp != 0:
            raise ConfigError(
                f"--tensor-model-parallel-size x --pipeline-model-parallel-size = {mp} "
                f"does not divide the world size {world_size}")
        dp = world_size // mp
        _require(dp % p.expert_model_parallel_size == 0 or p.expert_model_parallel_size == 1,
                 "expert_model_parallel_size",
                 f"{p.expert_model_parallel_size} does not divide the data-parallel size {dp}")
        d = self.data
        _require(d.global_batch_size % (d.micro_batch_size * dp) == 0, "global_batch_size",
                 f"{d.global_batch_size} is not divisible by --micro-batch-size x data-parallel size "
                 f"= {d.micro_batch_size} x {dp}")
        if p.virtual_pipeline_model_parallel_size is not None:
            micro = d.global_batch_size // (d.micro_batch_size * dp)
            # megatron's interleaved schedule runs micro batches in groups of PP per chunk.
            _require(micro % p.pipeline_model_parallel_size == 0, "global_batch_size",
                     f"{micro} micro batches per step is not a multiple of --pipeline-model-parallel-size "
                     f"{p.pipeline_model_parallel_size} (needed by the interleaved schedule)")
        return dp

    def to_flat_dict(self) -> dict:
        """Every option as {flag_name: value}, e.g. for wandb.config and checkpoints."""
        out = {}
        for f in dataclasses.fields(self):
            out.update(dataclasses.asdict(getattr(self, f.name)))
        return out
