"""Reading documents from text or JSON-lines files (shared by the data tools)."""

import json
import pathlib
import sys
from typing import Iterator


def _open_text(p: pathlib.Path):
    """Text stream of a plain, gzip (.gz) or zstandard (.zst) file."""
    if p.suffix == ".gz":
        import gzip

        return gzip.open(p, "rt", encoding="utf-8", errors="replace")
    if p.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            sys.exit(f"error: {p} is zstandard-compressed: pip install zstandard")
        import io

        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(open(p, "rb")), encoding="utf-8",
                                errors="replace")
    return open(p, encoding="utf-8", errors="replace")


def iter_documents(paths: list[str], json_key: str = "text") -> Iterator[str]:
    """One document per .jsonl line (its ``json_key``) or per blank-line-separated block
    of a text file; .jsonl.gz / .jsonl.zst / .txt.gz / .txt.zst are read compressed.
    Exits with one line naming the file on unreadable input."""
    for path in paths:
        p = pathlib.Path(path)
        if not p.is_file():
            sys.exit(f"error: {path} does not exist")
        suffixes = [s for s in p.suffixes if s not in (".gz", ".zst")]
        if suffixes and suffixes[-1] in (".jsonl", ".json"):
            with _open_text(p) as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield json.loads(line)[json_key]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        sys.exit(f"error: {path}:{n} is not a JSON object with a '{json_key}' field")
        else:
            block = []
            for line in _open_text(p):
                if line.strip():
                    block.append(line)
                elif block:
                    yield "".join(block)
                    block = []
            if block:
                yield "".join(block)
