"""pretrain_gpt.py with megatron-core's gradient sync and parameter all-gather left
completely untouched (no hook installed): the reference for the '--loco-bits 0 /
--param-gather-bits 0 is bit-identical' tests."""

import sys
import warnings

from loco_megatron.cli import main_config
from loco_megatron.training.trainer import train


class _NoHook:
    """Installs nothing; only carries the attributes the trainer sets and saves."""

    def __init__(self, *unused):
        self.iteration = 0

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    config, env = main_config(sys.argv[1:])
    train(config, env, grad_sync_factory=_NoHook, param_sync_factory=_NoHook)
