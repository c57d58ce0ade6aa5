"""Reading documents from text or JSON-lines files (shared by the data tools).

Bad input ends the tool with one line naming the file and line (``InputError``), and
the tools leave no partial output. Policy for bytes that are not UTF-8: in ``.jsonl``
they are an error (JSON is UTF-8 by definition, so the file is damaged or mislabelled);
in ``.txt`` they are replaced by U+FFFD, with one warning per file giving the count and
the first line (plain-text dumps often hold a few stray Latin-1 bytes). ``.gz`` and
``.zst`` files (e.g. ``corpus.jsonl.zst``) are read compressed, by the same rules.
"""

import json
import pathlib
import sys
from typing import Iterator


class InputError(Exception):
    """Unusable input; the message is the one line to print."""


def _open_binary(p: pathlib.Path):
    """Binary stream of a plain, gzip (.gz) or zstandard (.zst) file."""
    if p.suffix == ".gz":
        import gzip

        return gzip.open(p, "rb")
    if p.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise InputError(f"{p} is zstandard-compressed: pip install zstandard") from None
        import io

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(p, "rb")))
    return open(p, "rb")


def iter_documents(paths: list[str], json_key: str = "text") -> Iterator[str]:
    """One document per .jsonl line (its ``json_key``) or per blank-line-separated block
    of a text file. Raises InputError naming the file (and line) on unusable input,
    including inputs that hold no document at all."""
    count = 0
    for path in paths:
        p = pathlib.Path(path)
        if not p.is_file():
            raise InputError(f"{path} does not exist")
        suffixes = [x for x in p.suffixes if x not in (".gz", ".zst")]
        docs = _jsonl(p, json_key) if suffixes and suffixes[-1] in (".jsonl", ".json") else _text(p)
        for doc in docs:
            count += 1
            yield doc
    if count == 0:
        raise InputError(f"{', '.join(paths)} holds no documents")


def _jsonl(p: pathlib.Path, json_key: str) -> Iterator[str]:
    with _open_binary(p) as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{p}:{n} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                text = json.loads(line)[json_key]
            except (json.JSONDecodeError, KeyError, TypeError, IndexError):
                raise InputError(f"{p}:{n} is not a JSON object with a '{json_key}' field") from None
            if not isinstance(text, str):
                raise InputError(f"{p}:{n}: '{json_key}' is not a string")
            if text:
                yield text


def _text(p: pathlib.Path) -> Iterator[str]:
    block: list[str] = []
    bad_lines, first_bad = 0, 0
    with _open_binary(p) as f:
        for n, raw in enumerate(f, 1):
            line = raw.decode("utf-8", errors="replace")
            if "\ufffd" in line and b"\xef\xbf\xbd" not in raw:
                bad_lines, first_bad = bad_lines + 1, first_bad or n
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block)
                block = []
    if block:
        yield "".join(block)
    if bad_lines:
        print(f"warning: {p}: {bad_lines} line(s) with bytes that are not UTF-8, replaced by U+FFFD "
              f"(first at line {first_bad})", file=sys.stderr)


def fail(message: str) -> None:
    """End a data tool with one line and exit code 2 (bad input)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
