"""The built-in corpus: the installed Python's standard-library source.

Real text that exists on every machine, so the default run needs no download. Built
once per cache directory (tokenizer + indexed dataset), under a file lock so that
concurrent ranks or runs build it once, and atomically (see
:func:`write_indexed_dataset`).
"""

from __future__ import annotations

import fcntl
import pathlib
import sys
import sysconfig
from typing import Callable, Optional

from loco_megatron.progress import progress
from loco_megatron.data.indexed import write_indexed_dataset
from loco_megatron.data.tokenizer import load_tokenizer, train_sentencepiece


def stdlib_documents() -> list[str]:
    """Top-level ``.py`` modules of the standard library, sorted by name (about 4.7 MB on 3.11)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))]


def default_corpus_dir(cache_dir: str, vocab_size: int) -> pathlib.Path:
    """Where the corpus for this Python version and vocabulary size lives (or will)."""
    return pathlib.Path(cache_dir) / f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-v{vocab_size}"


def ensure_default_corpus(cache_dir: str, vocab_size: int,
                          log: Optional[Callable[[str], None]] = None) -> tuple[str, str]:
    """Build (or reuse) the corpus; returns ``(data_prefix, tokenizer_model)``. ``log`` gets
    one line before each slow first-use phase (rank 0's printer in training; every rank
    passes one, as whichever rank takes the lock first builds while the others wait)."""
    out = default_corpus_dir(cache_dir, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    prefix, model = str(out / "corpus_text_document"), str(out / "tokenizer.model")
    if log is not None:  # announced before the lock: the printing rank may not be the building one
        if not pathlib.Path(model).is_file():
            log(f"training the default tokenizer ({vocab_size} sentencepiece pieces on this Python's "
                f"standard library, first use only, a few seconds) into {out}")
        if not pathlib.Path(prefix + ".idx").is_file():
            log(f"building the default corpus (tokenising the standard library into {prefix}.bin/.idx, "
                f"first use only, ~15 s)")
    with open(out / ".lock", "w") as lock, progress("preparing the default corpus", log):
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not pathlib.Path(model).is_file():
            tmp_prefix = str(out / "tokenizer.tmp")
            train_sentencepiece(stdlib_documents(), tmp_prefix, vocab_size)
            pathlib.Path(tmp_prefix + ".vocab").replace(out / "tokenizer.vocab")
            pathlib.Path(tmp_prefix + ".model").replace(model)
        if not pathlib.Path(prefix + ".idx").is_file():
            write_indexed_dataset(stdlib_documents(), load_tokenizer(model), prefix, model)
    return prefix, model
