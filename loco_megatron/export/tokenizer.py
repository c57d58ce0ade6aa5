"""The run's sentencepiece model as Hugging Face tokenizer files that encode identically.

Why not transformers' own sentencepiece conversion (``LlamaTokenizer`` from
``tokenizer.model``): loco-megatron's tokenizers are trained with
``allow_whitespace_only_pieces`` (indentation of source code becomes pieces such as
``▁▁▁▁``). sentencepiece then splits text into words that start at a whitespace run and
run to the next one (``'▁▁▁two'`` is one word), and merges by piece score inside each
word. LLaMA's fixed pre-tokenizer (transformers 5's ``LlamaTokenizer``) treats a leading
space differently and its merge order follows another rule, so it gives other ids for
253 of 875 2,000-character chunks of the first 60 standard-library modules (the built-in
corpus's 4,096-piece tokenizer). Here the ``tokenizer.json`` is built from the model's
own pieces and scores:

* normaliser: prepend ``▁`` (sentencepiece's dummy prefix), spaces -> ``▁``;
* pre-tokeniser: split into ``▁+[^▁]*`` words (sentencepiece's whitespace-only-pieces rule);
* BPE merges: every pair ``(a, b)`` whose concatenation is a piece, ranked by that
  piece's score (sentencepiece merges the highest-scoring pair first), byte fallback.

The folder also holds ``tokenizer.model`` for sentencepiece users.
"""

from __future__ import annotations

import json
import pathlib

from loco_megatron.config import ConfigError

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
"""sentencepiece ModelProto.SentencePiece.Type values."""


def read_pieces(model_path: str):
    """(pieces, trainer_spec, normalizer_spec) of a sentencepiece ``.model`` file."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(pathlib.Path(model_path).read_bytes())
    except Exception as e:  # protobuf's DecodeError and friends
        raise ConfigError(f"--tokenizer-model: {model_path} is not a sentencepiece model ({type(e).__name__})") from None
    if not proto.pieces:
        raise ConfigError(f"--tokenizer-model: {model_path} is not a sentencepiece model (no pieces)")
    return proto.pieces, proto.trainer_spec, proto.normalizer_spec


def special_token_ids(model_path: str) -> dict:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` of the sentencepiece model as
    its trainer set them (a model may number pad/unk/bos/eos 0/1/2/3, not the default
    -/0/1/2); an id the model disables (-1) is left out. Training ends documents with the
    tokenizer's EOD, which is ``</s>`` (eos)."""
    pieces, trainer, _ = read_pieces(model_path)
    ids = {"bos_token_id": trainer.bos_id, "eos_token_id": trainer.eos_id, "pad_token_id": trainer.pad_id}
    return {name: i for name, i in ids.items() if 0 <= i < len(pieces)}


def _check_supported(model_path: str, trainer, normalizer) -> None:
    def bad(what: str):
        raise ConfigError(f"--tokenizer-model: {model_path}: {what} is not supported by the Hugging Face export")

    if trainer.model_type != trainer.BPE:
        bad("a non-BPE sentencepiece model")
    if normalizer.name not in ("identity", "") or normalizer.precompiled_charsmap:
        bad(f"normalisation rule '{normalizer.name}'")
    if normalizer.remove_extra_whitespaces:
        bad("remove_extra_whitespaces")
    if not normalizer.add_dummy_prefix or trainer.treat_whitespace_as_suffix or not trainer.split_by_whitespace:
        bad("this whitespace handling (dummy prefix off, whitespace as suffix or no whitespace split)")


def build_tokenizer_json(model_path: str):
    """A ``tokenizers.Tokenizer`` that encodes and decodes like the sentencepiece model."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pieces, trainer, normalizer = read_pieces(model_path)
    _check_supported(model_path, trainer, normalizer)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    mergeable = {p.piece for p in pieces if p.type in (_NORMAL, _USER_DEFINED)}
    ranked = []
    for p in pieces:
        if p.type != _NORMAL or len(p.piece) < 2:
            continue
        for cut in range(1, len(p.piece)):
            a, b = p.piece[:cut], p.piece[cut:]
            if a in mergeable and b in mergeable:
                ranked.append((-p.score, vocab[a], vocab[b], a, b))
    ranked.sort()
    unk = pieces[trainer.unk_id].piece
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token=unk,
                     fuse_unk=True, byte_fallback=trainer.byte_fallback)
    tok = Tokenizer(bpe)
    ws = "\u2581"
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(ws), normalizers.Replace(" ", ws)])
    if trainer.allow_whitespace_only_pieces:
        split = Regex(f"{ws}+[^{ws}]*|[^{ws}]+")
    else:
        split = Regex(f"{ws}[^{ws}]*|[^{ws}]+")
    tok.pre_tokenizer = pre_tokenizers.Split(split, behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(ws, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                            for p in pieces if p.type in (_CONTROL, _UNKNOWN)])
    return tok, pieces, trainer


def write_tokenizer(model_path: str, out: pathlib.Path, max_length: int) -> int:
    """Write tokenizer.model, tokenizer.json, tokenizer_config.json and special_tokens_map.json
    into ``out``; returns the vocabulary size (number of pieces)."""
    tok, pieces, trainer = build_tokenizer_json(model_path)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer.model").write_bytes(pathlib.Path(model_path).read_bytes())

    def piece(i: int):
        return pieces[i].piece if 0 <= i < len(pieces) else None

    special = {"unk_token": piece(trainer.unk_id), "bos_token": piece(trainer.bos_id),
               "eos_token": piece(trainer.eos_id)}
    if piece(trainer.pad_id) is not None:
        special["pad_token"] = piece(trainer.pad_id)
    special = {k: v for k, v in special.items() if v is not None}
    config = {
        # The generic fast tokenizer keeps tokenizer.json as written (LlamaTokenizer would
        # replace its pre-tokeniser with LLaMA's, see the module docstring).
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Training data is the sentencepiece ids of each document, no <s> (EOD = </s>).
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        # sentencepiece never reads '<s>' in text as the control token; neither does this.
        "split_special_tokens": True,
        "model_max_length": max_length,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return len(pieces)
