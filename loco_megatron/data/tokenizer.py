"""sentencepiece tokenizers: training, and loading as a megatron-core tokenizer."""

from __future__ import annotations

import hashlib
import pathlib
from typing import Iterable

from loco_megatron.config import ConfigError


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


def tokenizer_fingerprint(model_path: str) -> str:
    return hashlib.sha256(pathlib.Path(model_path).read_bytes()).hexdigest()[:16]


def load_tokenizer(model_path: str):
    """A megatron-core ``MegatronTokenizer`` over the sentencepiece model at ``model_path``."""
    p = pathlib.Path(model_path)
    if p.is_dir():  # e.g. a Hugging Face tokenizer folder: say so rather than "does not exist"
        raise ConfigError(f"--tokenizer-model: {model_path} is a directory, not a sentencepiece .model file")
    if not p.is_file():
        raise ConfigError(f"--tokenizer-model: {model_path} does not exist")
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        return MegatronTokenizer.from_pretrained(tokenizer_path=str(p),
                                                 metadata_path={"library": "sentencepiece"})
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with long messages
        raise ConfigError(f"--tokenizer-model: {model_path} is not a sentencepiece model "
                          f"({str(e).splitlines()[0][:120]})") from None
