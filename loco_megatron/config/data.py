"""Data settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config.base import check_choices, choice, require


@dataclasses.dataclass
class DataConfig:
    data_path: Optional[str] = None
    """Megatron indexed dataset(s) (PREFIX.bin/PREFIX.idx): 'PREFIX', 'P1 P2' (weighted by
    size) or 'W1 P1 W2 P2' (a blend drawn in proportion to the weights). None = the built-in corpus."""
    tokenizer_model: Optional[str] = None
    """The tokenizer the --data-path (or --train-data-path) dataset was made with, and only
    with one (the built-in corpus has its own tokenizer): a sentencepiece .model file, or with
    --tokenizer-type HuggingFaceTokenizer a Hugging Face tokenizer folder, its tokenizer.json
    or a hub name."""
    tokenizer_type: str = choice("SentencePieceTokenizer", ("SentencePieceTokenizer", "HuggingFaceTokenizer"))
    """SentencePieceTokenizer or HuggingFaceTokenizer (Megatron-LM's names): how to read
    --tokenizer-model. The built-in corpus uses its own sentencepiece tokenizer."""
    split: str = "98,2,0"
    """Train/validation/test split weights of the documents."""
    micro_batch_size: int = 4
    """Samples per micro batch per data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step across all data-parallel ranks."""
    data_cache_path: Optional[str] = None
    """Where built-in corpus and dataset index caches go (None = ~/.cache/loco_megatron)."""
    vocab_size: int = 4096
    """Vocabulary of the tokenizer trained for the built-in corpus."""
    dry_run_vocab_size: Optional[int] = None
    """--dry-run only: the vocabulary of the tokenizer the config is meant for (e.g. LLaMA-3's
    128256), used when no --tokenizer-model is given or it is not on this machine (a missing
    path, a hub name offline), and printed as such. A real start always uses the tokenizer's own."""
    train_data_path: Optional[str] = None
    """Training data only (Megatron's form: PREFIX, 'P1 P2' or 'W1 P1 W2 P2'); with
    --valid-data-path, replaces --data-path and --split."""
    valid_data_path: Optional[str] = None
    """Validation data (same form), with --train-data-path."""

    def __post_init__(self):
        check_choices(self)
        if self.tokenizer_type != "SentencePieceTokenizer":
            require(self.data_path is not None or self.train_data_path is not None, "tokenizer_type",
                    f"{self.tokenizer_type} needs --data-path and --tokenizer-model "
                    "(the built-in corpus has its own sentencepiece tokenizer)")
        require(self.micro_batch_size > 0, "micro_batch_size", "must be positive")
        require(self.dry_run_vocab_size is None or self.dry_run_vocab_size > 0, "dry_run_vocab_size",
                "must be positive")
        require(self.global_batch_size > 0, "global_batch_size", "must be positive")
        parts = self.split.split(",")
        ok = len(parts) == 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts)
        require(ok and sum(float(p) for p in parts) > 0, "split",
                 f"'{self.split}' is not three comma-separated non-negative weights")
        if self.data_path is None and self.train_data_path is None:
            # Without a dataset the run trains on the built-in corpus with that corpus's own
            # tokenizer: a --tokenizer-model would be ignored (and a typo'd one unnoticed).
            require(self.tokenizer_model is None, "tokenizer_model",
                    f"{self.tokenizer_model} is given without --data-path, and the built-in corpus uses its "
                    "own tokenizer: give the dataset made with it (--data-path PREFIX), or drop --tokenizer-model")
        if self.data_path is not None:
            require(self.tokenizer_model is not None, "tokenizer_model", "is required with --data-path")
        if self.train_data_path is not None or self.valid_data_path is not None:
            require(self.train_data_path is not None and self.valid_data_path is not None, "train_data_path",
                     "and --valid-data-path go together")
            require(self.data_path is None, "data_path", "give either it or --train-data-path/--valid-data-path")
            require(self.tokenizer_model is not None, "tokenizer_model", "is required with --train-data-path")
