"""Writing and checking Megatron indexed datasets (PREFIX.bin / PREFIX.idx).

The files are written by megatron-core's ``IndexedDatasetBuilder``. Next to them we
keep ``PREFIX.meta.json`` with the tokenizer's vocabulary size and fingerprint, so a
run with a different tokenizer is refused before it trains on garbage.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable, Optional

import numpy as np

from loco_megatron.config import ConfigError, one_line


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size < 65500 else np.int32


def write_indexed_dataset(docs: Iterable[str], tokenizer, prefix: str, tokenizer_model: str,
                          progress: bool = False, tokenizer_type: str = "SentencePieceTokenizer") -> int:
    """Tokenise ``docs`` (one document each, EOD appended) into ``prefix``.bin/.idx.
    Returns the number of tokens."""
    from loco_megatron.data.tokenizer import tokenizer_fingerprint

    ids = (list(tokenizer.tokenize(doc)) + [tokenizer.eod] for doc in docs)
    return write_token_documents(ids, tokenizer.vocab_size, prefix, progress, tokenizer.eod, tokenizer_type,
                                 tokenizer_fingerprint(tokenizer_model, tokenizer_type, tokenizer))


def write_token_documents(documents: Iterable, vocab_size: int, prefix: str, progress: bool, eod: int,
                          tokenizer_type: str, fingerprint: str) -> int:
    """Write already tokenised documents (lists or arrays of ids, EOD included) to ``prefix``.bin/.idx,
    and ``prefix``.meta.json recording the tokenizer (type, fingerprint, vocabulary size, EOD).

    Files are written under temporary names and renamed at the end, so an interrupted
    run never leaves a dataset that looks complete. Returns the number of tokens.
    """
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tmp = f"{prefix}.tmp{os.getpid()}"
    try:
        builder = IndexedDatasetBuilder(tmp + ".bin", dtype=token_dtype(vocab_size))
        if progress:
            from tqdm import tqdm

            documents = tqdm(documents, unit="doc")
        n_tokens = 0
        for ids in documents:
            builder.add_item(torch.as_tensor(np.asarray(ids, dtype=np.int64)))
            builder.end_document()
            n_tokens += len(ids)
        builder.finalize(tmp + ".idx")
        meta = {"vocab_size": vocab_size, "tokenizer_type": tokenizer_type, "tokenizer": fingerprint,
                "num_tokens": n_tokens, "eod": eod}
        pathlib.Path(tmp + ".meta.json").write_text(json.dumps(meta))
        for ext in (".bin", ".idx", ".meta.json"):
            os.replace(tmp + ext, prefix + ext)
    finally:  # bad input mid-way (or Ctrl-C): no partial files left behind
        for ext in (".bin", ".idx", ".meta.json"):
            pathlib.Path(tmp + ext).unlink(missing_ok=True)
    return n_tokens


def check_dataset_files(prefix: str, flag: str = "--data-path") -> None:
    """ConfigError (one line naming ``flag``) unless ``prefix``.bin and ``prefix``.idx exist."""
    for ext in (".bin", ".idx"):
        if not pathlib.Path(prefix + ext).is_file():
            raise ConfigError(f"{flag}: {prefix + ext} does not exist")


def check_indexed_dataset(prefix: str, tokenizer, tokenizer_model: Optional[str],
                          sample_tokens: int = 1 << 24, tokenizer_type: str = "SentencePieceTokenizer") -> None:
    """Raise ConfigError (one line naming the file) unless ``prefix`` is a readable
    dataset whose token ids fit ``tokenizer``'s vocabulary, made with this tokenizer when
    its ``.meta.json`` says which (a meta.json without ``tokenizer_type`` predates Hugging
    Face tokenizers: sentencepiece)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    check_dataset_files(prefix)
    _check_index_file(prefix + ".idx")
    try:
        ds = IndexedDataset(prefix, mmap=True)
        n = len(ds)
        expected = int(ds.index.sequence_lengths.sum(dtype=np.int64)) * ds.index.dtype_size
        actual = pathlib.Path(prefix + ".bin").stat().st_size
        if n == 0 or actual != expected:
            raise ValueError(f".bin holds {actual} bytes, the .idx describes {expected}")
        first = ds[0]
    except Exception as e:
        raise ConfigError(f"--data-path: {prefix}.bin/.idx is corrupt ({one_line(e)})") from None
    meta_path = pathlib.Path(prefix + ".meta.json")
    if meta_path.is_file() and tokenizer_model is not None:
        from loco_megatron.data.tokenizer import tokenizer_fingerprint

        meta = json.loads(meta_path.read_text())
        built_with = meta.get("tokenizer_type", "SentencePieceTokenizer")
        if built_with != tokenizer_type:
            raise ConfigError(f"--tokenizer-type: {prefix} was built with a {built_with} (its .meta.json), "
                              f"not a {tokenizer_type}")
        if meta.get("tokenizer") != tokenizer_fingerprint(tokenizer_model, tokenizer_type, tokenizer):
            raise ConfigError(f"--tokenizer-model: {tokenizer_model} is not the tokenizer {prefix} "
                              f"was built with (vocab {meta.get('vocab_size')} vs {tokenizer.vocab_size})")
    # Every id must be a row of the embedding table; scan a bounded prefix of the data.
    tokens = np.memmap(prefix + ".bin", dtype=ds.index.dtype, mode="r")[:sample_tokens]
    top = int(tokens.max()) if tokens.size else int(first.max())
    if top >= tokenizer.vocab_size:
        raise ConfigError(f"--tokenizer-model: {prefix}.bin has token id {top}, beyond the "
                          f"tokenizer's vocabulary of {tokenizer.vocab_size}")
    if not meta_path.is_file():  # e.g. made by Megatron-LM's tools: no fingerprint to compare
        _check_round_trip(ds, tokenizer, prefix)


def _check_index_file(idx: str) -> None:
    """Header and size of a megatron ``.idx``, read before ``IndexedDataset`` is built: when
    its constructor fails on a bad index, the half-built object's ``__del__`` prints a stray
    AttributeError traceback after our one-line error."""
    import struct

    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    head_size = len(_INDEX_HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequences, documents
    data = pathlib.Path(idx).read_bytes()[:head_size]
    problem = ""
    if len(data) < head_size or data[:len(_INDEX_HEADER)] != _INDEX_HEADER:
        problem = "not a megatron index (bad header)"
    else:
        version, code, sequences, documents = struct.unpack("<QBQQ", data[len(_INDEX_HEADER):])
        # sequence lengths (int32) and pointers (int64) per sequence, an int64 per document index
        needed = head_size + 12 * sequences + 8 * documents
        if version != 1:
            problem = f"index version {version}, not 1"
        elif code not in {d.value for d in DType}:
            problem = f"unknown token dtype code {code}"
        elif pathlib.Path(idx).stat().st_size < needed:
            problem = f"truncated: {pathlib.Path(idx).stat().st_size} bytes, its header needs {needed}"
    if problem:
        raise ConfigError(f"--data-path: {idx} is corrupt: {problem}")


def _check_round_trip(ds, tokenizer, prefix: str, docs: int = 8, tokens: int = 256) -> None:
    """A tokenizer whose vocabulary is larger than the dataset's passes the id-range check;
    the dataset's own tokenizer re-encodes its decoded text to the same ids, another one does
    not. Compare position by position over the first ``docs`` documents (``tokens`` each)."""
    same = total = 0
    for i in range(min(docs, len(ds))):
        ids = [int(t) for t in ds[i][:tokens] if int(t) != tokenizer.eod]
        again = list(tokenizer.tokenize(tokenizer.detokenize(ids)))
        same += sum(a == b for a, b in zip(ids, again))
        total += len(ids)
    if total and same < total // 2:
        raise ConfigError(f"--tokenizer-model: decoding {prefix}.bin and encoding it again reproduces only "
                          f"{same} of {total} sampled token ids: not the tokenizer the dataset was built with")
