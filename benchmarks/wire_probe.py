"""pretrain_gpt.py that reads its node's link counters between two training steps (for
``benchmarks/speed.py`` on the simulated cluster, ``benchmarks/simcluster.py``).

    LOCO_WIRE_PROBE=16,48 LOCO_WIRE_PROBE_OUT=DIR LOCO_WIRE_STORE_PORT=29555 \\
        torchrun ... benchmarks/wire_probe.py [pretrain_gpt.py flags]

Each node's local rank 0 reads, after everything the trainer does for step ``a`` (and then
``b``), before the next step starts: the bytes its link ``eth0`` sent (every byte that
left the node: a node's own ranks talk over its loopback) and, estimated per TCP
connection to another node (:func:`socket_tx`), what of them its connections with the
rendezvous store's port sent and what the others (gloo's) sent, and writes
``DIR/node<N>.json``: ``{"a": {"tx": ..., "store": ..., "other": ...}, "b": {...}}``. Between the two reads lie exactly steps
``a+1 .. b``: neither the start-up nor the end of the run, so per-step figures are the
steady state (DiLoCo's final outer step, which every run ends with, is left out).
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import loco_megatron.training.trainer as trainer  # noqa: E402
from loco_megatron.cli import main_config  # noqa: E402


def link_tx() -> int:
    return int(pathlib.Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


HEADER_BYTES = 66
"""Ethernet (14) + IPv4 (20) + TCP with timestamps (32) bytes per segment on the link."""


def socket_tx(port: int) -> dict:
    """Bytes this node's established TCP connections to other nodes sent, estimated on the
    link as payload plus :data:`HEADER_BYTES` per segment (``ss``'s ``bytes_sent`` and
    ``segs_out``): ``{"store": those with the store's ``port`` at either end, "other": the
    rest (gloo's)}``."""
    out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True).stdout
    sums, kind = {"store": 0, "other": 0}, None
    for line in out.splitlines():
        parts = line.split()
        if line and not line[0].isspace() and len(parts) >= 4:  # a socket: Recv-Q Send-Q local peer (info: indented)
            (lip, lport), (pip, pport) = parts[2].rsplit(":", 1), parts[3].rsplit(":", 1)
            kind = None if pip == lip else ("store" if port in (int(lport), int(pport)) else "other")
            continue
        if kind is not None:
            sent = re.search(r"bytes_sent:(\d+)", line)
            segs = re.search(r"segs_out:(\d+)", line)
            sums[kind] += (int(sent.group(1)) if sent else 0) + HEADER_BYTES * (int(segs.group(1)) if segs else 0)
        kind = None
    return sums


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    config, env = main_config(sys.argv[1:])
    a, b = (int(x) for x in os.environ["LOCO_WIRE_PROBE"].split(","))
    port = int(os.environ["LOCO_WIRE_STORE_PORT"])
    marks: dict = {}
    step, done = trainer.train_step, [0]

    def probed_step(*args, **kwargs):
        if done[0] in (a, b) and env.local_rank == 0:
            marks["a" if done[0] == a else "b"] = {"tx": link_tx(), **socket_tx(port)}
        done[0] += 1
        return step(*args, **kwargs)

    trainer.train_step = probed_step
    trainer.train(config, env)
    if env.local_rank == 0:
        out = pathlib.Path(os.environ["LOCO_WIRE_PROBE_OUT"]) / f"node{os.environ.get('GROUP_RANK', '0')}.json"
        out.write_text(json.dumps(marks))
