"""The model dimensions a checkpoint records, and how a resume is checked against them.

Every setting that changes the shape (or the set) of the model's tensors is recorded, so a
resume with another one is refused in one line before the model is built, naming the
setting, instead of failing inside megatron's or DCP's load ("size mismatch for
...linear_qkv.weight", "CheckpointException ranks: dict_keys([0, 1])"). Checkpoints
written before a dimension was recorded hold a shorter list: the dimensions they have
are compared.
"""

from __future__ import annotations

MODEL_DIMS = ("num layers", "hidden size", "padded vocabulary", "num experts", "ffn hidden size",
              "num attention heads", "num query groups", "moe ffn hidden size", "swiglu", "normalization",
              "untie embeddings and output weights", "position embedding type", "max position embeddings")
"""The names of :func:`model_shape`'s entries, in order (the first four were the only ones
recorded by older checkpoints)."""


def model_shape(m, vocab: int) -> list:
    """The shape-determining settings of ``m`` (a :class:`~loco_megatron.config.ModelConfig`)
    with the padded vocabulary ``vocab``, as plain values in :data:`MODEL_DIMS` order."""
    return [m.num_layers, m.hidden_size, vocab, m.num_experts, m.ffn_hidden_size, m.num_attention_heads,
            m.num_query_groups or m.num_attention_heads,
            (m.moe_ffn_hidden_size or m.ffn_hidden_size) if m.num_experts else None,
            m.swiglu, m.normalization, m.untie_embeddings_and_output_weights, m.position_embedding_type,
            (m.max_position_embeddings or m.seq_length) if m.position_embedding_type == "learned_absolute" else None]


def shape_difference(saved, now) -> str:
    """"" when the dimensions ``saved`` recorded equal ``now``'s; else what differs, e.g.
    ``ffn hidden size 384 saved, 256 now``."""
    if not isinstance(saved, (list, tuple)) or not isinstance(now, (list, tuple)):
        return "" if saved == now else f"model shape {saved} saved, {now} now"
    return "; ".join(f"{name} {a} saved, {b} now" for name, a, b in zip(MODEL_DIMS, saved, now) if a != b)
