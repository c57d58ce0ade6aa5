"""The one error line of a failed run, printed once and recorded as torchrun's root cause.

Under torchrun a failing worker's line must survive the launcher's teardown (torchrun
stops every worker as soon as one exits) and reach its failure summary (the error file it
reads). :func:`report_error` decides which rank prints; :func:`emit_error` prints and
records; :func:`first_to_report` lets exactly one rank of a torchrun agent claim a line.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import Optional

from loco_megatron.config import ConfigError


def report_error(error: ConfigError, rank: int, error_file: Optional[str] = None) -> None:
    """Print a bad-input error once per run, whole, and never lose it to torchrun's teardown.

    Every rank meets a start-up error (flags, config, data files, the layout) on its own,
    before the process group exists, and at its own time: on a loaded machine one rank may
    still be importing torch while another has found the error. torchrun stops every
    worker as soon as one exits, so the rank that prints must be the first to exit: the
    first rank of this torchrun agent to get here claims the line (:func:`first_to_report`),
    prints it and returns at once; the others wait for torchrun to stop them
    (:data:`CLAIM_WAIT_S` at most). Without torchrun rank 0 prints and the others give it
    3 s. An error the ranks ``agreed`` on in a collective (raised by every rank at the
    same step, as :class:`~loco_megatron.training.health.RunAborted`) is printed by rank
    0, the others giving it 3 s; one marked ``per_rank`` (raised after start-up, maybe
    on one rank only) prints where it happened.

    A rank that prints also writes the line to ``error_file`` (:attr:`loco_megatron.cli.LaunchEnv.error_file`),
    so torchrun's failure summary names it as the root cause, not ``error_file: <N/A>``; the
    others remove theirs (the traceback ``@record`` wrote there), so the summary shows the
    line once and never a traceback in its place."""
    if getattr(error, "per_rank", False):
        prints, wait = True, 0.0
    elif getattr(error, "agreed", False) or _attempt_folder(error_file) is None:
        prints, wait = rank == 0, 3.0
    else:
        prints, wait = first_to_report(error_file), CLAIM_WAIT_S
    if prints:
        emit_error(str(error), error_file)
        return
    if error_file:
        pathlib.Path(error_file).unlink(missing_ok=True)
    time.sleep(wait)  # torchrun stops this rank once the printing one has exited


CLAIM_WAIT_S = 60.0
"""How long a rank that lost the claim on a start-up error's line waits for torchrun to
stop it (the claimant exits right after printing; torchrun checks its workers every 0.1 s)."""


def _attempt_folder(error_file: Optional[str]) -> Optional[pathlib.Path]:
    """The folder torchrun's agent makes for this start of its worker group and shares
    among its ranks (``<log dir>/attempt_N/<local rank>/error.json`` holds ``error_file``);
    None without torchrun."""
    folder = pathlib.Path(error_file).parent.parent if error_file else None
    return folder if folder is not None and folder.name.startswith("attempt_") else None


def first_to_report(error_file: Optional[str]) -> bool:
    """Whether this rank is the first of its torchrun agent's ranks to report an error in
    this attempt: it creates a marker in :func:`_attempt_folder` (atomic: exactly one rank
    succeeds). Without torchrun, or in a folder it cannot write to, every rank is (duplicate
    lines rather than none)."""
    folder = _attempt_folder(error_file)
    if folder is None:
        return True
    try:
        os.close(os.open(folder / "error_line_claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def emit_error(message: str, error_file: Optional[str]) -> None:
    """``pretrain_gpt.py: error: {message}`` on stderr and as torchrun's error file (the
    root cause of its failure summary)."""
    line = f"pretrain_gpt.py: error: {message}"
    # One write: ``print`` writes the text and its newline apart on an unbuffered stderr,
    # and another rank's line could land between them.
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if error_file:
        write_error_file(error_file, line)


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
