#!/usr/bin/env python3
"""tools/preprocess_data.py throughput with 1 and N workers (documents/s side by side).

    python benchmarks/preprocess.py [--workers 2] [--copies 4] [--data-cache-path DIR]

The corpus is the standard library's top-level modules (the built-in corpus's documents)
repeated --copies times as .jsonl, tokenised with the built-in corpus's tokenizer. Speedup
needs idle cores: on a shared machine the ratio says more about the load than the tool.
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loco_megatron.data.corpus import ensure_default_corpus, stdlib_documents  # noqa: E402


def run(corpus: pathlib.Path, model: str, out: str, workers: int) -> float:
    proc = subprocess.run([sys.executable, str(REPO / "tools/preprocess_data.py"), "--input", str(corpus),
                           "--tokenizer-model", model, "--output-prefix", out, "--workers", str(workers)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    print(proc.stdout.strip(), flush=True)
    return float(re.search(r"\(([\d.]+) documents/s", proc.stdout).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--data-cache-path", default=str(pathlib.Path.home() / ".cache" / "loco_megatron"))
    args = ap.parse_args()
    _, model = ensure_default_corpus(args.data_cache_path, 4096)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = pathlib.Path(tmp) / "corpus.jsonl"
        docs = stdlib_documents()
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for _ in range(args.copies) for d in docs))
        one = run(corpus, model, f"{tmp}/one", 1)
        many = run(corpus, model, f"{tmp}/many", args.workers)
        same = all(pathlib.Path(f"{tmp}/one{e}").read_bytes() == pathlib.Path(f"{tmp}/many{e}").read_bytes()
                   for e in (".bin", ".idx"))
    print(f"\n| workers | documents/s | vs 1 worker |\n|---|---|---|\n| 1 | {one:.0f} | 1.000 |\n"
          f"| {args.workers} | {many:.0f} | {many / one:.3f} |\nidentical output: {same}")


if __name__ == "__main__":
    main()
