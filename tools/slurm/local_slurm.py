"""A real Slurm cluster on this one Linux machine: :class:`LocalSlurm` (tests, benchmarks) and
the command ``tools/slurm/local_cluster.py`` (a cluster in the background, to try the templates).

Slurm and munge as Debian ships them (``apt-get install -y slurm-wlm munge``; run as root):
``slurmctld``, ``slurmd`` and ``munged``; nothing here schedules. ``munged`` (its own key and
socket) and ``slurmctld`` run on this machine. Each node ``nK`` is a ``slurmd -N nK`` in its
own network namespace (``eth0`` at 10.X.0.K/24, a private range, on a switch built by
``benchmarks/simcluster.py``, optionally shaped with ``tc``; this machine joins the switch
as 10.X.0.254), its own UTS namespace (hostname ``nK``: torchrun's c10d rendezvous needs
distinct hostnames) and its own mount namespace, in which ``/etc/hosts`` names the nodes
and ``/etc/nsswitch.conf`` resolves hosts from that file only (a node has no DNS server: a
reverse lookup there failed with a temporary error, on which torch's c10d warned at every
connection). The namespaces are entered with ``nsenter`` and ``unshare``, not ``ip netns
exec``, which remounts ``/sys`` for the namespace. Jobs see this machine's file system, so
outputs and checkpoints land where sbatch says.

Bounded: every daemon it starts, every process left in a node, the namespaces, the host's
veth and its route, and the state folder go when the cluster stops (:meth:`LocalSlurm.close`:
at the end of its ``with`` block, at exit, on an error), or, for a cluster whose owner was
killed, at the next start (:func:`clean_leftovers`). Nothing is written to the host's ``/etc``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from simcluster import SimCluster, SimClusterError, available as network_unavailable  # noqa: E402, F401 (SimClusterError: local_cluster.py catches it from here)

STATE_ROOT = pathlib.Path("/run/loco-slurm")
"""Every cluster's folder (configuration, keys, logs, spool) is STATE_ROOT/<name>."""
APT = "apt-get install -y slurm-wlm munge"
PROGRAMS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "sinfo")


class ClusterError(RuntimeError):
    pass


def unavailable(euid: Optional[int] = None) -> Optional[str]:
    """None when this machine can run a local cluster, else the one-line reason (``euid``:
    the user it would run as, default this process's)."""
    if (os.geteuid() if euid is None else euid) != 0:
        return "needs root (network namespaces and the Slurm daemons)"
    missing = [p for p in PROGRAMS if shutil.which(p, path=_sbin_path()) is None]
    if missing:
        return f"needs Slurm and munge ({', '.join(missing)} not found): {APT}"
    for tool in ("nsenter", "unshare"):
        if shutil.which(tool, path=_sbin_path()) is None:
            return f"needs the '{tool}' command (util-linux)"
    return network_unavailable()


def _sbin_path() -> str:
    return os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


def _which(name: str) -> str:
    return shutil.which(name, path=_sbin_path()) or name


def start_time(pid: int) -> Optional[str]:
    """The process's start time (clock ticks since boot), None if it is gone or a zombie
    (nobody may reap it: its parent, the shell that ran ``start``, has left): with the pid,
    it names one process (a pid alone may have been reused)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _free_subnet() -> int:
    """An X with 10.X.0.0/24 in no address or route of this machine (nor of a running cluster)."""
    used = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    used += subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    taken = {int(x) for x in re.findall(r"\b10\.(\d+)\.", used)} | {10, 255}
    start = os.getpid() % 200
    for k in range(200):
        x = 20 + (start + k) % 200
        if x not in taken:
            return x
    raise ClusterError("no free 10.X.0.0/24 range on this machine")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """``with LocalSlurm(nodes=3) as c: c.sbatch([...])``: a cluster running until the block ends.

    ``cpus``: CPUs each node offers Slurm (they share this machine's cores); ``rate``/``delay``:
    tc shaping of every node's link (simcluster's); ``name``: its folder under STATE_ROOT;
    ``cred_expire``: Slurm's job credential lifetime in seconds, which is also how long a
    requeued job waits before it starts again (Slurm's default 120); ``kill_wait``: seconds
    between SIGTERM and SIGKILL on scancel and at the time limit (Slurm's default 30).
    """

    def __init__(self, nodes: int = 3, cpus: int = 8, rate: Optional[str] = None, delay: Optional[str] = None,
                 name: Optional[str] = None, cred_expire: int = 30, kill_wait: int = 30):
        if not 1 <= nodes <= 50:
            raise ValueError("nodes must be in [1, 50]")
        self.nodes, self.cpus, self.cred_expire, self.kill_wait = nodes, cpus, cred_expire, kill_wait
        self.rate, self.delay = rate, delay
        self.name = name or f"t{os.getpid()}"
        self.dir = STATE_ROOT / self.name
        self.conf = self.dir / "slurm.conf"
        self.node_names = [f"n{k + 1}" for k in range(nodes)]
        self.net: Optional[SimCluster] = None
        self.procs: dict[str, subprocess.Popen] = {}
        self._closed = True

    # -- start ---------------------------------------------------------------------------
    def __enter__(self) -> "LocalSlurm":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        reason = unavailable()
        if reason:
            raise ClusterError(f"local Slurm cluster {reason}")
        clean_leftovers()
        if self.dir.exists():
            raise ClusterError(f"{self.dir} is in use by a running cluster (stop it first)")
        self._closed = False
        atexit.register(self.close)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        self.dir.mkdir(parents=True, mode=0o755)
        self.dir.chmod(0o755)  # munged wants its socket's folder searchable by all, writable by root only
        for sub in ("ctld", "spool"):
            (self.dir / sub).mkdir()
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.net = SimCluster(self.nodes, rate=self.rate, delay=self.delay, tag=f"{os.getpid() % 100000}",
                              subnet=_free_subnet(), host_link=True)
        self._record()
        self.net.__enter__()
        self._record()
        self._write_config()
        sock = self.dir / "munge.socket"
        self._daemon("munged", [_which("munged"), "--foreground", f"--socket={sock}", f"--key-file={key}",
                                f"--pid-file={self.dir / 'munged.pid'}", f"--log-file={self.dir / 'munged.log'}",
                                f"--seed-file={self.dir / 'munged.seed'}"])
        self._wait(lambda: sock.exists(), 30, "munged did not create its socket")
        self._daemon("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        self._wait(lambda: self._run(["scontrol", "ping"], check=False).stdout.count("is UP") > 0, 60,
                   "slurmctld did not answer scontrol ping")
        for k, node in enumerate(self.node_names):
            # hostname, then the node's own hosts/nsswitch files, then slurmd in the node's namespaces.
            setup = (f"hostname {node} && mount --bind {self.dir / 'hosts'} /etc/hosts && "
                     f"mount --bind {self.dir / 'nsswitch.conf'} /etc/nsswitch.conf && "
                     f'exec {_which("slurmd")} -D -N {node} -f {self.conf}')
            self._daemon(f"slurmd-{node}", [_which("nsenter"), f"--net=/run/netns/{self.net.node_ns[k]}",
                                            _which("unshare"), "--uts", "--mount", "--propagation", "private",
                                            "sh", "-c", setup])
        self._wait(self._all_idle, 90, "the nodes did not all register idle")
        (self.dir / "ready").write_text("")

    def _write_config(self) -> None:
        net = self.net
        host = socket.gethostname().split(".")[0]
        # the nodes first: the first line that names a host wins
        names = "".join(f"{net.address(k)} {n}\n" for k, n in enumerate(self.node_names))
        (self.dir / "hosts").write_text(names + pathlib.Path("/etc/hosts").read_text())
        nss = pathlib.Path("/etc/nsswitch.conf").read_text() if pathlib.Path("/etc/nsswitch.conf").exists() else ""
        nss = re.sub(r"(?m)^hosts:.*$", "", nss) + "\nhosts: files\n"
        (self.dir / "nsswitch.conf").write_text(nss)
        d = self.dir
        nodes = "\n".join(f"NodeName={n} NodeAddr={net.address(k)} NodeHostname={n} CPUs={self.cpus} State=UNKNOWN"
                          for k, n in enumerate(self.node_names))
        self.conf.write_text(f"""# loco-megatron local cluster ({self.nodes} nodes on this machine; tools/slurm/local_cluster.py)
ClusterName=loco{self.name.lower()[:20]}
SlurmctldHost={host}({net.host_address})
SlurmctldPort={_free_port()}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also the wait of a requeued job before it starts again
AuthInfo=socket={d / 'munge.socket'},cred_expire={self.cred_expire}
StateSaveLocation={d / 'ctld'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd-%n.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd-%n.log'}
# Processes tracked by their parentage (no cgroups needed); no CPU binding: nodes share cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Nodes offer the CPUs configured here, not the cores this machine has.
SlurmdParameters=config_overrides
ReturnToService=2
# Finished jobs stay in `scontrol show job` this long (no accounting database here).
MinJobAge=3600
KillWait={self.kill_wait}
{nodes}
PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        log.close()
        self._record()

    def _record(self) -> None:
        """What the next start needs to clean up after this cluster if its owner dies."""
        state = {"owner": os.getpid(), "owner_start": start_time(os.getpid()),
                 "pids": {n: p.pid for n, p in self.procs.items()},
                 "namespaces": [self.net.bridge_ns, *self.net.node_ns] if self.net else [],
                 "host_link": self.net.host_link if self.net else None}
        tmp = self.dir / "cluster.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.dir / "cluster.json")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{dead[0]} exited with {self.procs[dead[0]].returncode}" if dead else f"after {timeout:.0f} s"
                raise ClusterError(f"{what} ({why}); {self.log_tail(dead[0] if dead else None)}")
            time.sleep(0.2)

    def log_tail(self, name: Optional[str]) -> str:
        logs = [self.dir / f"{name}.out"] if name else []
        logs += [self.dir / "slurmctld.log", *sorted(self.dir.glob("slurmd-*.log"))]
        for log in logs:
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if "error" in ln.lower()] \
                if log.exists() else []
            if lines:
                return f"{log.name}: {lines[-1].strip()}"
        return f"logs in {self.dir}"

    def _all_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.node_names)

    # -- use -----------------------------------------------------------------------------
    def env(self, base: Optional[dict] = None) -> dict:
        """``base`` (default: this process's environment) with SLURM_CONF for this cluster."""
        return dict(os.environ if base is None else base, SLURM_CONF=str(self.conf))

    def _run(self, cmd: list[str], check: bool = True, env: Optional[dict] = None, cwd=None,
             timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run([_which(cmd[0]), *cmd[1:]], capture_output=True, text=True, env=self.env(env),
                              cwd=cwd, timeout=timeout)
        if check and proc.returncode:
            raise ClusterError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def sbatch(self, args: list[str], env: Optional[dict] = None, cwd=REPO) -> str:
        """Submit (``sbatch --parsable ARGS``) from ``cwd``; returns the job id."""
        return self._run(["sbatch", "--parsable", *args], env=env, cwd=cwd).stdout.strip().split(";")[0]

    def jobs(self, *job_ids: str) -> dict[str, dict]:
        """Job id -> its ``scontrol show job -o`` record, for ``job_ids`` (default: every job
        slurmctld still knows: finished ones stay for MinJobAge)."""
        out = self._run(["scontrol", "show", "job", "-o", *job_ids]).stdout
        records = [dict(re.findall(r"(\S+?)=(.*?)(?= \S+?=|$)", line)) for line in out.splitlines() if "JobId=" in line]
        return {r["JobId"]: r for r in records}

    def hostnames(self, nodelist: str) -> list[str]:
        """Slurm's compressed node list (``n[1-2]``) as host names."""
        return self._run(["scontrol", "show", "hostnames", nodelist]).stdout.split()

    def scontrol(self, *args: str) -> str:
        return self._run(["scontrol", *args]).stdout

    def scancel(self, *args: str) -> None:
        self._run(["scancel", *args])

    # -- stop ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop everything this cluster started (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for name in sorted(self.procs, key=lambda n: not n.startswith("slurmd")):  # nodes first
            _end(self.procs[name])
        if self.net is not None:
            self.net.close()  # SIGKILLs what is left in the nodes (job steps), deletes namespaces and veth
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            STATE_ROOT.rmdir()  # when no other cluster runs

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (should be nothing after close)."""
        left = [f"{n} (pid {p.pid})" for n, p in self.procs.items() if p.poll() is None]
        left += self.net.leftovers() if self.net else []
        return left + ([str(self.dir)] if self.dir.exists() else [])


def _end(proc: subprocess.Popen, grace: float = 5) -> None:
    """SIGTERM the daemon's process group, SIGKILL after ``grace`` seconds; reap it."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # helpers it forked in its group (slurmctld's slurmscriptd)


def clean_leftovers() -> list[str]:
    """Remove the clusters under STATE_ROOT whose owner process is gone (killed before it
    could stop them): their daemons, the processes in their nodes, their namespaces and
    host veth, their folder. Returns their names."""
    cleaned = []
    for state_file in sorted(STATE_ROOT.glob("*/cluster.json")):
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            continue
        if start_time(state["owner"]) == state["owner_start"]:
            continue  # alive: another cluster of this machine
        folder = state_file.parent
        for pid in state["pids"].values():
            try:  # only a process that still runs with this cluster's folder on its command line
                if str(folder) in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.killpg(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        for ns in state["namespaces"]:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if state.get("host_link"):
            subprocess.run(["ip", "link", "del", state["host_link"]], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)
        cleaned.append(folder.name)
    return cleaned
