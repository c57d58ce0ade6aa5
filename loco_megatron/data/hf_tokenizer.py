"""Hugging Face tokenizers (``--tokenizer-type HuggingFaceTokenizer``): training a byte-level
BPE, loading any HF tokenizer as a megatron-core tokenizer, and its fingerprint.

``--tokenizer-model`` is a local tokenizer folder (``tokenizer.json`` and, for the special
tokens, ``tokenizer_config.json``), a ``tokenizer.json`` file (read with the folder it
is in, so its ``tokenizer_config.json`` is seen), or a hub name (downloaded into the hub
cache, or read from it offline; :mod:`.hub` says which arguments are local paths). Ids are
those of megatron-core's ``HuggingFaceTokenizer`` (transformers' ``AutoTokenizer``, fast
backend): the text's tokens only, no BOS/EOS template; training appends EOD = the
tokenizer's ``eos_token`` to every document, so a tokenizer without one is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from typing import Iterable

from loco_megatron.config import ConfigError, one_line
from loco_megatron.data.hub import hub_snapshot

SPECIAL_TOKENS = (("bos_token", "<s>"), ("eos_token", "</s>"), ("pad_token", "<pad>"))
"""Special tokens of the byte-level BPE that :func:`train_byte_level_bpe` writes (ids 0, 1, 2)."""


def train_byte_level_bpe(texts: Iterable[str], out_dir: str, vocab_size: int) -> str:
    """Train a byte-level BPE (GPT-2 style: every byte is a base token, so nothing is
    unknown and decode gives the text back) on ``texts`` and write the folder ``out_dir``
    with ``tokenizer.json`` and ``tokenizer_config.json`` (bos ``<s>``, eos ``</s>``, pad
    ``<pad>``; no BOS/EOS added when encoding: training appends EOD itself).

    Written under a temporary name and renamed, so a folder that exists is complete.
    Raises ValueError when ``texts`` is empty.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a document's first word keeps its ids whether or not a space precedes it.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[t for _, t in SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    seen = {"docs": 0}

    def counted():
        for text in texts:
            seen["docs"] += 1
            yield text

    tok.train_from_iterator(counted(), trainer=trainer)
    if seen["docs"] == 0:
        raise ValueError("no documents to train on")
    out = pathlib.Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                **dict(SPECIAL_TOKENS)).save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _local_source(model: str, offline: bool) -> str:
    """What to hand to ``AutoTokenizer``: a local folder (a hub name's is its snapshot in the
    hub cache; :mod:`.hub` decides which an argument is). Raises ConfigError / InputNotHere."""
    p = pathlib.Path(model).expanduser()
    if p.is_file():
        if p.name != "tokenizer.json":
            raise ConfigError(f"--tokenizer-model: {model} is a file but not a tokenizer.json "
                              "(give a Hugging Face tokenizer folder, its tokenizer.json, or a hub name)")
        return str(p.parent)
    if p.is_dir():
        if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
            raise ConfigError(f"--tokenizer-model: {model} is a folder without tokenizer.json")
        return str(p)
    return hub_snapshot("--tokenizer-model", model, offline)  # load_tokenizer has ruled out a local path


def load_hf_tokenizer(model: str, offline: bool = False):
    """megatron-core's ``HuggingFaceTokenizer`` (through ``MegatronTokenizer``) over ``model``
    (``offline``: a hub name is read from the hub cache only). Raises ConfigError (one line,
    InputNotHere when it is not on this machine) when it cannot be loaded or has no eos token."""
    source = _local_source(model, offline)  # first: a hub name that cannot be had fails before the slow imports
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"--tokenizer-type: HuggingFaceTokenizer needs {e.name}: "
                          "pip install -r requirements.txt") from None
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        tok = MegatronTokenizer.from_pretrained(tokenizer_path=source, metadata_path={"library": "huggingface"},
                                                use_fast=True)
    except Exception as e:  # megatron's ValueError around transformers' / tokenizers' own (several lines)
        raise ConfigError(f"--tokenizer-model: {model} is not a Hugging Face tokenizer: {one_line(e)}") from None
    if tok.eod is None:
        raise ConfigError(f"--tokenizer-model: {model} defines no eos token (training ends every document with "
                          "it): set eos_token in its tokenizer_config.json")
    return tok


def hf_backend(tokenizer):
    """The transformers tokenizer inside a megatron-core ``HuggingFaceTokenizer``."""
    return tokenizer._tokenizer.tokenizer


def hf_fingerprint(tokenizer) -> str:
    """16 hex digits identifying what the tokenizer encodes to: its serialised ``tokenizers``
    pipeline (vocabulary, merges, normaliser, pre-tokeniser, added tokens) and its EOD id.
    The same for a folder, its tokenizer.json and the hub copy of the same tokenizer."""
    hf = hf_backend(tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        canonical = json.dumps(json.loads(backend.to_str()), sort_keys=True, ensure_ascii=False)
    else:  # a Python-only ("slow") tokenizer: its vocabulary is what we can compare
        canonical = json.dumps(sorted(hf.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(f"{canonical}\neod={tokenizer.eod}".encode()).hexdigest()[:16]


def hf_special_token_ids(tokenizer) -> dict:
    """``bos_token_id``/``eos_token_id``/``pad_token_id`` of the tokenizer (those it defines);
    ``eos_token_id`` is the EOD that training appended to every document."""
    backend = hf_backend(tokenizer)
    ids = {"bos_token_id": backend.bos_token_id, "eos_token_id": tokenizer.eod, "pad_token_id": backend.pad_token_id}
    return {k: int(v) for k, v in ids.items() if v is not None}


def save_hf_tokenizer(tokenizer, out: pathlib.Path, max_length: int) -> None:
    """Write the training tokenizer's files into ``out`` (``AutoTokenizer.from_pretrained(out)``
    encodes text to the same ids)."""
    backend = hf_backend(tokenizer)
    backend.model_max_length = max_length
    backend.save_pretrained(str(out))
