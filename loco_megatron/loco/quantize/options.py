"""The quantiser's options (``--loco-quantizer/-scale/-rotation/-rounding``,
``--loco-quant-seed``) as one frozen value, carried from the config to every compressor,
collective and kernel of the gradient and parameter sync (see :mod:`loco_megatron.loco.quantize`
for what each option does)."""

from __future__ import annotations

import dataclasses

SUPPORTED_BITS = (2, 4, 8)
QUANTIZERS = ("symmetric", "uniform")
SCALES = ("absmax", "mse")
ROTATIONS = ("none", "hadamard")
ROUNDINGS = ("nearest", "stochastic")


@dataclasses.dataclass(frozen=True)
class QuantOptions:
    """Quantiser options (see :mod:`loco_megatron.loco.quantize`); the defaults are today's scheme.

    ``seed`` fixes the Hadamard signs (shared by every rank) and is the base of the
    stochastic-rounding keys."""

    quantizer: str = "symmetric"
    scale: str = "absmax"
    rotation: str = "none"
    rounding: str = "nearest"
    seed: int = 0

    def __post_init__(self):
        for name, allowed in (("quantizer", QUANTIZERS), ("scale", SCALES), ("rotation", ROTATIONS),
                              ("rounding", ROUNDINGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    def non_default(self) -> list[str]:
        """Flags of the options that differ from today's scheme, e.g. ``['--loco-quantizer uniform']``."""
        base = QuantOptions()
        return [f"--loco-{n} {getattr(self, n)}" for n in ("quantizer", "scale", "rotation", "rounding")
                if getattr(self, n) != getattr(base, n)]


DEFAULT_OPTIONS = QuantOptions()
