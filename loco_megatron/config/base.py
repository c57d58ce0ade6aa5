"""What every config module shares: the error type, the check helpers, fields with a
fixed set of values, and the flags that replace each other."""

from __future__ import annotations

import dataclasses
import re
from typing import Any


class ConfigError(ValueError):
    """A bad flag or config value. The message names the flag."""


def one_line(e: BaseException) -> str:
    """``e``'s whole message on one line (line breaks and runs of spaces become one space),
    or its type's name when it has none: a library's error shown in full, never cut."""
    return " ".join(str(e).split()) or type(e).__name__


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\[])")
"""Where a sentence ends in an error message: a full stop (or ! ?) and a space before a
capital or a bracket; not the dots inside a path or a number (``common.pt``, ``2.00 GiB``)."""


def brief(e: BaseException, limit: int = 200) -> str:
    """``e`` for a one-line error: ``Type: first sentence`` (torch's "PytorchStreamReader
    failed reading zip archive: failed finding central directory. This is an internal miniz
    error. If you are seeing..." keeps its first sentence), or the type's name when it has no
    message. A first sentence over ``limit`` characters ends at the first space after it,
    with " ...": a word, a path or a number is never cut in two."""
    text = " ".join(str(e).split())
    if not text:
        return type(e).__name__
    sentence = _SENTENCE_END.split(text, 1)[0].rstrip(".")
    cut = sentence.find(" ", limit)
    if cut != -1:
        sentence = sentence[:cut] + " ..."
    return f"{type(e).__name__}: {sentence}"


ALTERNATIVES = {"lr_warmup_iters": ("lr_warmup_fraction", None), "lr_warmup_fraction": ("lr_warmup_iters", 0)}
"""Flags that replace each other: setting one on the command line resets the other (to the
given value) when it came from the config file."""

RENAMED = {"loco_no_error_feedback": ("loco_error_feedback", "--no-loco-error-feedback", "--loco-error-feedback")}
"""Old boolean option -> (its replacement, which holds the opposite value; the new spelling
of the old flag; the new spelling of the old flag's negation). The old names are still
accepted (flags and config-file keys with a one-line note; saved run configs silently)."""


def require(cond: bool, flag: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"--{flag.replace('_', '-')}: {msg}")


def choice(default: Any, allowed: tuple) -> Any:
    """A dataclass field whose value must be one of ``allowed`` (or None when ``default`` is
    None: "unset"). The one list of the values: :func:`check_choices` validates against it,
    and ``--help`` and docs/configuration.md show it."""
    return dataclasses.field(default=default, metadata={"choices": tuple(allowed)})


def choices_of(cls, name: str) -> tuple:
    """The allowed values of field ``name`` of dataclass ``cls`` (() when it is not a choice)."""
    return next(f.metadata.get("choices", ()) for f in dataclasses.fields(cls) if f.name == name)


def check_choices(obj) -> None:
    """ConfigError (naming the flag) for the first choice field of dataclass instance
    ``obj`` whose value is not one of its choices."""
    for f in dataclasses.fields(obj):
        allowed = f.metadata.get("choices")
        value = getattr(obj, f.name)
        if allowed is None or (value is None and f.default is None):
            continue
        # bool is an int: True must not pass for 1 (nor 1.0 for 1).
        ok = any(value == a and type(value) is type(a) for a in allowed)
        shown = repr(value) if isinstance(value, str) else str(value)
        require(ok, f.name, f"{shown} is not one of {', '.join(str(a) for a in allowed)}")
