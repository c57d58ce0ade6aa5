#!/usr/bin/env python3
"""Train a sentencepiece tokenizer on text or JSON-lines files.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix data/tok --vocab-size 32000
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _inputs import iter_documents  # noqa: E402

from loco_megatron.data.tokenizer import train_sentencepiece  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help=".txt or .jsonl files")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--json-key", default="text")
    args = ap.parse_args()
    if args.vocab_size < 260:
        sys.exit("error: --vocab-size must be at least 260 (256 byte-fallback pieces + specials)")
    pathlib.Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    model = train_sentencepiece(iter_documents(args.input, args.json_key), args.output_prefix, args.vocab_size)
    print(model)


if __name__ == "__main__":
    main()
