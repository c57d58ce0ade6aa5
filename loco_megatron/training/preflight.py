"""The checks a start makes before any process exists, shared by a real start
(:func:`loco_megatron.training.trainer.train`) and ``pretrain_gpt.py --dry-run``.

A dry run validates the config (its dataclasses did, while parsing) and the layout for
``--world-size`` ranks through the same :func:`check_layout` a real start calls, then
prints the start-up summary with :mod:`.memory_estimate`'s figures per GPU. It reads the
tokenizer as a real start does, for its vocabulary (:func:`dry_run_vocab`). It starts no
process and no torch.distributed, and does not look at the data files, the checkpoint
folders or the accelerator (a real start checks those on the machines that have them);
with ``--transformer-impl transformer_engine`` it says whether TransformerEngine can be
imported where it runs, which a real start requires.
"""

from __future__ import annotations

from loco_megatron.config import Config, ConfigError
from loco_megatron.data.hub import InputNotHere
from loco_megatron.data.tokenizer import load_tokenizer
from loco_megatron.diloco.layout import check_replicas, describe
from loco_megatron.training.memory_estimate import estimate, estimate_line

# loco_megatron.model and .summary import torch (seconds on a busy machine): they are imported
# where used, after the checks that need neither, so a bad layout or a missing tokenizer is
# one line at once.


def check_layout(config: Config, world_size: int) -> tuple[int, int]:
    """(dense data-parallel size, expert data-parallel size or 0) for ``world_size`` ranks;
    ConfigError (one line) when megatron-core's layout rules reject it."""
    dims = config.data_parallel_size(world_size), config.expert_data_parallel_size(world_size)
    check_replicas(config, world_size, None)
    return dims


def check_start(config: Config, world_size: int) -> tuple[int, int]:
    """Everything a real start checks about the config before torch.distributed: the
    layout, and TransformerEngine when the layers need it."""
    from loco_megatron.model import check_transformer_engine

    dims = check_layout(config, world_size)
    check_transformer_engine(config)
    return dims


def dry_run_vocab(config: Config, offline: bool = False) -> tuple[int, str]:
    """(tokenizer size, where it came from, for the model line): the --tokenizer-model's own
    (read as a real start reads it, whatever its form), the built-in corpus tokenizer's
    --vocab-size without one, or --dry-run-vocab-size when the config states it and the
    tokenizer is not given or not on this machine. Raises ConfigError (one line), also for a
    tokenizer that is not here when the config states no vocabulary."""
    d, stated = config.data, config.data.dry_run_vocab_size
    if d.tokenizer_model is None:
        if stated is None:
            return d.vocab_size, f"the built-in corpus tokenizer's {d.vocab_size}"
        return stated, f"{stated} (--dry-run-vocab-size: no --tokenizer-model given; the built-in corpus's is {d.vocab_size})"
    try:
        pieces = load_tokenizer(d.tokenizer_model, d.tokenizer_type, offline).vocab_size
    except InputNotHere as e:
        if stated is None:
            raise InputNotHere(f"{e}; a dry run reads the vocabulary from it (or state it: --dry-run-vocab-size N)") \
                from None
        return stated, f"{stated} (--dry-run-vocab-size: {d.tokenizer_model} is not on this machine)"
    return pieces, f"{pieces} from {d.tokenizer_model}"


def dry_run(config: Config, world_size: int, offline: bool = False) -> str:
    """The dry run's report (raises ConfigError, one line, for an impossible layout or an
    unreadable tokenizer; ``offline``: HF_HUB_OFFLINE, see :func:`dry_run_vocab`)."""
    dp, expert_dp = check_layout(config, world_size)
    vocab, source = dry_run_vocab(config, offline)
    from loco_megatron.model import check_transformer_engine, padded_vocab_size
    from loco_megatron.training.summary import batch_line, layout_line, loco_settings, model_line

    padded = padded_vocab_size(vocab, config.parallel.tensor_model_parallel_size)
    lines = [
        f"dry run: the config and the layout for world size {world_size} are valid; no process was started",
        model_line(config, padded, f", vocabulary {source}"),
        layout_line(config, world_size, dp, expert_dp),
        batch_line(config, dp),
        loco_settings(config) if config.loco.enabled else "LoCo: off",
        *([describe(config, world_size)] if config.diloco.enabled else []),
        estimate_line(estimate(config, world_size, vocab)),
    ]
    if config.model.transformer_impl == "transformer_engine":
        try:
            check_transformer_engine(config)
            here = "importable here"
        except ConfigError:
            here = "NOT importable here"
        lines.append(f"TransformerEngine: --transformer-impl transformer_engine needs it on every node ({here}; "
                     "a real start stops with one line without it)")
    lines.append("not checked by a dry run: data files, checkpoint folders, the accelerator")
    return "\n".join(lines)
