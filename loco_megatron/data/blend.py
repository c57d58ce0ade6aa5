"""Megatron's data-path forms: ``PREFIX``, ``P1 P2 ...`` (weighted by size) or
``W1 P1 W2 P2 ...``, for ``--data-path`` (split into train/valid/test by ``--split``) or
``--train-data-path`` / ``--valid-data-path`` (one blend per split). The blending itself
is megatron-core's ``BlendedDataset`` (through its dataset builder)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config import ConfigError

BlendSpec = tuple[list[str], Optional[list[float]]]
"""(prefixes, weights or None) - megatron-core's blend form."""


def parse_blend(spec: str, flag: str) -> BlendSpec:
    """``"0.7 a 0.3 b"`` -> (["a", "b"], [0.7, 0.3]); ``"a b"`` -> (["a", "b"], None)."""
    parts = spec.split()
    if not parts:
        raise ConfigError(f"--{flag}: is empty")

    def weight(s: str) -> Optional[float]:
        try:
            return float(s)
        except ValueError:
            return None

    if len(parts) == 1 or weight(parts[0]) is None:
        if any(weight(p) is not None for p in parts):
            raise ConfigError(f"--{flag}: '{spec}' mixes weights into a list of prefixes")
        return parts, None
    if len(parts) % 2:
        raise ConfigError(f"--{flag}: '{spec}' is not WEIGHT PREFIX pairs")
    weights = [weight(w) for w in parts[0::2]]
    if any(w is None or w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--{flag}: weights in '{spec}' must be non-negative numbers, not all zero")
    return parts[1::2], weights


@dataclasses.dataclass
class Blends:
    """The run's datasets: one blend split by --split, or one blend per split."""

    blend: Optional[BlendSpec] = None
    per_split: Optional[list[Optional[BlendSpec]]] = None

    @property
    def prefixes(self) -> list[str]:
        specs = [self.blend] if self.blend else [b for b in self.per_split if b]
        return [p for spec in specs for p in spec[0]]


def blends_from(data_path: Optional[str], train_data_path: Optional[str], valid_data_path: Optional[str],
                default_prefix: str) -> Blends:
    if train_data_path is not None:
        return Blends(per_split=[parse_blend(train_data_path, "train-data-path"),
                                 parse_blend(valid_data_path, "valid-data-path"), None])
    if data_path is not None:
        return Blends(blend=parse_blend(data_path, "data-path"))
    return Blends(blend=([default_prefix], None))
