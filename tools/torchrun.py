#!/usr/bin/env python3
"""torchrun whose failure report is one line and the failed worker's exit code.

    python tools/torchrun.py --standalone --nproc-per-node 2 pretrain_gpt.py --loco-bits 3

Takes torchrun's arguments and runs its launcher in this process (same agent, same signal
handling, same restarts). When a worker fails, torchrun itself prints its Python traceback
and a 20-line summary and exits 1 whatever the worker's exit code; this prints one line,
the summary's root cause (``pretrain_gpt.py: error: ...``, which pretrain_gpt.py writes
to torch elastic's error file), and exits with that worker's code: 2 for bad input, 3
for an abort (agreed by the ranks, or a rank not responding), 128 + N for a worker killed
by signal N. Stopped itself by a signal N (scancel, preemption: torchrun forwards it to the
workers, which save and stop, and re-raises it once they have exited), it prints one line
instead of torchrun's traceback and exits 128 + N. Used by
``tools/launch_single_node.sh`` and the Slurm templates (``tools/launch.py exec``).

On several nodes with ``--rdzv-conf is_host=true|false`` (``tools/launch.py`` passes it),
the node that hosts the c10d rendezvous store keeps it until every other node's agent has
closed the rendezvous (at most :data:`HOST_WAIT_S`). Left to torchrun, the host's agent
exits as soon as its own workers have, taking the store with it, and an agent still
finishing elsewhere logs a C++ stack trace ("recvVector failed"), failed keep-alives and
"failed to shutdown the rendezvous" at the end of a run that went well.
"""

from __future__ import annotations

import signal
import sys
import time
from datetime import timedelta
from typing import Optional

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import parse_args, run

HOST_WAIT_S = 60
"""How long the store's host waits for the other nodes' agents at the end."""


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


class StoreKeeper:
    """The end-of-run barrier of the c10d store's nodes (see the module docstring). The host
    holds its own handle on the store's server (``multi_tenant``: the agent's rendezvous
    backend shares it), so the server outlives the agent; every other node adds one to a
    counter once its agent has closed the rendezvous; the host leaves when all have."""

    def __init__(self, args):
        conf = dict(kv.strip().split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
        nodes = str(args.nnodes)
        self.active = (args.rdzv_backend == "c10d" and nodes.isdigit() and int(nodes) > 1
                       and conf.get("is_host", "").lower() in ("true", "false"))
        if not self.active:
            return
        self.host, self.port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        self.is_host, self.others = conf["is_host"].lower() == "true", int(nodes) - 1
        self.key = f"loco/{args.rdzv_id}/agents_closed"
        self.store: Optional[TCPStore] = None
        if self.is_host:  # before the agent creates the same server, so this handle shares it
            try:
                self.store = TCPStore(self.host, self.port, is_master=True, multi_tenant=True,
                                      wait_for_workers=False, timeout=timedelta(seconds=HOST_WAIT_S))
            except (RuntimeError, ValueError):  # e.g. the port is taken: torchrun's own start says so
                self.active = False

    def at_end(self) -> None:
        if not self.active:
            return
        try:
            if not self.is_host:
                TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=10)).add(self.key, 1)
                return
            deadline = time.monotonic() + HOST_WAIT_S
            while self.store.add(self.key, 0) < self.others and time.monotonic() < deadline:
                time.sleep(0.1)
        except (RuntimeError, ValueError, TimeoutError):  # the store gone or never reached: nothing to wait for
            pass


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    keeper = StoreKeeper(args)
    code = 0
    try:
        run(args)
    except ChildFailedError as e:
        line, code = root_cause(e)
        print(line, file=sys.stderr, flush=True)
    except SignalException as e:  # every node is being stopped: no barrier
        print(f"torchrun: stopped by {signal.Signals(e.sigval).name}, forwarded to the workers, which have exited",
              file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    keeper.at_end()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
