#!/usr/bin/env python3
"""A small bandwidth-limited cluster on one Linux machine (needs root and ``ip netns``).

K "nodes", each its own network namespace with one interface ``eth0`` (10.R.0.i+1/24),
are joined through veth links to a bridge in a separate namespace. Every node link is
shaped with ``tc`` in both directions (a ``tbf`` rate limit, optionally a ``netem``
delay under it), so inter-node traffic crosses a slow link, while traffic between
ranks of the same node goes to the node's own address and stays on its loopback.

One ``torchrun --nnodes K --node-rank i`` runs per node (static rendezvous on node 0's
address over the simulated network). Everything created here is removed afterwards,
also on Ctrl-C, on failure and on timeout; all traffic stays inside these namespaces.

    sudo python benchmarks/simcluster.py --nodes 2 --nproc-per-node 1 --rate 1gbit --delay 1ms \\
        --timeout 600 -- pretrain_gpt.py --loco-bits 4 --train-iters 20

Measured when this was written: a ``tbf`` at 1 Gbit/s cut a 2-rank gloo all-reduce of
100 MB from 1.6 GB/s to 62 MB/s, so gloo traffic obeys the shaping.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

REPO = pathlib.Path(__file__).resolve().parent.parent


class SimClusterError(RuntimeError):
    pass


def available() -> Optional[str]:
    """None when this machine can build a simulated cluster, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (iproute2)"
    probe = f"lcprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if ok else "cannot create network namespaces here ('ip netns add' failed)"


def _sh(*cmd: str) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SimClusterError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


class SimCluster:
    """Context manager: ``with SimCluster(2, rate="1gbit") as c: c.run_torchrun(...)``.

    ``rate`` is a tc rate (``"1gbit"``, ``"100mbit"``) or None for an unshaped link;
    ``delay`` a netem delay (``"1ms"``) or None. ``subnet``: the X of 10.X.0.0/24 (default
    from the process id). ``host_link``: also plug this machine itself into the switch, as
    :attr:`host_address` (10.X.0.254, an unshaped veth ``lc<tag>h``), so that daemons on
    the host (a Slurm controller) and the nodes reach each other.
    """

    def __init__(self, nodes: int, rate: Optional[str] = "1gbit", delay: Optional[str] = None,
                 tag: Optional[str] = None, subnet: Optional[int] = None, host_link: bool = False):
        if not 1 <= nodes <= 200:
            raise ValueError("nodes must be in [1, 200]")
        self.nodes, self.rate, self.delay = nodes, rate, delay
        self.tag = tag or f"{os.getpid() % 100000}"
        self.subnet = 10 + os.getpid() % 200 if subnet is None else subnet  # 10.<subnet>.0.0/24, private
        self.bridge_ns = f"lcsim{self.tag}br"
        self.node_ns = [f"lcsim{self.tag}n{i}" for i in range(nodes)]
        self.host_link = f"lc{self.tag}h" if host_link else None
        self._created: list[str] = []
        self._host_link_made = False

    def address(self, node: int) -> str:
        return f"10.{self.subnet}.0.{node + 1}"

    @property
    def host_address(self) -> str:
        return f"10.{self.subnet}.0.254"

    # -- set-up and tear-down ------------------------------------------------------------
    def __enter__(self) -> "SimCluster":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._created.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate is None and self.delay is None:
            return
        if self.rate is not None:
            # burst: at least one 1500-byte packet per timer tick at this rate.
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
                "tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms")
            if self.delay is not None:
                self._netem(ns, dev, "parent", "1:1", "handle", "10:")
        else:
            self._netem(ns, dev, "root")

    def _netem(self, ns: str, dev: str, *where: str) -> None:
        try:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *where, "netem", "delay", self.delay)
        except SimClusterError as e:
            if "unknown" in str(e).lower():
                raise SimClusterError("--delay needs the sch_netem kernel module, which this kernel "
                                      "does not have; run without --delay") from None
            raise

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(self.node_ns):
            self._add_ns(ns)
            node_end, bridge_end = f"lc{self.tag}n{i}", f"lc{self.tag}b{i}"
            # Created inside the node namespace, so nothing ever appears in the host's.
            _sh("ip", "-n", ns, "link", "add", node_end, "type", "veth", "peer", "name", bridge_end,
                "netns", self.bridge_ns)
            _sh("ip", "-n", ns, "link", "set", node_end, "name", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", self.bridge_ns, "link", "set", bridge_end, "master", "br0")
            _sh("ip", "-n", self.bridge_ns, "link", "set", bridge_end, "up")
            self._shape(ns, "eth0")                 # node -> switch
            self._shape(self.bridge_ns, bridge_end)  # switch -> node
        if self.host_link:
            bridge_end = f"lc{self.tag}hb"
            self._host_link_made = True  # from here on close() deletes it, also after a half-made add
            _sh("ip", "link", "add", self.host_link, "type", "veth", "peer", "name", bridge_end, "netns", self.bridge_ns)
            _sh("ip", "addr", "add", f"{self.host_address}/24", "dev", self.host_link)
            _sh("ip", "link", "set", self.host_link, "up")
            _sh("ip", "-n", self.bridge_ns, "link", "set", bridge_end, "master", "br0")
            _sh("ip", "-n", self.bridge_ns, "link", "set", bridge_end, "up")

    def close(self) -> None:
        """Delete every namespace this cluster made (their veths and qdiscs go with them) and
        the host's veth with its route (deleted by name: a namespace outlives its name while
        a process still holds it)."""
        if self._host_link_made:
            subprocess.run(["ip", "link", "del", self.host_link], capture_output=True)
            self._host_link_made = False
        for ns in reversed(self._created):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created.clear()

    def leftovers(self) -> list[str]:
        """Namespaces with this cluster's names, and its host veth, that still exist (should
        be none after close)."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = {line.split()[0] for line in out.splitlines() if line.strip()}
        if self.host_link and subprocess.run(["ip", "link", "show", self.host_link], capture_output=True).returncode == 0:
            names.add(self.host_link)
        return sorted(names & {self.bridge_ns, *self.node_ns, self.host_link})

    def tx_bytes(self) -> int:
        """Bytes sent so far by all nodes on their link (``eth0``): inter-node traffic only,
        since a node's own ranks talk over its loopback."""
        total = 0
        for ns in self.node_ns:
            out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                                 capture_output=True, text=True)
            total += int(out.stdout.strip() or 0)
        return total

    # -- running -------------------------------------------------------------------------
    def run_torchrun(self, script_and_args: list[str], nproc_per_node: int, timeout: float,
                     env: Optional[dict] = None, log_dir: Optional[pathlib.Path] = None,
                     port: int = 29555, on_poll=None) -> list[subprocess.CompletedProcess]:
        """Run ``torchrun`` on every node; returns one finished process per node.

        Raises :class:`SimClusterError` naming the node on failure or timeout (all nodes'
        processes are killed first). ``on_poll()`` is called about every 0.2 s meanwhile.
        """
        procs, logs = [], []
        base_env = dict(os.environ, **(env or {}))
        base_env.update(GLOO_SOCKET_IFNAME="eth0", NCCL_SOCKET_IFNAME="eth0",
                        PYTHONPATH=str(REPO) + os.pathsep + base_env.get("PYTHONPATH", ""))
        for i, ns in enumerate(self.node_ns):
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={self.nodes}", f"--node-rank={i}", f"--nproc-per-node={nproc_per_node}",
                   f"--master-addr={self.address(0)}", f"--master-port={port}", *script_and_args]
            log = open(log_dir / f"node{i}.log", "w") if log_dir else subprocess.DEVNULL
            logs.append(log)
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=base_env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    raise SimClusterError(f"node {failed[0]} exited with {procs[failed[0]].returncode}")
                if time.monotonic() > deadline:
                    raise SimClusterError(f"timed out after {timeout:.0f}s")
                if on_poll is not None:
                    on_poll()
                time.sleep(0.2)
            failed = [i for i, p in enumerate(procs) if p.returncode != 0]
            if failed:
                raise SimClusterError(f"node {failed[0]} exited with {procs[failed[0]].returncode}")
            return [subprocess.CompletedProcess(p.args, p.returncode) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            for log in logs:
                if log is not subprocess.DEVNULL:
                    log.close()


def _raise_on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--nproc-per-node", type=int, default=1)
    ap.add_argument("--rate", default="1gbit", help="tc rate of every node link, or 'none'")
    ap.add_argument("--delay", default=None, help="netem delay of every node link, e.g. 1ms")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before every node is killed")
    ap.add_argument("--log-dir", default=None, help="write node<i>.log here (default: inherit nothing)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS... run under torchrun")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        sys.exit("error: give the script to run after --, e.g. -- pretrain_gpt.py --loco-bits 4")
    reason = available()
    if reason:
        sys.exit(f"error: simulated cluster {reason}")
    signal.signal(signal.SIGTERM, _raise_on_signal)
    log_dir = pathlib.Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    rate = None if args.rate.lower() == "none" else args.rate
    try:
        with SimCluster(args.nodes, rate=rate, delay=args.delay) as cluster:
            cluster.run_torchrun(command, args.nproc_per_node, args.timeout, log_dir=log_dir)
    except (SimClusterError, ValueError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted; simulated cluster removed")
    print(f"done: {args.nodes} nodes x {args.nproc_per_node} ranks, link {args.rate}"
          f"{', delay ' + args.delay if args.delay else ''}")


if __name__ == "__main__":
    main()
