#!/usr/bin/env python3
"""Megatron-Core GPT / MoE pretraining with LoCo low-bit gradient communication.

    torchrun --nproc_per_node 2 pretrain_gpt.py                 # tiny default, CPU or GPU
    torchrun --nproc_per_node 2 pretrain_gpt.py --loco-bits 4   # with 4-bit LoCo
    torchrun ... pretrain_gpt.py --config configs/gpt_125m.yaml --data-path ... --tokenizer-model ...

Flags follow Megatron-LM's names; ``--help`` lists them. A ``--config`` YAML file
(keys = flag names) is read first, command-line flags override it.
"""

import sys
import warnings

from loco_megatron.cli import main_config, report_error
from loco_megatron.config import ConfigError


def main() -> int:
    config, env = main_config()
    # megatron-core warns on import that TransformerEngine/Apex are absent; that is expected.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|is deprecated).*")
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    from loco_megatron.training.health import RunAborted
    from loco_megatron.training.trainer import train  # heavy imports after parsing

    try:
        train(config, env)
    except ConfigError as e:
        report_error(e, env.rank)
        return 2
    except RunAborted as e:  # e.g. too many consecutive skipped steps: every rank agreed
        report_error(e, env.rank)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
