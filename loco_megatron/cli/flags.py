"""The command line's flags, derived from the config dataclasses: one flag per field
(Megatron-LM's names, ``--no-X`` for a bool), its help the field's docstring, grouped by
config section. The first step of the data flow (CLI > config > set-up > train step >
gradient/parameter sync > checkpoint and metrics): :mod:`.parse` turns what this parser
reads (and the ``--config`` file) into a validated :class:`~loco_megatron.config.Config`.
``tools/gen_config_docs.py`` writes docs/configuration.md from the same helpers."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import pathlib
import textwrap
import typing
from typing import Sequence

from loco_megatron.config import Config, ConfigError
from loco_megatron.config.base import RENAMED

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny_gpt.yaml"


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = nxt.value.value
    return docs


def scalar_type(annotation) -> type:
    """The type a field's value has when given (``Optional[int]`` -> ``int``)."""
    hints = typing.get_args(annotation) or (annotation,)
    return next(h for h in hints if h is not type(None))


def sections() -> dict[str, type]:
    """Config's section dataclasses by field name (``command_line`` is not a section)."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config) if dataclasses.is_dataclass(hints[f.name])}


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse's own error prints the whole usage (60 lines) and exits on every rank at
    once, so the ranks' output runs together; this one raises ConfigError instead, which
    ``main_config`` prints as one line, from rank 0 only."""

    def error(self, message: str):
        raise ConfigError(message)

    def parse_args(self, args=None, namespace=None):
        """An unknown flag is named in one line with the closest known one (a typo), not
        argparse's "unrecognized arguments: ..." list."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flag = next((u.split("=", 1)[0] for u in unknown if u.startswith("-")), None)
            if flag is None:
                raise ConfigError(f"unexpected argument {unknown[0]!r} (flags start with --)")
            raise ConfigError(f"unknown flag {flag}{did_you_mean(flag, known_flags())}")
        return parsed


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the one of ``known`` closest to a mistyped ``word``, or ""
    when none is genuinely close. The names are compared without their leading ``--``
    (shared by every flag, it made ``--foo-bar`` look 70% like ``--loco-beta``); 0.75 keeps
    a dropped or doubled letter (``--lr-warmup-iter``, ``--hiden-size``, ``--seq-len``)."""
    names = {k.lstrip("-"): k for k in known}
    close = difflib.get_close_matches(word.lstrip("-"), list(names), n=1, cutoff=0.75)
    return f" (did you mean {names[close[0]]}?)" if close else ""


def known_flags() -> list[str]:
    """Every current flag (deprecated spellings left out, so they are never suggested)."""
    flags = ["--config", "--help"]
    for cls in sections().values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            flags += [flag, "--no-" + flag[2:]] if scalar_type(hints[f.name]) is bool else [flag]
            flags += [negative_flag(f)] if negative_flag(f) else []
    return flags


def negative_flag(field: dataclasses.Field) -> str:
    """Megatron-LM's own spelling of a bool field's ``--no-X`` (``--muon-no-split-qkv``), or ""."""
    name = field.metadata.get("negative")
    return "--" + name.replace("_", "-") if name else ""


def metavar_of(field: dataclasses.Field, typ: type) -> str:
    """``{0,2,4,8}`` for a field with choices (:func:`loco_megatron.config.base.choice`), else
    the type's name (``INT``)."""
    choices = field.metadata.get("choices")
    return "{" + ",".join(str(c) for c in choices) + "}" if choices else typ.__name__.upper()


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="pretrain_gpt.py",
        description="Megatron-Core GPT/MoE pretraining with LoCo low-bit gradient communication.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,  # --loco-bit must not silently mean --loco-bits (Megatron-LM's choice too)
    )
    parser.add_argument("--config", help=f"YAML file of flag: value pairs (default {DEFAULT_CONFIG.name})")
    launch = parser.add_argument_group("launch (not run settings: never read from --config)")
    launch.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="validate the config and the layout for --world-size ranks as a real start "
                             "would, print the start-up summary with a memory estimate per GPU, and exit "
                             "(no processes, no torch.distributed)")
    launch.add_argument("--world-size", dest="world_size", type=int, metavar="INT",
                        help="with --dry-run: the ranks of the job to check (default: $WORLD_SIZE, else "
                             "the GPUs (or CPU ranks) the config file's header names: '# GPUs: 2 nodes x 8')")
    for section, cls in sections().items():
        group = parser.add_argument_group(section)
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            typ = scalar_type(hints[f.name])
            help_ = f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%")
            if typ is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_)
                if negative_flag(f):
                    group.add_argument(negative_flag(f), dest=f.name, action="store_false",
                                       help=f"Megatron-LM's spelling of --no-{flag[2:]}")
            else:
                # Choices are shown, not enforced here: the dataclass check gives the one-line error.
                group.add_argument(flag, dest=f.name, type=typ, metavar=metavar_of(f, typ), help=help_)
    for old in RENAMED:  # deprecated spellings: accepted, hidden from --help
        parser.add_argument("--" + old.replace("_", "-"), dest=old, action=argparse.BooleanOptionalAction,
                            help=argparse.SUPPRESS)
    return parser
