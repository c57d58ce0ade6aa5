"""Command line: the only module that reads ``argv`` and the environment.

Flags are derived from the config dataclasses (Megatron-LM's names). Precedence:
dataclass defaults < ``--config FILE.yaml`` < command-line flags. Errors in flags,
config files or values end the process with one line naming the problem.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import os
import pathlib
import re
import sys
import textwrap
import time
import typing
from typing import Any, Callable, Optional, Sequence

import yaml

from loco_megatron.config import ALTERNATIVES, Config, ConfigError
from loco_megatron.config.base import RENAMED
from loco_megatron.error_report import report_error

if typing.TYPE_CHECKING:
    from loco_megatron.training.preflight import DryRunWorld

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny_gpt.yaml"


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What torchrun (or Slurm) told this process through the environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    cache_home: str = str(pathlib.Path.home() / ".cache")
    wandb_offline: bool = True
    wandb_dir: Optional[str] = None
    """WANDB_DIR: wandb's folder unless --wandb-save-dir is given (the Slurm templates
    point it into the run directory)."""
    triton_interpret: bool = False
    """TRITON_INTERPRET=1: Triton kernels run in its CPU interpreter (tests)."""
    init_method: str = "env://"
    """torch.distributed rendezvous: torchrun's env://, or a private TCP port for a
    single process started without torchrun."""
    distributed_timeout_s: Optional[float] = None
    """LOCO_DISTRIBUTED_TIMEOUT_S: collective timeout in seconds, overriding
    --distributed-timeout-minutes (hang drills and tests; not a flag on purpose)."""
    hf_hub_offline: bool = False
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set: a hub tokenizer is read from the hub cache only."""
    error_file: Optional[str] = None
    """TORCHELASTIC_ERROR_FILE: where torchrun reads why this worker failed; its failure
    summary shows that text as the root cause (None: not started by torchrun)."""
    started_at: float = dataclasses.field(default_factory=time.time)
    """When this process started (seconds since the epoch): a --stop-file older than this
    is left over from an earlier job."""
    launcher_pid: Optional[int] = None
    """The torchrun agent that started this rank (TORCHELASTIC_RUN_ID set: it is the parent
    process), watched so the ranks stop when it dies; None without torchrun."""
    store_at: Optional[tuple[str, int]] = None
    """(MASTER_ADDR, MASTER_PORT): the TCP store of the job's process groups (``env://``);
    None without them."""
    agent_store: bool = False
    """TORCHELASTIC_USE_AGENT_STORE=True (torch's default): the torchrun agent hosts that
    store and shares it with its ranks, across restarts of the worker group; False: rank 0
    hosts it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the launchers set) or no torchrun."""
    restart_count: int = 0
    """TORCHELASTIC_RESTART_COUNT: how often this rank's torchrun agent has restarted its
    worker group (--max-restarts); 0 for the first start."""
    agents: int = 1
    """GROUP_WORLD_SIZE: the torchrun agents (nodes) of the job."""

    @classmethod
    def from_environ(cls, environ=os.environ) -> "LaunchEnv":
        def as_int(name: str, default: int) -> int:
            return int(environ.get(name, default))

        offline = environ.get("WANDB_MODE", "") in ("offline", "disabled") or not (
            environ.get("WANDB_API_KEY") or pathlib.Path.home().joinpath(".netrc").exists()
        )
        init_method = "env://"
        if "MASTER_ADDR" not in environ and as_int("WORLD_SIZE", 1) == 1:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        return cls(
            init_method=init_method,
            rank=as_int("RANK", 0),
            world_size=as_int("WORLD_SIZE", 1),
            local_rank=as_int("LOCAL_RANK", 0),
            local_world_size=as_int("LOCAL_WORLD_SIZE", 1),
            cache_home=environ.get("XDG_CACHE_HOME", str(pathlib.Path.home() / ".cache")),
            wandb_offline=offline,
            wandb_dir=environ.get("WANDB_DIR") or None,
            triton_interpret=environ.get("TRITON_INTERPRET", "") == "1",
            distributed_timeout_s=float(environ["LOCO_DISTRIBUTED_TIMEOUT_S"])
            if environ.get("LOCO_DISTRIBUTED_TIMEOUT_S") else None,
            hf_hub_offline=hf_hub_offline(environ),
            error_file=environ.get("TORCHELASTIC_ERROR_FILE") or None,
            launcher_pid=os.getppid() if environ.get("TORCHELASTIC_RUN_ID") else None,
            store_at=(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]))
            if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT") else None,
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            restart_count=as_int("TORCHELASTIC_RESTART_COUNT", 0),
            agents=as_int("GROUP_WORLD_SIZE", 1),
        )


def hf_hub_offline(environ=os.environ) -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is 1/ON/YES/TRUE, as huggingface_hub reads it
    (for the tools, which share this module's reading of the environment)."""
    value = environ.get("HF_HUB_OFFLINE") or environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ("1", "ON", "YES", "TRUE")


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = nxt.value.value
    return docs


def _scalar_type(annotation) -> type:
    hints = typing.get_args(annotation) or (annotation,)
    return next(h for h in hints if h is not type(None))


def _sections() -> dict[str, type]:
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
            raise ConfigError(f"unknown flag {flag}{_did_you_mean(flag, _known_flags())}")
        return parsed


def _did_you_mean(word: str, known: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the one of ``known`` closest to a mistyped ``word``, or ""
    when none is genuinely close. The names are compared without their leading ``--``
    (shared by every flag, it made ``--foo-bar`` look 70% like ``--loco-beta``); 0.75 keeps
    a dropped or doubled letter (``--lr-warmup-iter``, ``--hiden-size``, ``--seq-len``)."""
    names = {k.lstrip("-"): k for k in known}
    close = difflib.get_close_matches(word.lstrip("-"), list(names), n=1, cutoff=0.75)
    return f" (did you mean {names[close[0]]}?)" if close else ""


def _known_flags() -> list[str]:
    """Every current flag (deprecated spellings left out, so they are never suggested)."""
    flags = ["--config", "--help"]
    for cls in _sections().values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            flags += [flag, "--no-" + flag[2:]] if _scalar_type(hints[f.name]) is bool else [flag]
    return flags


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
    for section, cls in _sections().items():
        group = parser.add_argument_group(section)
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            typ = _scalar_type(hints[f.name])
            help_ = f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%")
            if typ is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_)
            else:
                # Choices are shown, not enforced here: the dataclass check gives the one-line error.
                group.add_argument(flag, dest=f.name, type=typ, metavar=metavar_of(f, typ), help=help_)
    for old in RENAMED:  # deprecated spellings: accepted, hidden from --help
        parser.add_argument("--" + old.replace("_", "-"), dest=old, action=argparse.BooleanOptionalAction,
                            help=argparse.SUPPRESS)
    return parser


def _stderr_line(line: str) -> None:
    """``line`` and its newline in one write: stderr writes through, so ``print`` made two
    system calls, and two ranks' lines on one console ran together between them."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


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
    return {f.name: section for section, cls in _sections().items() for f in dataclasses.fields(cls)}


def load_yaml_config(path: str, note: Callable[[str], None] = _stderr_line) -> dict[str, Any]:
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
            hint = _did_you_mean(name.replace("_", "-"), [k.replace("_", "-") for k in known])
            raise ConfigError(f"--config: unknown key '{key}' in {path}{hint}")
        out[name] = value
    return _renamed(out, path, note)


def make_config(values: dict[str, Any], command_line: Sequence[str] = ()) -> Config:
    """Build a validated Config from {flag_name: value}; ``command_line``: the names of
    those given on the command line (see ``Config.command_line``)."""
    known = _all_keys()
    per_section: dict[str, dict[str, Any]] = {s: {} for s in _sections()}
    for name, value in _renamed(values).items():  # a run config saved before a rename still loads
        if name not in known:
            raise ConfigError(f"unknown option '{name}'")
        per_section[known[name]][name] = value
    sections = {}
    for section, cls in _sections().items():
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for name, value in per_section[section].items():
            typ = _scalar_type(hints[name])
            # bool is an int subclass: without the first test YAML's `num-layers: true` would be 1.
            if value is not None and ((isinstance(value, bool) and typ is not bool) or (
                    not isinstance(value, typ) and not (typ is float and isinstance(value, int)))):
                article = "an" if typ.__name__[0] in "aeiou" else "a"
                raise ConfigError(f"--{name.replace('_', '-')}: {value!r} is not {article} {typ.__name__}")
            kwargs[name] = float(value) if typ is float and value is not None else value
        sections[section] = cls(**kwargs)
    return Config(**sections, command_line=tuple(sorted(command_line)))


def parse_config(argv: Optional[Sequence[str]] = None, note: Callable[[str], None] = _stderr_line) -> Config:
    """Flags (and the config file they name) -> validated Config. Raises ConfigError.
    ``note`` prints the one-line notes on deprecated flags and keys."""
    return _parse(argv, note)[0]


def _parse(argv: Optional[Sequence[str]], note: Callable[[str], None] = _stderr_line,
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


def main_config(argv: Optional[Sequence[str]] = None) -> tuple[Config, LaunchEnv]:
    """Entry-point helper: parse or exit(2) with one line naming the problem."""
    config, env, _ = main_invocation(argv)
    return config, env


def main_invocation(argv: Optional[Sequence[str]] = None) -> tuple[Config, LaunchEnv, Optional[DryRunWorld]]:
    """(config, environment, the world size to dry-run or None for a real start); exit(2)
    with one line naming the problem. Deprecation notes are printed by rank 0 only."""
    rank = int(os.environ.get("RANK", "0"))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") or None
    try:
        config, launch = _parse(argv, _stderr_line if rank == 0 else (lambda line: None), data_files_first=True)
        env = LaunchEnv.from_environ()
        if not launch.get("dry_run"):
            if "world_size" in launch:
                raise ConfigError("--world-size: only with --dry-run (torchrun gives a real start its world size)")
            return config, env, None
        from loco_megatron.training.preflight import dry_run_world

        path = launch["config_file"]
        shown = str(DEFAULT_CONFIG.relative_to(REPO_ROOT)) if path == str(DEFAULT_CONFIG) else path
        launched = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE") else None
        return config, env, dry_run_world(launch.get("world_size"), launched, path, shown)
    except ConfigError as e:
        report_error(e, rank, error_file)
        raise SystemExit(2)
