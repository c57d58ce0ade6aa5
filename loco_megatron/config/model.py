"""Model shape settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config.base import check_choices, choice, require


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
    position_embedding_type: str = choice("rope", ("rope", "learned_absolute"))
    """'rope' (LLaMA) or 'learned_absolute' (GPT-2)."""
    rotary_base: int = 10000
    """RoPE base period theta (LLaMA-2 10000, LLaMA-3 500000, Mixtral 1000000)."""
    use_rope_scaling: bool = False
    """LLaMA-3.1 RoPE frequency scaling (megatron-core's fixed low/high frequency factors 1 and 4
    over an original context of 8192 tokens)."""
    rope_scaling_factor: float = 8.0
    """Divisor of the low RoPE frequencies with --use-rope-scaling (LLaMA-3.1: 8)."""
    norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm (megatron-core's layernorm_epsilon; LLaMA and Mixtral: 1e-5)."""
    swiglu: bool = True
    """SwiGLU MLP (LLaMA) instead of GeLU."""
    normalization: str = choice("RMSNorm", ("RMSNorm", "LayerNorm"))
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
    transformer_impl: str = choice("local", ("local", "transformer_engine"))
    """'local' (megatron-core modules, no TransformerEngine) or 'transformer_engine'."""
    use_cpu_initialization: bool = True
    """Initialise weights on CPU from one full master weight, so TP=1 and TP=2 start identical."""
    recompute_granularity: Optional[str] = choice(None, ("selective", "full"))
    """Activation recomputation: 'selective' (attention core only) or 'full' (whole layers; needs
    --recompute-method). None = keep all activations."""
    recompute_method: Optional[str] = choice(None, ("uniform", "block"))
    """With full recomputation: 'uniform' (checkpoint groups of --recompute-num-layers layers) or
    'block' (checkpoint the first --recompute-num-layers layers of each pipeline stage)."""
    recompute_num_layers: Optional[int] = None
    """Layers per recomputation group ('uniform') or per stage ('block'); default 1."""

    def __post_init__(self):
        check_choices(self)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            require(getattr(self, name) > 0, name, "must be positive")
        require(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
                 f"{self.hidden_size} is not divisible by --num-attention-heads {self.num_attention_heads}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        require(self.max_position_embeddings >= self.seq_length, "max_position_embeddings",
                 "must be at least --seq-length")
        require(self.rotary_base > 0, "rotary_base", "must be positive")
        require(self.norm_epsilon > 0, "norm_epsilon", "must be positive")
        require(self.rope_scaling_factor >= 1.0, "rope_scaling_factor", "must be >= 1")
        if self.use_rope_scaling:
            require(self.position_embedding_type == "rope", "use_rope_scaling", "needs --position-embedding-type rope")
        if self.num_query_groups is not None:
            require(self.num_attention_heads % self.num_query_groups == 0, "num_query_groups",
                     "must divide --num-attention-heads")
        if self.ffn_hidden_size is None:
            if self.swiglu:
                self.ffn_hidden_size = ((8 * self.hidden_size // 3 + 63) // 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_experts is not None:
            require(self.num_experts > 0, "num_experts", "must be positive")
            require(0 < self.moe_router_topk <= self.num_experts, "moe_router_topk",
                     f"must be in [1, --num-experts={self.num_experts}]")
        for name in ("hidden_dropout", "attention_dropout"):
            require(0.0 <= getattr(self, name) < 1.0, name, "must be in [0, 1)")
        if self.recompute_granularity == "full":
            require(self.recompute_method is not None, "recompute_method",
                     "is required with --recompute-granularity full ('uniform' or 'block')")
            if self.recompute_num_layers is None:
                self.recompute_num_layers = 1
            require(self.recompute_num_layers >= 1, "recompute_num_layers", "must be >= 1")
        else:
            require(self.recompute_method is None and self.recompute_num_layers is None, "recompute_method",
                     "and --recompute-num-layers need --recompute-granularity full")
