"""How bad input ends a run: one line, ``pretrain_gpt.py: error: ...``, printed once and
written to torchrun's error file so its failure summary names it as the root cause
(:mod:`loco_megatron.error_report` decides which rank prints); the caller exits with
code 2. Every layer of the data flow (CLI > config > set-up > train step > sync >
checkpoint) raises :class:`~loco_megatron.config.ConfigError` for bad input."""

from __future__ import annotations

import sys

from loco_megatron.error_report import report_error, write_error_file

__all__ = ["report_error", "stderr_line", "write_error_file"]


def stderr_line(line: str) -> None:
    """``line`` and its newline in one write: stderr writes through, so ``print`` made two
    system calls, and two ranks' lines on one console ran together between them."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
