"""Run configuration: one dataclass per concern, validated on construction.

Field names are Megatron-LM's flag names with ``-`` replaced by ``_``; the CLI
(:mod:`loco_megatron.cli`) derives its flags and their help text from these
dataclasses, so a field's docstring *is* its ``--help``. One module per concern;
:class:`Config` (in :mod:`.run`) holds them all and checks what spans several.
"""

from loco_megatron.config.base import ALTERNATIVES, ConfigError, brief, one_line, require
from loco_megatron.config.model import ModelConfig
from loco_megatron.config.parallel import ParallelConfig
from loco_megatron.config.data import DataConfig
from loco_megatron.config.optimizer import OptimizerConfig
from loco_megatron.config.train import TrainConfig
from loco_megatron.config.loco import LoCoConfig
from loco_megatron.config.diloco import DiLoCoConfig
from loco_megatron.config.checkpoint import CheckpointConfig
from loco_megatron.config.logger import LoggingConfig
from loco_megatron.config.run import Config

__all__ = ["ALTERNATIVES", "ConfigError", "brief", "one_line", "require", "ModelConfig", "ParallelConfig", "DataConfig", "OptimizerConfig", "TrainConfig", "LoCoConfig", "DiLoCoConfig", "CheckpointConfig", "LoggingConfig", "Config"]
