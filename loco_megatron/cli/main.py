"""The entry point's use of the command line: parse the flags, read the launcher's
environment, and decide between a real start and a dry run; bad input ends here with one
line and exit code 2. The first step of the data flow (CLI > config > set-up > train step >
gradient/parameter sync > checkpoint and metrics); ``pretrain_gpt.py`` hands its result to
the trainer or to :func:`loco_megatron.training.preflight.dry_run`."""

from __future__ import annotations

import os
import typing
from typing import Optional, Sequence

from loco_megatron.cli.environment import LaunchEnv
from loco_megatron.cli.errors import report_error, stderr_line
from loco_megatron.cli.flags import DEFAULT_CONFIG, REPO_ROOT
from loco_megatron.cli.parse import parse
from loco_megatron.config import Config, ConfigError

if typing.TYPE_CHECKING:
    from loco_megatron.training.preflight import DryRunWorld


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
        config, launch = parse(argv, stderr_line if rank == 0 else (lambda line: None), data_files_first=True)
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
