#!/usr/bin/env python3
"""Tokenise text or JSON-lines files into a Megatron indexed dataset (PREFIX.bin/.idx).

    python tools/preprocess_data.py --input corpus.jsonl --tokenizer-model data/tok.model \
        --output-prefix data/corpus_text_document
    torchrun ... pretrain_gpt.py --data-path data/corpus_text_document --tokenizer-model data/tok.model
"""

import argparse
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# megatron-core warns on import that TransformerEngine/Apex are absent; expected here.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from _inputs import InputError, fail, iter_documents  # noqa: E402

from loco_megatron.config import ConfigError  # noqa: E402
from loco_megatron.data.indexed import write_indexed_dataset  # noqa: E402
from loco_megatron.data.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help=".txt or .jsonl files")
    ap.add_argument("--tokenizer-model", required=True)
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--json-key", default="text")
    args = ap.parse_args()
    try:
        tok = load_tokenizer(args.tokenizer_model)
        pathlib.Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
        n = write_indexed_dataset(iter_documents(args.input, args.json_key), tok, args.output_prefix,
                                  args.tokenizer_model, progress=True)
    except (ConfigError, InputError) as e:  # write_indexed_dataset has removed its temporary files
        fail(str(e))
    print(f"{n} tokens -> {args.output_prefix}.bin/.idx")


if __name__ == "__main__":
    main()
