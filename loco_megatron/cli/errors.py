"""How bad input ends a run: one line, ``pretrain_gpt.py: error: ...``, printed once (by
rank 0, or by the rank where a per-rank error happened) and written to torchrun's error
file so its failure summary names it as the root cause; the caller exits with code 2.
Every layer of the data flow (CLI > config > set-up > train step > sync > checkpoint)
raises :class:`~loco_megatron.config.ConfigError` for bad input; this is where it is said."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Optional

from loco_megatron.config import ConfigError


def stderr_line(line: str) -> None:
    """``line`` and its newline in one write: stderr writes through, so ``print`` made two
    system calls, and two ranks' lines on one console ran together between them."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def report_error(error: ConfigError, rank: int, error_file: Optional[str] = None) -> None:
    """Print a bad-input error once per run: every rank meets the same validation error
    before the process group exists, so only rank 0 prints it; an error marked
    ``per_rank`` (raised after start-up, maybe on one rank only) prints where it happened.
    A rank that prints also writes the line to ``error_file`` (:attr:`LaunchEnv.error_file`),
    so torchrun's failure summary names it as the root cause, not ``error_file: <N/A>``; the
    others remove theirs (the traceback ``@record`` wrote there), so the summary shows the
    line once and never a traceback in its place."""
    line = f"pretrain_gpt.py: error: {error}"
    if rank == 0 or getattr(error, "per_rank", False):
        stderr_line(line)
        if error_file:
            write_error_file(error_file, line)
    else:
        if error_file:
            pathlib.Path(error_file).unlink(missing_ok=True)
        # torchrun stops every worker when the first one exits: leave rank 0 time to print.
        time.sleep(3.0)


def write_error_file(path: str, line: str) -> None:
    """``line`` as torch elastic's error file (the JSON of its ``ErrorHandler``): torchrun
    prints ``py_callstack`` after ``traceback :`` in its summary, so it is the line alone.
    Replaces what ``@record`` wrote there for the same exception (its Python traceback)."""
    info = {"py_callstack": line, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
    except OSError:  # the line is printed already; the summary then says <N/A>
        pass
