"""Which run configs Hugging Face's LLaMA / Mixtral classes can express, and their config.json."""

from __future__ import annotations

from loco_megatron.config import Config, ConfigError


# TransformerConfig fields (megatron's names) that LlamaForCausalLM / MixtralForCausalLM
# cannot express, with the value they must have. loco-megatron sets most of them
# implicitly (e.g. add_bias_linear = not swiglu); checking the built TransformerConfig
# catches an option added later that the flag checks below do not know about.
_REQUIRED_TRANSFORMER = {
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "rotary_interleaved": False,
    "gated_linear_unit": True,
    "normalization": "RMSNorm",
    "moe_router_pre_softmax": False,  # Mixtral: softmax over all experts, top-k, renormalise
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False,
    "moe_shared_expert_intermediate_size": None,
    "moe_layer_freq": 1,
    "moe_router_num_groups": None,
}


def check_exportable(config: Config, tconf=None) -> None:
    """Raise ConfigError naming the first option LLaMA/Mixtral cannot express.

    ``tconf`` is the megatron TransformerConfig built from ``config`` (optional: the
    flag checks need no megatron import).
    """
    m = config.model
    if m.position_embedding_type != "rope":
        _unsupported(f"--position-embedding-type {m.position_embedding_type}", "LLaMA/Mixtral use RoPE")
    if m.normalization != "RMSNorm":
        _unsupported(f"--normalization {m.normalization}", "LLaMA/Mixtral use RMSNorm")
    if not m.swiglu:
        _unsupported("--no-swiglu (GeLU MLP with biases)", "LLaMA/Mixtral use a bias-free SwiGLU MLP")
    if tconf is None:
        return
    for name, want in _REQUIRED_TRANSFORMER.items():
        if name.startswith("moe_") and tconf.num_moe_experts is None:
            continue  # dense: the MoE fields are unused
        have = getattr(tconf, name, want)  # a field this megatron-core lacks cannot be set
        if have != want:
            _unsupported(f"megatron TransformerConfig.{name}={have!r}", f"needs {want!r}")


def _unsupported(option: str, why: str) -> None:
    raise ConfigError(f"{option}: cannot be exported to Hugging Face LlamaForCausalLM/MixtralForCausalLM ({why})")


def rope_parameters(config: Config) -> dict:
    """Hugging Face's RoPE description of the run's RoPE: theta = --rotary-base and, with
    --use-rope-scaling, the LLaMA-3.1 ('llama3') frequency scaling with --rope-scaling-factor
    and the low/high frequency factors and original context that megatron-core applies
    (the defaults of its ``RotaryEmbedding._apply_scaling``, which GPTModel does not pass)."""
    import inspect

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    m = config.model
    out = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.use_rope_scaling:
        fixed = inspect.signature(RotaryEmbedding._apply_scaling).parameters
        out.update(rope_type="llama3", factor=float(m.rope_scaling_factor),
                   low_freq_factor=float(fixed["low_freq_factor"].default),
                   high_freq_factor=float(fixed["high_freq_factor"].default),
                   original_max_position_embeddings=int(fixed["original_max_position_embeddings"].default))
    return out


def hf_config(config: Config, vocab_size: int, dtype: str, special_ids: dict) -> dict:
    """config.json for ``LlamaForCausalLM`` (dense) or ``MixtralForCausalLM`` (MoE).

    ``vocab_size``: the tokenizer's size (the exported embedding has no padding rows);
    ``dtype``: 'float32' or 'bfloat16', the dtype of the saved weights; ``special_ids``:
    ``bos_token_id``/``eos_token_id``/``pad_token_id`` of the run's tokenizer (see
    :func:`loco_megatron.export.tokenizer.special_token_ids`), not sentencepiece's defaults:
    ``generate()`` stops at ``eos_token_id``.
    """
    m = config.model
    heads = m.num_attention_heads
    rope = rope_parameters(config)
    out = {
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": m.num_query_groups or heads,
        "head_dim": m.hidden_size // heads,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_epsilon,
        # transformers 4.x reads rope_theta + rope_scaling, 5.x rope_parameters (rope_scaling,
        # when set, wins there too: both carry the same values).
        "rope_theta": rope["rope_theta"],
        "rope_scaling": rope if m.use_rope_scaling else None,
        "rope_parameters": rope,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "attention_dropout": 0.0,
        "initializer_range": m.init_method_std,
        **special_ids,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if m.num_experts is None:
        out.update(architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=m.ffn_hidden_size,
                   attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        out.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                   intermediate_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
                   num_local_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                   router_aux_loss_coef=m.moe_aux_loss_coeff, output_router_logits=False,
                   router_jitter_noise=0.0, sliding_window=None)
    return out
