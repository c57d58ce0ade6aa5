#!/usr/bin/env python3
"""Train a tokenizer on text, JSON-lines or parquet files.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix data/tok --vocab-size 32000
    python tools/train_tokenizer.py --tokenizer-type HuggingFaceTokenizer --input corpus.parquet \
        --output-prefix data/hf_tok --vocab-size 32000

SentencePieceTokenizer (default) writes PREFIX.model and PREFIX.vocab (a byte-fallback
BPE); HuggingFaceTokenizer writes the folder PREFIX with tokenizer.json and
tokenizer_config.json (a byte-level BPE; bos <s>, eos </s> = the EOD training appends,
pad <pad>), for --tokenizer-type HuggingFaceTokenizer --tokenizer-model PREFIX.
"""

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _inputs import InputError, fail, iter_documents  # noqa: E402

from loco_megatron.config import one_line  # noqa: E402
from loco_megatron.data.tokenizer import HUGGINGFACE, TOKENIZER_TYPES, train_sentencepiece  # noqa: E402


def _train_hf(args) -> None:
    from loco_megatron.data.hf_tokenizer import train_byte_level_bpe

    out = pathlib.Path(args.output_prefix)
    if out.exists():
        fail(f"--output-prefix: {out} already exists (the Hugging Face tokenizer is a folder; nothing was written)")
    try:
        # The tokenizers trainer pulls documents from Rust: bad input surfaces as InputError here.
        train_byte_level_bpe(iter_documents(args.input, args.json_keys[0]), str(out), args.vocab_size)
    except InputError as e:
        fail(str(e))
    print(out)


def _train_sentencepiece(args) -> None:
    out = pathlib.Path(args.output_prefix)
    tmp = f"{out}.tmp{os.getpid()}"
    errors: list[str] = []

    def documents():
        # sentencepiece pulls documents from C++: stop cleanly on bad input, report after.
        try:
            yield from iter_documents(args.input, args.json_keys[0])
        except InputError as e:
            errors.append(str(e))

    try:
        train_sentencepiece(documents(), tmp, args.vocab_size)
        if errors:
            fail(errors[0])
        for ext in (".vocab", ".model"):  # the .model last: its presence means complete
            os.replace(tmp + ext, str(out) + ext)
    except RuntimeError as e:  # sentencepiece: e.g. vocabulary larger than the corpus allows
        fail(errors[0] if errors else f"sentencepiece could not train on {', '.join(args.input)} ({one_line(e)})")
    finally:
        for ext in (".vocab", ".model"):
            pathlib.Path(tmp + ext).unlink(missing_ok=True)
    print(str(out) + ".model")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help=".txt, .jsonl (optionally .gz/.zst) or .parquet files")
    ap.add_argument("--output-prefix", required=True,
                    help="writes PREFIX.model and PREFIX.vocab, or (HuggingFaceTokenizer) the folder PREFIX")
    ap.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--json-keys", "--json-key", dest="json_keys", nargs="+", default=["text"],
                    help="the text's key in .jsonl, its column in .parquet (one; default text)")
    args = ap.parse_args()
    if args.vocab_size < 260:
        fail("--vocab-size must be at least 260 (256 byte pieces + specials)")
    if len(args.json_keys) != 1:
        fail(f"--json-keys: give one key ({' '.join(args.json_keys)} given)")
    pathlib.Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    if args.tokenizer_type == HUGGINGFACE:
        _train_hf(args)
    else:
        _train_sentencepiece(args)


if __name__ == "__main__":
    main()
