"""Command line: the only package that reads ``argv`` and the environment, the first step
of the data flow (CLI > config > set-up > train step > gradient/parameter sync >
checkpoint and metrics).

Flags are derived from the config dataclasses (Megatron-LM's names; :mod:`.flags`).
Precedence: dataclass defaults < ``--config FILE.yaml`` < command-line flags (:mod:`.parse`).
The launcher's environment: :mod:`.environment`. Errors in flags, config files or values
end the process with one line naming the problem (:mod:`.errors`, :mod:`.main`).
"""

from loco_megatron.cli.environment import LaunchEnv, hf_hub_offline
from loco_megatron.cli.errors import report_error, write_error_file
from loco_megatron.cli.flags import DEFAULT_CONFIG, REPO_ROOT, build_parser, metavar_of
from loco_megatron.cli.main import main_config, main_invocation
from loco_megatron.cli.parse import load_yaml_config, make_config, parse_config

__all__ = ["LaunchEnv", "hf_hub_offline", "report_error", "write_error_file", "DEFAULT_CONFIG", "REPO_ROOT",
           "build_parser", "metavar_of", "main_config", "main_invocation", "load_yaml_config", "make_config",
           "parse_config"]
