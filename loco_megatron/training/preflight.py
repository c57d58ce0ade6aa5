"""The checks a start makes before any process exists, shared by a real start
(:func:`loco_megatron.training.trainer.train`) and ``pretrain_gpt.py --dry-run``.

A dry run validates the config (its dataclasses did, while parsing) and the layout for
``--world-size`` ranks through the same :func:`check_layout` a real start calls, then
prints the start-up summary with :mod:`.memory_estimate`'s figures per GPU. It starts no
process and no torch.distributed, and does not look at the data files, the checkpoint
folders or the accelerator (a real start checks those on the machines that have them);
with ``--transformer-impl transformer_engine`` it says whether TransformerEngine can be
imported where it runs, which a real start requires.
"""

from __future__ import annotations

import pathlib

from loco_megatron.config import Config, ConfigError
from loco_megatron.diloco.layout import check_replicas, describe
from loco_megatron.model import check_transformer_engine, padded_vocab_size
from loco_megatron.training.memory_estimate import estimate, estimate_line
from loco_megatron.training.summary import batch_line, layout_line, loco_settings, model_line

ASSUMED_VOCAB = 32000
"""Vocabulary assumed when --tokenizer-model names a file that is not here (LLaMA-2's)."""


def check_layout(config: Config, world_size: int) -> tuple[int, int]:
    """(dense data-parallel size, expert data-parallel size or 0) for ``world_size`` ranks;
    ConfigError (one line) when megatron-core's layout rules reject it."""
    dims = config.data_parallel_size(world_size), config.expert_data_parallel_size(world_size)
    check_replicas(config, world_size, None)
    return dims


def check_start(config: Config, world_size: int) -> tuple[int, int]:
    """Everything a real start checks about the config before torch.distributed: the
    layout, and TransformerEngine when the layers need it."""
    dims = check_layout(config, world_size)
    check_transformer_engine(config)
    return dims


def _vocab(config: Config) -> tuple[int, str]:
    """(tokenizer size, where it came from): the --tokenizer-model's pieces, the built-in
    corpus tokenizer's --vocab-size without data, else an assumption (named)."""
    d = config.data
    if d.tokenizer_model is None:
        return d.vocab_size, f"the built-in corpus tokenizer's {d.vocab_size}"
    if pathlib.Path(d.tokenizer_model).is_file():
        import sentencepiece

        pieces = sentencepiece.SentencePieceProcessor(model_file=d.tokenizer_model).get_piece_size()
        return pieces, f"{pieces} from {d.tokenizer_model}"
    return ASSUMED_VOCAB, f"{ASSUMED_VOCAB} assumed ({d.tokenizer_model} is not here)"


def dry_run(config: Config, world_size: int) -> str:
    """The dry run's report (raises ConfigError, one line, for an impossible layout)."""
    dp, expert_dp = check_layout(config, world_size)
    vocab, source = _vocab(config)
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
