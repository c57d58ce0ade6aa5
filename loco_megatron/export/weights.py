"""Megatron-core GPTModel weights (one TP=PP=EP=1 model) -> Hugging Face LLaMA / Mixtral names.

Pure tensor code: no torch.distributed, no megatron import.
"""

from __future__ import annotations

import torch

from loco_megatron.config import Config, ConfigError


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Megatron's fused ``linear_qkv.weight`` -> (q, k, v) weights in LLaMA's layout.

    ``qkv``: ``[groups * (heads/groups + 2) * head_dim, hidden]``, rows ordered per query
    group ``g`` as ``[q heads of g (heads/groups x head_dim), k_g (head_dim), v_g (head_dim)]``.
    Returns q ``[heads*head_dim, hidden]``, k and v ``[groups*head_dim, hidden]``, with
    heads in order (query head ``h`` belongs to group ``h // (heads/groups)`` in both).
    """
    per_group = heads // groups
    hidden = qkv.shape[1]
    want = groups * (per_group + 2) * head_dim
    if qkv.shape[0] != want:
        raise ConfigError(f"linear_qkv has {qkv.shape[0]} rows, expected {want} from the config")
    grouped = qkv.reshape(groups, per_group + 2, head_dim, hidden)
    q = grouped[:, :per_group].reshape(heads * head_dim, hidden)
    k = grouped[:, per_group].reshape(groups * head_dim, hidden)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, hidden)
    return q.contiguous(), k.contiguous(), v.contiguous()


def split_swiglu(fc1: torch.Tensor):
    """SwiGLU ``linear_fc1.weight`` ``[2F, H]`` -> (gate, up), each ``[F, H]``: megatron
    computes ``silu(x W[:F]^T) * (x W[F:]^T)``, LLaMA ``silu(gate(x)) * up(x)``."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def to_hf(state: dict, config: Config, vocab_size: int) -> dict:
    """HF tensors (names of LlamaForCausalLM, or MixtralForCausalLM with ``num_experts``).

    ``state``: the GPTModel's ``state_dict()`` (global tensors, TP=1); ``vocab_size``:
    the tokenizer's size: the embedding and output rows beyond it (megatron's padding
    for aligned TP slices) are dropped. Every megatron tensor must be used exactly once;
    an unknown or missing one raises ConfigError naming it.
    """
    m = config.model
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    head_dim = m.hidden_size // heads
    moe = m.num_experts is not None
    state = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    unused = set(state)

    def take(key: str) -> torch.Tensor:
        if key not in state:
            raise ConfigError(f"the checkpoint has no tensor {key} (a model of another shape or implementation?)")
        unused.discard(key)
        return state[key]

    def unpad(t: torch.Tensor, name: str) -> torch.Tensor:
        if t.shape[0] < vocab_size:
            raise ConfigError(f"{name} has {t.shape[0]} rows, fewer than the tokenizer's {vocab_size} pieces "
                              "(wrong --tokenizer-model?)")
        return t[:vocab_size].contiguous()

    out = {"model.embed_tokens.weight": unpad(take("embedding.word_embeddings.weight"),
                                              "embedding.word_embeddings.weight"),
           "model.norm.weight": take("decoder.final_layernorm.weight")}
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = unpad(take("output_layer.weight"), "output_layer.weight")
    for i in range(m.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        # The local spec keeps separate norms; TransformerEngine's fuses them into the linears.
        norm_in = src + ("input_layernorm.weight" if src + "input_layernorm.weight" in state
                         else "self_attention.linear_qkv.layer_norm_weight")
        norm_mlp = src + ("pre_mlp_layernorm.weight" if src + "pre_mlp_layernorm.weight" in state
                          else "mlp.linear_fc1.layer_norm_weight")
        out[dst + "input_layernorm.weight"] = take(norm_in)
        out[dst + "post_attention_layernorm.weight"] = take(norm_mlp)
        q, k, v = split_qkv(take(src + "self_attention.linear_qkv.weight"), heads, groups, head_dim)
        out[dst + "self_attn.q_proj.weight"], out[dst + "self_attn.k_proj.weight"] = q, k
        out[dst + "self_attn.v_proj.weight"] = v
        out[dst + "self_attn.o_proj.weight"] = take(src + "self_attention.linear_proj.weight")
        if not moe:
            gate, up = split_swiglu(take(src + "mlp.linear_fc1.weight"))
            out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
            out[dst + "mlp.down_proj.weight"] = take(src + "mlp.linear_fc2.weight")
            continue
        # Mixtral's canonical (and transformers 4.x/5.x loadable) per-expert layout:
        # w1 = gate, w3 = up, w2 = down.
        out[dst + "block_sparse_moe.gate.weight"] = take(src + "mlp.router.weight")
        for e in range(m.num_experts):
            ex = f"{src}mlp.experts.local_experts.{e}."
            gate, up = split_swiglu(take(ex + "linear_fc1.weight"))
            hf = f"{dst}block_sparse_moe.experts.{e}."
            out[hf + "w1.weight"], out[hf + "w3.weight"] = gate, up
            out[hf + "w2.weight"] = take(ex + "linear_fc2.weight")
    if unused:
        raise ConfigError(f"the checkpoint tensor {sorted(unused)[0]} has no Hugging Face counterpart "
                          f"({len(unused)} such tensors)")
    return out
