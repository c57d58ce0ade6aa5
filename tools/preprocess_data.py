#!/usr/bin/env python3
"""Tokenise text, JSON-lines or parquet files, or a Hugging Face dataset, into a Megatron
indexed dataset (PREFIX.bin/.idx, and PREFIX.meta.json naming the tokenizer).

    python tools/preprocess_data.py --input corpus.jsonl.zst --tokenizer-model data/tok.model \
        --output-prefix data/corpus_text_document --workers 8
    python tools/preprocess_data.py --input shard-*.parquet --json-keys content \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model data/hf_tok \
        --output-prefix data/corpus_text_document --workers 8
    torchrun ... pretrain_gpt.py --data-path data/corpus_text_document --tokenizer-model data/tok.model

Inputs (--input): .jsonl (one JSON object per line, text under --json-keys), .parquet
(one document per row of the --json-keys column) or text (documents separated by blank
lines), .jsonl/.txt optionally .gz or .zst compressed. Or --hf-dataset: a Hugging Face
dataset (a local folder, or a hub name, with --streaming to read it as it downloads;
needs `pip install -r requirements-datasets.txt`). A --tokenizer-model or --hf-dataset that
looks like a local path (loco_megatron/data/hub.py: e.g. it starts with . / ~, ends in
.model/.json, or its first folder exists) is never looked up on the hub; HF_HUB_OFFLINE=1
reads hub names from the local cache only. With --workers N, N processes tokenise
while this one reads and writes, in input order (the files are the same as with 1).
"""

import argparse
import functools
import itertools
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

from _inputs import InputError, fail, iter_documents, iter_hf_dataset  # noqa: E402

from loco_megatron.cli import hf_hub_offline  # noqa: E402
from loco_megatron.config import ConfigError  # noqa: E402
from loco_megatron.data.indexed import write_token_documents  # noqa: E402
from loco_megatron.data.tokenizer import TOKENIZER_TYPES, load_tokenizer, tokenizer_fingerprint  # noqa: E402


@functools.lru_cache(maxsize=1)
def _tokenizer(model: str, tokenizer_type: str):
    """One tokenizer per process (the pool re-sends the encoder with every chunk of work).
    Offline: the main process has loaded it first, so a hub tokenizer is in the hub cache."""
    return load_tokenizer(model, tokenizer_type, offline=True)


class _Encoder:
    """Tokenises one document (EOD appended)."""

    def __init__(self, model: str, tokenizer_type: str):
        self.model, self.tokenizer_type = model, tokenizer_type

    def __call__(self, doc: str):
        tok = _tokenizer(self.model, self.tokenizer_type)
        # an int32 array pickles back to the writer far cheaper than a list of ints
        return np.asarray(list(tok.tokenize(doc)) + [tok.eod], dtype=np.int32)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help=".txt, .jsonl (optionally .gz/.zst) or .parquet files")
    src.add_argument("--hf-dataset", help="a Hugging Face dataset: a local folder or a hub name (needs datasets)")
    ap.add_argument("--hf-subset", default=None, help="the dataset's configuration (subset) name")
    ap.add_argument("--hf-split", default="train", help="the dataset's split (default train)")
    ap.add_argument("--streaming", action="store_true", help="read --hf-dataset as it downloads")
    ap.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    ap.add_argument("--tokenizer-model", required=True,
                    help="sentencepiece .model, or a Hugging Face tokenizer folder/tokenizer.json/hub name")
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--json-keys", "--json-key", dest="json_keys", nargs="+", default=["text"],
                    help="the text's key in .jsonl, its column in .parquet and --hf-dataset (one; default text)")
    ap.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1: in this process)")
    args = ap.parse_args()
    if args.workers < 1:
        fail("--workers must be >= 1")
    if len(args.json_keys) != 1:
        fail(f"--json-keys: give one key ({' '.join(args.json_keys)} given); this tool writes one dataset")
    if args.streaming and not args.hf_dataset:
        fail("--streaming goes with --hf-dataset")
    return args


def main() -> None:
    args = parse_args()
    key = args.json_keys[0]
    try:
        if args.hf_dataset:
            docs = iter_hf_dataset(args.hf_dataset, key, args.hf_subset, args.hf_split, args.streaming,
                                   hf_hub_offline())
        else:
            docs = iter_documents(args.input, key)
        # A missing file or column fails here, in seconds, not after the tokenizer (megatron) loads.
        docs = itertools.chain([next(docs)], docs)
        tok = load_tokenizer(args.tokenizer_model, args.tokenizer_type, hf_hub_offline())
        fingerprint = tokenizer_fingerprint(args.tokenizer_model, args.tokenizer_type, tok)
        pathlib.Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
        encode = _Encoder(args.tokenizer_model, args.tokenizer_type)
        counted = {"docs": 0}

        def count(ids_iter):
            for ids in ids_iter:
                counted["docs"] += 1
                yield ids

        def write(ids_iter):
            return write_token_documents(count(ids_iter), tok.vocab_size, args.output_prefix, True, tok.eod,
                                         args.tokenizer_type, fingerprint)

        start = time.perf_counter()
        if args.workers == 1:
            n = write(map(encode, docs))
        else:
            with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
                n = write(pool.imap(encode, docs, chunksize=64))  # ordered: the dataset keeps input order
    except (ConfigError, InputError) as e:  # write_token_documents has removed its temporary files
        fail(str(e))
    seconds = time.perf_counter() - start
    print(f"{counted['docs']} documents, {n} tokens -> {args.output_prefix}.bin/.idx in {seconds:.2f} s "
          f"({counted['docs'] / seconds:.0f} documents/s, {args.workers} worker(s))")


if __name__ == "__main__":
    main()
