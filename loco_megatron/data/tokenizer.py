"""Tokenizers: sentencepiece (training, loading) and the dispatch on ``--tokenizer-type``
(Megatron-LM's names) to it or to Hugging Face tokenizers (:mod:`.hf_tokenizer`)."""

from __future__ import annotations

import hashlib
import pathlib
from typing import Iterable

from loco_megatron.config import ConfigError, one_line
from loco_megatron.data.hub import InputNotHere, missing_path


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int) -> str:
    """Train a byte-fallback BPE sentencepiece model on ``texts``; returns the .model path.

    Identity normalisation and whitespace-only pieces keep source code's indentation
    and newlines (via byte fallback) intact through a round trip.
    """
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=model_prefix, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, split_digits=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", allow_whitespace_only_pieces=True,
        max_sentence_length=1 << 20, input_sentence_size=1_000_000, shuffle_input_sentence=True,
        minloglevel=2, num_threads=2,
    )
    return model_prefix + ".model"


SENTENCEPIECE, HUGGINGFACE = "SentencePieceTokenizer", "HuggingFaceTokenizer"
TOKENIZER_TYPES = (SENTENCEPIECE, HUGGINGFACE)
"""``--tokenizer-type`` values (Megatron-LM's names)."""


def tokenizer_fingerprint(model_path: str, tokenizer_type: str = SENTENCEPIECE, tokenizer=None) -> str:
    """16 hex digits identifying the tokenizer: the sentencepiece file's hash, or for a Hugging
    Face tokenizer (``tokenizer``: the loaded one, else loaded here) its serialised pipeline's."""
    if tokenizer_type == HUGGINGFACE:
        from loco_megatron.data.hf_tokenizer import hf_fingerprint

        return hf_fingerprint(tokenizer if tokenizer is not None else load_tokenizer(model_path, tokenizer_type))
    return hashlib.sha256(pathlib.Path(model_path).expanduser().read_bytes()).hexdigest()[:16]


def check_tokenizer_path(model_path: str, tokenizer_type: str = SENTENCEPIECE) -> None:
    """InputNotHere (one line, no network, nothing heavy imported) when the tokenizer is a local
    path that does not exist: a sentencepiece model always is one; a Hugging Face tokenizer
    argument when :func:`~loco_megatron.data.hub.local_path_reason` says so."""
    if tokenizer_type == HUGGINGFACE:
        missing = missing_path("--tokenizer-model", model_path)
        if missing is not None:
            raise missing
    elif not pathlib.Path(model_path).expanduser().exists():
        raise InputNotHere(f"--tokenizer-model: {model_path} does not exist")


def load_tokenizer(model_path: str, tokenizer_type: str = SENTENCEPIECE, offline: bool = False):
    """A megatron-core ``MegatronTokenizer`` over the sentencepiece model at ``model_path``, or
    (``HuggingFaceTokenizer``) over the Hugging Face tokenizer it names (``offline``: a hub
    name is read from the hub cache only). Raises ConfigError, InputNotHere (a subclass)
    when the tokenizer is not on this machine."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(f"--tokenizer-type: '{tokenizer_type}' is not one of {', '.join(TOKENIZER_TYPES)}")
    check_tokenizer_path(model_path, tokenizer_type)
    if tokenizer_type == HUGGINGFACE:
        from loco_megatron.data.hf_tokenizer import load_hf_tokenizer

        return load_hf_tokenizer(model_path, offline)
    p = pathlib.Path(model_path).expanduser()
    hf_hint = f"(for a Hugging Face tokenizer add --tokenizer-type {HUGGINGFACE})"
    if p.is_dir():  # e.g. a Hugging Face tokenizer folder: say so rather than "does not exist"
        raise ConfigError(f"--tokenizer-model: {model_path} is a directory, not a sentencepiece .model file {hf_hint}")
    if p.suffix == ".json":
        raise ConfigError(f"--tokenizer-model: {model_path} is a JSON file, not a sentencepiece .model file {hf_hint}")
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        return MegatronTokenizer.from_pretrained(tokenizer_path=str(p),
                                                 metadata_path={"library": "sentencepiece"})
    except Exception as e:  # sentencepiece raises RuntimeError/OSError naming its C++ source line
        raise ConfigError(f"--tokenizer-model: {model_path} is not a sentencepiece model ({one_line(e)})") from None
