"""Reading documents from text or JSON-lines files (shared by the data tools)."""

import json
import pathlib
import sys
from typing import Iterator


def iter_documents(paths: list[str], json_key: str = "text") -> Iterator[str]:
    """One document per .jsonl line (its ``json_key``) or per blank-line-separated block
    of a text file. Exits with one line naming the file on unreadable input."""
    for path in paths:
        p = pathlib.Path(path)
        if not p.is_file():
            sys.exit(f"error: {path} does not exist")
        if p.suffix in (".jsonl", ".json"):
            with open(p, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield json.loads(line)[json_key]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        sys.exit(f"error: {path}:{n} is not a JSON object with a '{json_key}' field")
        else:
            block = []
            for line in open(p, encoding="utf-8", errors="replace"):
                if line.strip():
                    block.append(line)
                elif block:
                    yield "".join(block)
                    block = []
            if block:
                yield "".join(block)
