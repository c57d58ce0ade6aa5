"""Flags and the ``--config`` file they name to a validated
:class:`~loco_megatron.config.Config`: the step from the command line to the config in the
data flow (CLI > config > set-up > train step > gradient/parameter sync > checkpoint and
metrics). Precedence: dataclass defaults < ``--config FILE.yaml`` < command-line flags;
deprecated spellings become their replacements with one note each; a bad value raises
:class:`~loco_megatron.config.ConfigError` naming the flag, or the file and key it came from."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import typing
from typing import Any, Callable, Optional, Sequence

import yaml

from loco_megatron.cli.errors import stderr_line
from loco_megatron.cli.flags import DEFAULT_CONFIG, build_parser, did_you_mean, scalar_type, sections
from loco_megatron.config import ALTERNATIVES, Config, ConfigError
from loco_megatron.config.base import RENAMED


def _renamed(values: dict[str, Any], config_file: Optional[str] = None,
             note: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """``values`` with deprecated options (:data:`RENAMED`) turned into their replacements,
    which hold the opposite value; a replacement given too wins. ``note`` (None: silent, for
    saved run configs) gets one line per deprecated flag, or key of ``config_file``."""
    out = dict(values)
    for old, (new, flag_off, flag_on) in RENAMED.items():
        if old not in out:
            continue
        value = out.pop(old)
        if note is not None and config_file is None:
            spelled = ("--" if value else "--no-") + old.replace("_", "-")
            note(f"pretrain_gpt.py: note: {spelled} is deprecated; use {flag_off if value else flag_on}")
        elif note is not None:
            note(f"pretrain_gpt.py: note: {config_file}: key {old.replace('_', '-')} is deprecated; "
                 f"use {new.replace('_', '-')}: {str(not value).lower()}")
        out.setdefault(new, not value if isinstance(value, bool) else value)
    return out


def _all_keys() -> dict[str, str]:
    """flag name (underscored) -> config section."""
    return {f.name: section for section, cls in sections().items() for f in dataclasses.fields(cls)}


def load_yaml_config(path: str, note: Callable[[str], None] = stderr_line) -> dict[str, Any]:
    """{flag_name: value} of a --config file; ConfigError for an unknown key (naming the
    closest known one); deprecated keys are renamed, with one ``note`` line each."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: {path} does not exist")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: {path} must be a mapping of flag: value")
    known = _all_keys()
    out = {}
    for key, value in raw.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in known and name not in RENAMED:
            hint = did_you_mean(name.replace("_", "-"), [k.replace("_", "-") for k in known])
            raise ConfigError(f"--config: unknown key '{key}' in {path}{hint}")
        out[name] = value
    return _renamed(out, path, note)


def make_config(values: dict[str, Any], command_line: Sequence[str] = ()) -> Config:
    """Build a validated Config from {flag_name: value}; ``command_line``: the names of
    those given on the command line (see ``Config.command_line``)."""
    known = _all_keys()
    per_section: dict[str, dict[str, Any]] = {s: {} for s in sections()}
    for name, value in _renamed(values).items():  # a run config saved before a rename still loads
        if name not in known:
            raise ConfigError(f"unknown option '{name}'")
        per_section[known[name]][name] = value
    built = {}
    for section, cls in sections().items():
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for name, value in per_section[section].items():
            typ = scalar_type(hints[name])
            # bool is an int subclass: without the first test YAML's `num-layers: true` would be 1.
            if value is not None and ((isinstance(value, bool) and typ is not bool) or (
                    not isinstance(value, typ) and not (typ is float and isinstance(value, int)))):
                article = "an" if typ.__name__[0] in "aeiou" else "a"
                raise ConfigError(f"--{name.replace('_', '-')}: {value!r} is not {article} {typ.__name__}")
            kwargs[name] = float(value) if typ is float and value is not None else value
        built[section] = cls(**kwargs)
    return Config(**built, command_line=tuple(sorted(command_line)))


def parse_config(argv: Optional[Sequence[str]] = None, note: Callable[[str], None] = stderr_line) -> Config:
    """Flags (and the config file they name) -> validated Config. Raises ConfigError.
    ``note`` prints the one-line notes on deprecated flags and keys."""
    return parse(argv, note)[0]


def parse(argv: Optional[Sequence[str]], note: Callable[[str], None] = stderr_line,
          data_files_first: bool = False) -> tuple[Config, dict[str, Any]]:
    """(validated Config, the launch options given: ``dry_run``, ``world_size``; and
    ``config_file``, the --config file read). ``data_files_first`` (a real start): a missing
    dataset file is the error, before whatever the values' validation would say about the
    rest (e.g. that --tokenizer-model is required with --data-path)."""
    args = _renamed(vars(build_parser().parse_args(argv)), note=note)
    launch = {k: args.pop(k) for k in ("dry_run", "world_size") if k in args}
    config_path = args.pop("config", str(DEFAULT_CONFIG))
    launch["config_file"] = config_path
    values = load_yaml_config(config_path, note)
    for name, (other, off) in ALTERNATIVES.items():
        if name in args and other not in args:
            values[other] = off
    from_file = set(values) - set(args)
    values.update(args)
    if data_files_first and not launch.get("dry_run"):
        from loco_megatron.data.inputs import check_data_files

        check_data_files(*(values.get(k) for k in ("data_path", "train_data_path", "valid_data_path")))
    try:
        return make_config(values, command_line=args), launch
    except ConfigError as e:
        raise _naming_the_file(e, config_path, from_file, set(args)) from None


def _naming_the_file(error: ConfigError, path: str, from_file: set[str], given: set[str]) -> ConfigError:
    """``error`` (``--flag: why``) as ``--config: PATH, key flag: why`` when the value of
    ``flag`` came from the config file at ``path`` (``from_file``) and ``why`` names no flag
    given on the command line (``given``: then the flags say it best), so the user knows
    which file to edit; unchanged otherwise."""
    flag, sep, why = str(error).partition(": ")
    named = {m.replace("-", "_") for m in re.findall(r"--([a-z][a-z0-9-]*)", why)}
    if sep and flag.startswith("--") and flag[2:].replace("-", "_") in from_file and not named & given:
        return ConfigError(f"--config: {path}, key {flag[2:]}: {why}")
    return error
