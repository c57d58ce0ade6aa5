"""Local path or Hugging Face hub name: which one an argument is, and reading a hub name.

A tokenizer (``--tokenizer-model``) or dataset (``--hf-dataset``) argument is a **local
path**, never looked up on the hub, when any of these holds (:func:`local_path_reason`):

1. it exists here (a file or a folder);
2. it starts with ``/``, ``.`` or ``~``, contains ``\\``, or has more than one ``/`` (a hub
   name is ``NAME`` or ``ORG/NAME``);
3. it ends in a file extension of :data:`PATH_SUFFIXES` (``.model``, ``.json``, ``.bin``,
   ``.idx``, ...);
4. it is ``ORG/NAME`` and ``ORG`` is a folder here (``data/hf_tok`` when ``data/`` exists);
5. it has characters no hub name has (a hub name is letters, digits, ``-``, ``_`` and ``.``,
   at most 96 of them, not starting or ending with ``-`` or ``.``, without ``--`` or ``..``).

A local path that does not exist is one line at once. Anything else is a hub name, read
with ``huggingface_hub`` (every rank downloads what it needs into the hub cache); with
``HF_HUB_OFFLINE`` set (``offline``: :mod:`loco_megatron.cli` reads the environment) only
the cached copy is read. Both failures are :class:`InputNotHere`: a dry run can go on
without the tokenizer when told its vocabulary (``--dry-run-vocab-size``).
"""

from __future__ import annotations

import pathlib
import re
from typing import Optional, Sequence

from loco_megatron.config import ConfigError, one_line

PATH_SUFFIXES = (".model", ".json", ".bin", ".idx", ".txt", ".jsonl", ".parquet", ".gz", ".zst", ".vocab",
                 ".tiktoken", ".arrow", ".csv")
"""Endings that make an argument a file path (hub names may contain dots, but not end like a file)."""
_HUB_NAME = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
                       r"(?:/[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?)?$")
TOKENIZER_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.vocab")
"""What a hub tokenizer needs (tokenizer.json, tokenizer_config.json, config.json, vocab/merges,
a sentencepiece or tiktoken model), not the weights."""


class InputNotHere(ConfigError):
    """A tokenizer or dataset this machine cannot read: a local path that does not exist, or
    a hub name that is neither cached nor downloadable (offline, no network, no such repo)."""


def local_path_reason(name: str) -> Optional[str]:
    """Why ``name`` is a local path (see the module doc), or None when it may be a hub name."""
    p = pathlib.Path(name).expanduser()
    if p.exists():
        return "it exists here"
    if name.startswith(("/", ".", "~")):
        return f"it starts with {name[0]}"
    if "\\" in name or name.count("/") > 1:
        return "a hub name is NAME or ORG/NAME"
    if name.lower().endswith(PATH_SUFFIXES):
        return f"it ends in {pathlib.Path(name).suffix}"
    if "/" in name and pathlib.Path(name.split("/")[0]).is_dir():
        return f"{name.split('/')[0]}/ is a folder here"
    if not _HUB_NAME.match(name) or len(name) > 96:
        return "it has characters no hub name has"
    return None


def missing_path(flag: str, name: str) -> Optional[InputNotHere]:
    """The one-line error for a local-looking ``name`` that does not exist (None: it exists
    or may be a hub name)."""
    why = local_path_reason(name)
    if why is None or why == "it exists here":
        return None
    return InputNotHere(f"{flag}: {name} does not exist (read as a local path: {why})")


def hub_snapshot(flag: str, name: str, offline: bool, patterns: Sequence[str] = TOKENIZER_FILES) -> str:
    """The local folder holding hub repo ``name``'s files matching ``patterns``, downloaded
    into the hub cache unless ``offline`` (then the cached copy only). Raises InputNotHere
    (one line, the library's whole message) when it cannot be had."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(f"{flag}: reading the hub name {name} needs huggingface_hub: "
                          "pip install -r requirements.txt") from None
    try:
        return snapshot_download(name, allow_patterns=list(patterns), local_files_only=offline)
    except Exception as e:  # LocalEntryNotFoundError, RepositoryNotFoundError, HTTP and connection errors
        if offline:
            raise InputNotHere(f"{flag}: {name} is not a local file or folder, and as a Hugging Face hub name it "
                               "is not in the local hub cache (HF_HUB_OFFLINE is set: nothing is downloaded)") from None
        raise InputNotHere(f"{flag}: {name} is not a local file or folder, and as a Hugging Face hub name it could "
                           f"not be read ({type(e).__name__}: {one_line(e)})") from None
