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

import pathlib
import re
from typing import NamedTuple, Optional

from loco_megatron.config import Config, ConfigError
from loco_megatron.data.hub import InputNotHere
from loco_megatron.data.tokenizer import load_tokenizer
from loco_megatron.diloco.layout import check_replicas, describe
from loco_megatron.diloco.payload import payload_line
from loco_megatron.training.memory_estimate import compressed_groups, estimate, estimate_line, optimizer_line

# loco_megatron.model and .summary import torch (seconds on a busy machine): they are imported
# where used, after the checks that need neither, so a bad layout or a missing tokenizer is
# one line at once.


class DryRunWorld(NamedTuple):
    """The world size a dry run checks, and where it came from."""

    world_size: int
    source: str
    """For the report's first line: "" (--world-size gave it), or e.g. "no --world-size:
    configs/llama2_7b.yaml names 2 nodes x 8 GPUs in its header"."""


GEOMETRY = re.compile(r"^# (GPUs|CPU): (\d+) (nodes?) x (\d+)", re.M)
"""A config's header line naming the machines it is written for: ``# GPUs: 2 nodes x 8 (...)``
or ``# CPU: 1 node x 2 ranks (...)``."""


def header_world_size(path: str) -> Optional[tuple[int, str]]:
    """(ranks, how the header says them: "2 nodes x 8 GPUs") from the leading comment block
    of the config file at ``path`` (every file in configs/ has one), or None without such a line."""
    head = []
    for line in pathlib.Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        head.append(line)
    found = GEOMETRY.search("\n".join(head))
    if found is None:
        return None
    kind, nodes, node_word, per_node = found.groups()
    return int(nodes) * int(per_node), f"{nodes} {node_word} x {per_node} {'GPUs' if kind == 'GPUs' else 'CPU ranks'}"


def dry_run_world(given: Optional[int], launched: Optional[int], config_path: str, shown: str) -> DryRunWorld:
    """--world-size (``given``), else $WORLD_SIZE (``launched``: a dry run under torchrun),
    else the machines the header of the config file at ``config_path`` (named ``shown``)
    names. None of them: the dry run would check a world size nobody chose (world 1 passes
    layouts that fail on the real job, and compresses nothing), so it is refused in one line."""
    if given is not None:
        world, source = given, ""
    elif launched is not None:
        world, source = launched, "$WORLD_SIZE"
    else:
        header = header_world_size(config_path)
        if header is None:
            raise ConfigError(f"--world-size: a dry run needs the number of ranks to check: give --world-size N "
                              f"({shown} names none in a '# GPUs: N nodes x G' header line)")
        world, source = header[0], f"no --world-size: {shown} names {header[1]} in its header"
    if world < 1:
        raise ConfigError(f"--world-size: {world} must be >= 1")
    return DryRunWorld(world, source)


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


def compresses_nothing(config: Config, dp: int, expert_dp: int) -> bool:
    """Whether LoCo would find no gradient to compress: every group it reduces over is one
    rank (the dense data-parallel group inside a DiLoCo replica, and the expert one;
    :func:`~loco_megatron.training.memory_estimate.compressed_groups`, which the memory
    estimate counts LoCo's buffers by)."""
    return not any(compressed_groups(config, dp, expert_dp))


def link_line(config: Config, world_size: int, est: dict, vocab: int) -> str:
    """--diloco-link-gbps: the outer exchange against the interval
    (:func:`~loco_megatron.diloco.link.describe_link`)."""
    from loco_megatron.diloco.link import describe_link
    from loco_megatron.training.flops import training_flops_per_token

    return describe_link(config, world_size, est["params"], training_flops_per_token(config.model, vocab))


def dry_run(config: Config, world_size: int, offline: bool = False, world_source: str = "") -> str:
    """The dry run's report (raises ConfigError, one line, for an impossible layout or an
    unreadable tokenizer; ``offline``: HF_HUB_OFFLINE, see :func:`dry_run_vocab`;
    ``world_source``: where ``world_size`` came from when not from --world-size, said in
    the first line)."""
    dp, expert_dp = check_layout(config, world_size)
    vocab, source = dry_run_vocab(config, offline)
    from loco_megatron.model import check_transformer_engine, padded_vocab_size
    from loco_megatron.training.summary import (batch_line, layout_line, loco_compresses_nothing, loco_settings,
                                                model_line)

    padded = padded_vocab_size(vocab, config.parallel.tensor_model_parallel_size)
    loco = "LoCo: off"
    if config.loco.enabled:
        loco = loco_compresses_nothing(config) if compresses_nothing(config, dp, expert_dp) else loco_settings(config)
    world = f"world size {world_size}" + (f" ({world_source})" if world_source else "")
    est = estimate(config, world_size, vocab)
    lines = [
        f"dry run: the config and the layout for {world} are valid; no process was started",
        model_line(config, padded, f", vocabulary {source}"),
        layout_line(config, world_size, dp, expert_dp),
        batch_line(config, dp),
        loco,
        *([describe(config, world_size), payload_line(config, est["outer_elements"])] if config.diloco.enabled
          else []),
        *([link_line(config, world_size, est, padded)] if config.diloco.enabled and config.diloco.diloco_link_gbps
          else []),
        optimizer_line(config, est),
        estimate_line(est),
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
