"""Reading documents from text or JSON-lines files (shared by the data tools).

Bad input ends the tool with one line naming the file and line (``InputError``), and
the tools leave no partial output. Policy for bytes that are not UTF-8: in ``.jsonl``
they are an error (JSON is UTF-8 by definition, so the file is damaged or mislabelled);
in ``.txt`` they are replaced by U+FFFD, with one warning per file giving the count and
the first line (plain-text dumps often hold a few stray Latin-1 bytes). ``.gz`` and
``.zst`` files (e.g. ``corpus.jsonl.zst``) are read compressed, by the same rules.
``.parquet`` files are read with pyarrow (one document per row of the text column, in
row order); a Hugging Face dataset (local folder or hub name) with the ``datasets``
library, an optional dependency (requirements-datasets.txt); a name that looks like a local
path (:mod:`loco_megatron.data.hub`) and does not exist is one line, never a hub look-up.
"""

import json
import pathlib
import sys
from typing import Iterator

from loco_megatron.config import one_line
from loco_megatron.data.hub import missing_path


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
        if p.suffix == ".parquet":
            docs = _parquet(p, json_key)
        elif suffixes and suffixes[-1] in (".jsonl", ".json"):
            docs = _jsonl(p, json_key)
        else:
            docs = _text(p)
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


def _parquet(p: pathlib.Path, column: str, batch_rows: int = 1024) -> Iterator[str]:
    """The ``column`` of a parquet file, row group by row group; null and empty rows are skipped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(p)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{p} is not a parquet file ({one_line(e)})") from None
    names = f.schema_arrow.names
    if column not in names:
        raise InputError(f"{p} has no column '{column}' (columns: {', '.join(names)}); choose one with --json-keys")
    kind = f.schema_arrow.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise InputError(f"{p}: column '{column}' holds {kind}, not text")
    for batch in f.iter_batches(batch_size=batch_rows, columns=[column]):
        for text in batch.column(0).to_pylist():
            if text:
                yield text


def iter_hf_dataset(name: str, column: str, subset=None, split: str = "train",
                    streaming: bool = False, offline: bool = False) -> Iterator[str]:
    """The ``column`` of a Hugging Face dataset: a folder written by ``save_to_disk``, a local
    dataset folder or data files, or a hub name (``streaming``: read as it downloads;
    ``offline``: HF_HUB_OFFLINE, which ``datasets`` reads too: the hub cache only). Raises
    InputError (one line) when ``datasets`` is missing or the dataset or column cannot be read."""
    missing = missing_path("--hf-dataset", name)
    if missing is not None:  # a local path: never looked up on the hub
        raise InputError(str(missing))
    try:
        import datasets
    except ImportError:
        raise InputError("--hf-dataset needs the datasets library: pip install -r requirements-datasets.txt") from None
    path = pathlib.Path(name).expanduser()
    try:
        if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
            if streaming:
                ds = ds.to_iterable_dataset()
        else:
            ds = datasets.load_dataset(name, subset, split=split, streaming=streaming)
    except Exception as e:  # FileNotFoundError, DatasetNotFoundError, ConnectionError, KeyError (split)...
        if offline and not path.exists():
            raise InputError(f"--hf-dataset: {name} is not a local folder, and as a Hugging Face hub dataset it "
                             f"could not be read from the local cache (HF_HUB_OFFLINE is set: nothing is "
                             f"downloaded; {type(e).__name__}: {one_line(e)})") from None
        raise InputError(f"--hf-dataset: {name} could not be loaded ({type(e).__name__}: {one_line(e)})") from None
    names = list(ds.column_names or [])
    if names and column not in names:
        raise InputError(f"--hf-dataset: {name} has no column '{column}' (columns: {', '.join(names)}); "
                         "choose one with --json-keys")
    count = 0
    for row in ds.select_columns([column]) if names else ds:  # streamed without features: no column names
        if column not in row:
            raise InputError(f"--hf-dataset: {name} has no column '{column}' (columns: {', '.join(row)}); "
                             "choose one with --json-keys")
        text = row[column]
        if text is not None and not isinstance(text, str):
            raise InputError(f"--hf-dataset: {name}: column '{column}' holds {type(text).__name__}, not text")
        if text:
            count += 1
            yield text
    if count == 0:
        raise InputError(f"--hf-dataset: {name} ({split}) holds no documents")


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
