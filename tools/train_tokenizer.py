#!/usr/bin/env python3
"""Train a sentencepiece tokenizer on text or JSON-lines files.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix data/tok --vocab-size 32000
"""

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _inputs import InputError, fail, iter_documents  # noqa: E402

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
    out = pathlib.Path(args.output_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    errors: list[str] = []

    def documents():
        # sentencepiece pulls documents from C++: stop cleanly on bad input, report after.
        try:
            yield from iter_documents(args.input, args.json_key)
        except InputError as e:
            errors.append(str(e))

    try:
        train_sentencepiece(documents(), tmp, args.vocab_size)
        if errors:
            fail(errors[0])
        for ext in (".vocab", ".model"):  # the .model last: its presence means complete
            os.replace(tmp + ext, str(out) + ext)
    except RuntimeError as e:  # sentencepiece: e.g. vocabulary larger than the corpus allows
        fail(errors[0] if errors else f"sentencepiece could not train on {', '.join(args.input)} "
             f"({str(e).strip().splitlines()[-1][:160]})")
    finally:
        for ext in (".vocab", ".model"):
            pathlib.Path(tmp + ext).unlink(missing_ok=True)
    print(str(out) + ".model")


if __name__ == "__main__":
    main()
