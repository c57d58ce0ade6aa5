#!/usr/bin/env python3
"""torchrun whose failure report is one line and the failed worker's exit code.

    python tools/torchrun.py --standalone --nproc-per-node 2 pretrain_gpt.py --loco-bits 3

Takes torchrun's arguments and runs its launcher in this process (same agent, same signal
handling, same restarts). When a worker fails, torchrun itself prints its Python traceback
and a 20-line summary and exits 1 whatever the worker's exit code; this prints one line,
the summary's root cause (``pretrain_gpt.py: error: ...``, which pretrain_gpt.py writes
to torch elastic's error file), and exits with that worker's code: 2 for bad input, 3
for an abort (agreed by the ranks, or a rank not responding), 128 + N for a worker killed
by signal N. Used by
``tools/launch_single_node.sh`` and the Slurm templates (``tools/launch.py exec``).
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def root_cause(error: ChildFailedError) -> tuple[str, int]:
    """(one line: the first failed worker's rank and message, its exit code for this
    process: the worker's own, or 128 + N for signal N)."""
    rank, failure = error.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # an error file: the line pretrain_gpt.py wrote, or a traceback
        message = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
    lines = [line for line in str(message).splitlines() if line.strip()]
    what = lines[-1].strip() if lines else "no error message"
    if failure.exitcode < 0:
        return f"torchrun: rank {rank} was killed by {failure.signal_name()} ({what})", 128 - failure.exitcode
    return f"torchrun: rank {rank} failed with exit code {failure.exitcode}: {what}", failure.exitcode or 1


def main(argv: list[str]) -> int:
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        line, code = root_cause(e)
        print(line, file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
