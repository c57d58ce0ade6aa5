"""Text from a checkpoint on one process: greedy or top-p sampling with megatron's GPTModel.

The checkpoint (torch_dist, any TP/PP/EP layout) is read into one TP=PP=EP=1 model by
:func:`loco_megatron.export.reader.loaded_model`, so generation computes exactly the
logits the trainer's model computes, for every model the trainer builds (dense or MoE,
RoPE or learned positions). No KV cache: every new token re-runs the whole context (at most
``--seq-length`` tokens, the last ones), which is what small models on a CPU can afford.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Optional

import torch

from loco_megatron.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each next token is chosen."""

    max_new_tokens: int = 64
    """Stop after this many new tokens (or earlier, at the end-of-document token)."""
    top_p: Optional[float] = None
    """None: greedy (the most likely token). Else nucleus sampling from the smallest set of
    tokens whose probability adds up to at least ``top_p``."""
    temperature: float = 1.0
    """Logits are divided by this before sampling (not used when greedy)."""
    seed: int = 0
    """Seed of the sampling generator: the same seed gives the same text."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens: {self.max_new_tokens} must be >= 1")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p: {self.top_p} is not in (0, 1]")
        if self.temperature <= 0.0:
            raise ConfigError(f"--temperature: {self.temperature} must be positive")


@dataclasses.dataclass(frozen=True)
class Generated:
    prompt_ids: list[int]
    new_ids: list[int]
    """The generated token ids, without the end-of-document token."""
    stopped_at_eod: bool
    """True when the model produced the end-of-document token (else: --max-new-tokens ran out)."""
    text: str
    """The detokenised ``new_ids``."""


def pick_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token id from float ``[vocab]`` logits (the real vocabulary, no padding rows)."""
    if sampling.top_p is None:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    # Keep a token when the mass before it is below top_p: the smallest prefix reaching top_p.
    keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < sampling.top_p
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    return int(order[torch.multinomial(kept / kept.sum(), 1, generator=generator)])


@torch.no_grad()
def generate_ids(model: Callable, prompt_ids: list[int], eod: int, vocab: int, context: int,
                 sampling: Sampling) -> tuple[list[int], bool]:
    """``(new ids, stopped at eod)``: the tokens ``model`` (a megatron GPTModel on one rank,
    ``model(tokens [1, s], position_ids [1, s], attention_mask=None) -> logits [1, s, padded
    vocab]``) continues ``prompt_ids`` with, the last ``context`` tokens as its input, only
    the first ``vocab`` logits considered (the rest pad the embedding for TP)."""
    generator = torch.Generator().manual_seed(sampling.seed)
    ids, new = list(prompt_ids), []
    for _ in range(sampling.max_new_tokens):
        window = torch.tensor([ids[-context:]], dtype=torch.long)
        positions = torch.arange(window.shape[1]).unsqueeze(0)
        logits = model(window, positions, attention_mask=None)[0, -1, :vocab].float()
        token = pick_next(logits, sampling, generator)
        if token == eod:
            return new, True
        ids.append(token)
        new.append(token)
    return new, False


def generate(load: str, prompt: str, sampling: Sampling, tokenizer_model: Optional[str] = None,
             cache_home: pathlib.Path = pathlib.Path.home() / ".cache", offline: bool = False,
             replica: Optional[int] = None) -> Generated:
    """Continue ``prompt`` with the model saved in ``load`` (a SAVE root or an ``iter_N``
    folder; of a DiLoCo checkpoint the agreed model, or ``replica``'s own:
    :func:`~loco_megatron.export.reader.model_source`), tokenised by the run's tokenizer (``tokenizer_model``, default the one its run
    config names or the built-in corpus's; ``offline``: HF_HUB_OFFLINE, a hub name is read
    from the hub cache only). Raises ConfigError (one line) on bad input."""
    from loco_megatron.data.tokenizer import load_tokenizer
    from loco_megatron.export.reader import (embedding_rows, loaded_model, model_source, read_run_config,
                                             resolve_iteration_dir, single_rank_config)
    from loco_megatron.data.tokenizer import HUGGINGFACE
    from loco_megatron.export.writer import default_tokenizer_path
    from loco_megatron.model import padded_vocab_size

    path = resolve_iteration_dir(load)
    saved = read_run_config(path)
    rows, ddp_prefix = embedding_rows(path)
    tok_type = saved.data.tokenizer_type
    if tok_type == HUGGINGFACE:
        tok_path = tokenizer_model or saved.data.tokenizer_model
    else:
        tok_path = str(tokenizer_model or default_tokenizer_path(saved, cache_home))
    tokenizer = load_tokenizer(tok_path, tok_type, offline)  # ConfigError naming --tokenizer-model if missing
    pieces, tp = tokenizer.vocab_size, saved.parallel.tensor_model_parallel_size
    if padded_vocab_size(pieces, tp) != rows:
        raise ConfigError(f"--tokenizer-model: {tok_path} has {pieces} pieces, but the checkpoint's embedding "
                          f"has {rows} rows (padded for TP {tp}): not the run's tokenizer")
    prompt_ids = list(tokenizer.tokenize(prompt))
    if not prompt_ids:
        raise ConfigError("--prompt: empty (nothing to continue)")
    config = single_rank_config(saved)
    with loaded_model(path, config, rows, ddp_prefix, model_source(path, replica)[0]) as (model, _):
        new, at_eod = generate_ids(model, prompt_ids, tokenizer.eod, pieces, config.model.seq_length, sampling)
    # Detokenised after the prompt, not alone: a leading space or a multi-byte character split
    # across the boundary then comes out as in the whole text.
    head, full = tokenizer.detokenize(prompt_ids), tokenizer.detokenize(prompt_ids + new)
    text = full[len(head):] if full.startswith(head) else tokenizer.detokenize(new)
    return Generated(prompt_ids, new, at_eod, text)


def whitespace_note(text: str) -> str:
    """For the end-of-generation line: what a whitespace-only ``text`` holds ("" when it has
    anything visible). An undertrained model's most likely tokens are indentation and
    newlines; printed bare they look like no output at all."""
    if not text or text.strip():
        return ""
    names = {" ": "space", "\n": "newline", "\t": "tab"}
    counts = [(text.count(c), name) for c, name in names.items() if c in text]
    other = len(text) - sum(n for n, _ in counts)
    parts = [f"{n} {name}{'s' if n != 1 else ''}" for n, name in counts] + ([f"{other} other"] if other else [])
    return f"; the new text is whitespace only: {', '.join(parts)}"
