"""Checkpoints settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config.base import require


@dataclasses.dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to write checkpoints to."""
    save_interval: int = 0
    """Save every this many steps (0 = only at the end when --save is set)."""
    load: Optional[str] = None
    """Directory to resume from (its latest complete checkpoint)."""

    def __post_init__(self):
        require(self.save_interval >= 0, "save_interval", "must be >= 0")
