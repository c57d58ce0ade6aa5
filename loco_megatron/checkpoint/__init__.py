"""Checkpoints: two formats (torch_dist, reshardable; torch, per-rank files), atomic commit,
optional background writes. See :mod:`loco_megatron.checkpoint.checkpointer`."""

from loco_megatron.checkpoint.checkpointer import Checkpointer
from loco_megatron.checkpoint.files import LATEST, committed_checkpoints

__all__ = ["Checkpointer", "LATEST", "committed_checkpoints"]
