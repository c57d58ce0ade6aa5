"""LoCo settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config.base import check_choices, choice, choices_of, require

LOCO_DEFAULT_OPTIONS: dict[int, dict[str, str]] = {
    2: {"quantizer": "uniform", "scale": "mse", "rotation": "hadamard", "rounding": "nearest"},
}
"""Quantiser options a run gets per --loco-bits when their flags are not given (absent:
symmetric, absmax, none, nearest - the original scheme). Chosen by the quality study
(README, "2-bit quantiser options")."""


@dataclasses.dataclass
class LoCoConfig:
    loco_bits: int = choice(0, (0, 2, 4, 8))
    """Bits per transmitted gradient code: 0 = off (megatron-core's own reduce-scatter), 2, 4 or 8."""
    loco_beta: float = 0.8
    """Moving-average factor of the compression error: e <- beta*e + (1-beta)*(h - Q(h))."""
    loco_block_size: int = 256
    """Elements per quantisation block (one fp32 scale each); a positive multiple of 8."""
    loco_error_bits: int = choice(8, (8, 16, 32))
    """Storage of the error buffer: 8 (int8 + per-block scale), 16 (bf16) or 32 (fp32)."""
    loco_reset_interval: int = 1024
    """Zero the error every this many optimizer steps (0 = never)."""
    loco_warmup_iters: int = 0
    """Sync the first N iterations at full precision (megatron-core's reduce-scatter)."""
    loco_error_feedback: bool = True
    """Carry the compression error into the next step (LoCo). --no-loco-error-feedback is the
    ablation: quantise the raw gradient with no compensation (replaces the deprecated
    --loco-no-error-feedback)."""
    loco_hierarchical: Optional[bool] = None
    """Two-hop LoCo: reduce inside each node at --loco-intra-node-bits, then across nodes at
    --loco-bits, each hop with its own error state (default: on when a data-parallel group
    spans more than one node and holds several ranks per node)."""
    loco_intra_node_bits: int = choice(8, (2, 4, 8, 16))
    """Bits of the intra-node hop of two-hop LoCo: 2, 4, 8 (compensated) or 16 (bf16, uncompressed)."""
    loco_ranks_per_node: Optional[int] = None
    """Ranks per node for two-hop LoCo (default: torchrun's LOCAL_WORLD_SIZE)."""
    loco_kernels: str = choice("auto", ("auto", "torch", "triton", "cpu"))
    """Compress/decompress implementation (also of the --param-gather-bits encode and
    apply): auto (fused Triton kernels on CUDA when triton is
    installed and the shape and quantiser options are supported; the fused C++ kernels,
    which implement every quantiser option, on CPU when they build; else torch, and the
    start-up line says why), torch (the reference), triton, or cpu (falls back to torch,
    with one line, when no C++ compiler is present). See docs/kernels.md."""
    loco_quantizer: Optional[str] = choice(None, ("symmetric", "uniform"))
    """Gradient code grid: symmetric (codes -qmax..qmax, levels k*s; 2 bits use three of the
    four codes) or uniform (all 2**bits codes, levels (k+0.5)*s). Default: per --loco-bits
    (LOCO_DEFAULT_OPTIONS)."""
    loco_scale: Optional[str] = choice(None, ("absmax", "mse"))
    """Per-block scale: absmax, or mse (the clip ratio of 1.0 ... 0.5 with the least squared
    error, per block, searched in units of the absmax scale; the clipped part is carried
    by the error feedback). Default: per --loco-bits."""
    loco_rotation: Optional[str] = choice(None, ("none", "hadamard"))
    """none, or hadamard: block-wise randomized Walsh-Hadamard rotation before quantising
    (signs from --loco-quant-seed, shared by every rank; needs a power-of-two
    --loco-block-size). Default: per --loco-bits."""
    loco_rounding: Optional[str] = choice(None, ("nearest", "stochastic"))
    """nearest, or stochastic (unbiased; random bits hashed from the seed, bucket, rank and
    step, so a resumed run is bit-exact). Default: per --loco-bits."""
    loco_quant_seed: int = 0
    """Seed of the Hadamard signs and of stochastic rounding (the same on every rank)."""
    param_gather_bits: int = choice(0, (0, 8, 4, 2))
    """Distributed optimizer's parameter all-gather: 0 = megatron-core's own (params at their
    dtype), 8, 4 or 2 = block-wise quantised differences against the parameters every rank
    agrees on (--loco-block-size blocks, quantiser options per :meth:`param_gather_options`);
    needs --use-distributed-optimizer."""

    def __post_init__(self):
        for name in ("quantizer", "scale", "rotation", "rounding"):
            if getattr(self, f"loco_{name}") is None:  # resolved here, so the metrics' config records it
                setattr(self, f"loco_{name}", LOCO_DEFAULT_OPTIONS.get(self.loco_bits, {}).get(
                    name, choices_of(LoCoConfig, f"loco_{name}")[0]))
        check_choices(self)
        bs = self.loco_block_size
        require(self.loco_rotation == "none" or (bs > 0 and bs & (bs - 1) == 0), "loco_rotation",
                f"hadamard (the {self.loco_bits}-bit default unless --loco-rotation none is given) needs a "
                f"power-of-two --loco-block-size, got {bs}")
        require(self.loco_ranks_per_node is None or self.loco_ranks_per_node >= 1, "loco_ranks_per_node",
                 "must be >= 1")
        require(0.0 <= self.loco_beta < 1.0, "loco_beta", f"{self.loco_beta} is not in [0, 1)")
        require(self.loco_block_size > 0 and self.loco_block_size % 8 == 0, "loco_block_size",
                 f"{self.loco_block_size} is not a positive multiple of 8")
        require(self.loco_reset_interval >= 0, "loco_reset_interval", "must be >= 0")
        require(self.loco_warmup_iters >= 0, "loco_warmup_iters", "must be >= 0")
        require(self.param_gather_options()["rotation"] == "none" or (bs > 0 and bs & (bs - 1) == 0),
                "param_gather_bits", f"{self.param_gather_bits} quantises with the hadamard rotation, which needs "
                f"a power-of-two --loco-block-size, got {bs} (or give --loco-bits {self.param_gather_bits} "
                f"--loco-rotation none)")

    def param_gather_options(self) -> dict[str, str]:
        """Quantiser options of the compressed parameter gather: :meth:`options_for`
        ``--param-gather-bits``."""
        return self.options_for(self.param_gather_bits)

    def options_for(self, bits: int) -> dict[str, str]:
        """Quantiser options (quantizer, scale, rotation, rounding; seed --loco-quant-seed)
        of another quantised exchange at ``bits`` (the parameter gather, DiLoCo's outer
        gradients): the gradients' resolved --loco-quantizer/-scale/-rotation/-rounding when
        --loco-bits equals ``bits``, else the defaults of that width (LOCO_DEFAULT_OPTIONS:
        2 bits uniform/mse/hadamard/nearest; 8 and 4 bits the original
        symmetric/absmax/none/nearest)."""
        if self.loco_bits == bits:
            return {n: getattr(self, f"loco_{n}") for n in ("quantizer", "scale", "rotation", "rounding")}
        base = {"quantizer": "symmetric", "scale": "absmax", "rotation": "none", "rounding": "nearest"}
        return {**base, **LOCO_DEFAULT_OPTIONS.get(bits, {})}

    @property
    def enabled(self) -> bool:
        return self.loco_bits > 0
