#!/usr/bin/env python3
"""Tokenise text or JSON-lines files into a Megatron indexed dataset (PREFIX.bin/.idx).

    python tools/preprocess_data.py --input corpus.jsonl.zst --tokenizer-model data/tok.model \
        --output-prefix data/corpus_text_document --workers 8
    torchrun ... pretrain_gpt.py --data-path data/corpus_text_document --tokenizer-model data/tok.model

Inputs: .jsonl (one JSON object per line, text under --json-key) or text (documents
separated by blank lines), each optionally .gz or .zst compressed. With --workers N,
N processes tokenise while this one reads and writes, in input order.
"""

import argparse
import functools
import multiprocessing
import pathlib
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# megatron-core warns on import that TransformerEngine/Apex are absent; expected here.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from _inputs import InputError, fail, iter_documents  # noqa: E402

from loco_megatron.config import ConfigError  # noqa: E402
from loco_megatron.data.indexed import write_token_documents  # noqa: E402
from loco_megatron.data.tokenizer import load_tokenizer  # noqa: E402


@functools.lru_cache(maxsize=1)
def _tokenizer(model: str):
    """One tokenizer per process (the pool re-sends the encoder with every chunk of work)."""
    return load_tokenizer(model)


class _Encoder:
    """Tokenises one document (EOD appended)."""

    def __init__(self, model: str):
        self.model = model

    def __call__(self, doc: str):
        tok = _tokenizer(self.model)
        # an int32 array pickles back to the writer far cheaper than a list of ints
        return np.asarray(list(tok.tokenize(doc)) + [tok.eod], dtype=np.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help=".txt or .jsonl files, optionally .gz/.zst")
    ap.add_argument("--tokenizer-model", required=True)
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1: in this process)")
    args = ap.parse_args()
    if args.workers < 1:
        fail("--workers must be >= 1")
    try:
        tok = load_tokenizer(args.tokenizer_model)
        pathlib.Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
        encode = _Encoder(args.tokenizer_model)
        docs = iter_documents(args.input, args.json_key)
        counted = {"docs": 0}

        def count(ids_iter):
            for ids in ids_iter:
                counted["docs"] += 1
                yield ids

        start = time.perf_counter()
        if args.workers == 1:
            n = write_token_documents(count(map(encode, docs)), tok.vocab_size, args.output_prefix,
                                      args.tokenizer_model, progress=True, eod=tok.eod)
        else:
            with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
                ids = pool.imap(encode, docs, chunksize=64)  # ordered: the dataset keeps input order
                n = write_token_documents(count(ids), tok.vocab_size, args.output_prefix, args.tokenizer_model,
                                          progress=True, eod=tok.eod)
    except (ConfigError, InputError) as e:  # write_token_documents has removed its temporary files
        fail(str(e))
    seconds = time.perf_counter() - start
    print(f"{counted['docs']} documents, {n} tokens -> {args.output_prefix}.bin/.idx in {seconds:.2f} s "
          f"({counted['docs'] / seconds:.0f} documents/s, {args.workers} worker(s))")


if __name__ == "__main__":
    main()
