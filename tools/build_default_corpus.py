#!/usr/bin/env python3
"""Build (or find) the built-in corpus: the standard library's source, tokenised.

pretrain_gpt.py does this by itself when --data-path is not given; this tool does it
ahead of time and prints the --data-path / --tokenizer-model to use.
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from loco_megatron.data.corpus import ensure_default_corpus  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data-cache-path", default=str(pathlib.Path.home() / ".cache" / "loco_megatron"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    args = ap.parse_args()
    prefix, model = ensure_default_corpus(args.data_cache_path, args.vocab_size)
    print(f"--data-path {prefix} --tokenizer-model {model}")


if __name__ == "__main__":
    main()
