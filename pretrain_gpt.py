#!/usr/bin/env python3
"""Megatron-Core GPT / MoE pretraining with LoCo low-bit gradient communication.

    torchrun --nproc_per_node 2 pretrain_gpt.py                 # tiny default, CPU or GPU
    torchrun --nproc_per_node 2 pretrain_gpt.py --loco-bits 4   # with 4-bit LoCo
    torchrun ... pretrain_gpt.py --config configs/gpt_125m.yaml --data-path ... --tokenizer-model ...
    python pretrain_gpt.py --config configs/mixtral_8x7b.yaml --dry-run --world-size 32

Flags follow Megatron-LM's names; ``--help`` lists them. A ``--config`` YAML file
(keys = flag names) is read first, command-line flags override it. ``--dry-run`` checks
the config and the layout for ``--world-size`` ranks (default: those its header names) and prints the start-up summary
with a memory estimate per GPU, starting nothing (exit 2 and one line if impossible).
"""

import sys
import warnings

from loco_megatron.cli import main_invocation
from loco_megatron.error_report import report_error
from loco_megatron.config import ConfigError


def main() -> int:
    config, env, dry = main_invocation()
    # megatron-core warns on import that TransformerEngine/Apex are absent; that is expected.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|is deprecated).*")
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    # torchft's heal transport sends its pickled header through torch.frombuffer(bytes), which
    # warns that the buffer is read-only; the tensor is only read (sent), never written.
    warnings.filterwarnings("ignore", message="The given buffer is not writable", module="torchft")
    try:
        if dry is not None:
            from loco_megatron.training.preflight import dry_run

            print(dry_run(config, dry.world_size, env.hf_hub_offline, dry.source))
            return 0
        from loco_megatron.data.inputs import check_inputs_here

        check_inputs_here(config)  # before torch is imported: a typo'd path is one line at once
    except ConfigError as e:
        report_error(e, 0 if dry is not None else env.rank, env.error_file)
        return 2
    from loco_megatron.progress import progress

    # heavy imports after parsing (tens of seconds on a loaded machine: said, not silent)
    say = (lambda line: print(line, flush=True)) if env.rank == 0 else None
    with progress("importing torch and megatron-core", say):
        from loco_megatron.children import die_with_parent
        from loco_megatron.training.health import RunAborted
        from loco_megatron.training.trainer import train
        from torch.distributed.elastic.multiprocessing.errors import record
        import megatron.core.tokenizers  # noqa: F401 (the larger part, else imported silently by the data set-up)

    import torch

    if env.rank != 0 or not torch.cuda.is_available():  # meaningless on CPU; once per run on GPUs
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    die_with_parent()  # megatron's forked checkpoint writers must not outlive a killed rank
    try:
        # record: an unexpected exception's traceback goes to torchrun's error file (its
        # summary's root cause); report_error replaces it with the one line for ours.
        record(train)(config, env)
    except ConfigError as e:
        report_error(e, env.rank, env.error_file)
        return 2
    except RunAborted as e:  # e.g. too many consecutive skipped steps: every rank agreed
        report_error(e, env.rank, env.error_file)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
