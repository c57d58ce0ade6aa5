"""DiLoCo's outer state in bytes per rank (for ``--dry-run`` and the memory estimate)."""

from __future__ import annotations

from loco_megatron.config import Config


def outer_memory_bytes(config: Config, params_per_rank: float) -> float:
    """Bytes the outer step holds on a rank whose distributed-optimizer shard has
    ``params_per_rank`` main-parameter elements: the agreed parameters (4 B) and the
    momentum (4 B, without --diloco-outer-momentum 0) per element, the two error buffers of
    a compressed exchange with error feedback (int8 + one fp32 scale per block: the rank's
    own outer gradient, and the 1/R of it whose mean the rank re-quantises; SparseLoCo's
    one fp32 buffer, 4 B) and the largest fragment's outer gradient in flight (4 B per
    element / F). Eager updates hold every fragment's exchange in flight (4 B) and the
    replica's eager part (parameters and momentum) and sent outer gradient (4 + 4 + 4 B).
    0 without DiLoCo."""
    d = config.diloco
    if not d.enabled:
        return 0.0
    momentum = 4.0 if d.diloco_outer_momentum else 0.0
    per = 4.0 + momentum + 4.0 / d.diloco_fragments
    if d.diloco_eager:
        per += 4.0 - 4.0 / d.diloco_fragments + 4.0 + momentum + 4.0
    if d.sparse_outer:  # SparseLoCo's fp32 error buffer
        per += 4.0 if d.diloco_outer_error_feedback else 0.0
    elif d.diloco_outer_bits and d.diloco_outer_error_feedback:
        per += (1.0 + 4.0 / config.loco.loco_block_size) * (1.0 + 1.0 / d.diloco_replicas)
    return per * params_per_rank
