"""Checkpoints settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config.base import check_choices, choice, require


@dataclasses.dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to write checkpoints to."""
    save_interval: int = 0
    """Save every this many steps (0 = only at the end when --save is set)."""
    load: Optional[str] = None
    """Directory to resume from (its latest complete checkpoint, in whichever format it holds)."""
    ckpt_format: str = choice("torch_dist", ("torch_dist", "torch", "fsdp_dtensor"))
    """Format --save writes: torch_dist (megatron-core dist_checkpointing: loads under another
    world size / TP / PP / EP / DP with the same model shape), torch (one file per rank:
    faster, resumes only with the same layout) or fsdp_dtensor (--use-megatron-fsdp only:
    DTensors through torch.distributed.checkpoint, loads under another world size /
    sharding strategy / number of instances)."""
    async_save: bool = False
    """torch_dist / fsdp_dtensor: write checkpoints in a background process while training continues;
    the checkpoint is committed (renamed, `latest` updated) once every rank's write finished."""

    def __post_init__(self):
        check_choices(self)
        require(self.save_interval >= 0, "save_interval", "must be >= 0")
        require(not (self.async_save and self.ckpt_format == "torch"), "async_save",
                "needs --ckpt-format torch_dist or fsdp_dtensor")
