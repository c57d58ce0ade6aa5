"""Shared helpers: real multi-process runs of pretrain_gpt.py under torchrun (gloo, CPU).

Most multi-rank runs start on a fork server (``tests/forkserver.py``): torchrun's own CLI,
with workers forked from an interpreter that has already imported torch and megatron-core,
so a tiny run does not spend most of its time importing; so do the elastic replica jobs
(:func:`start_launch`, side by side) and the tools' and dry runs' ``python script.py``
processes (:func:`run_launch`). ``LOCO_TEST_FORKSERVER=0`` runs every launch as a plain
process; the tests that stop ranks, restart them under torchrun or read their command
lines always do, and so do Megatron-FSDP's runs (``tests/test_fsdp.py`` says why)
(``tests/test_forkserver.py`` checks that both give the same losses, lines
and errors). The README runs the files on two pytest-xdist workers (``-n 2 --dist
loadfile``: a module and its shared runs stay on one worker); each worker has its own fork
server, corpus and temporary folders.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pathlib
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import pytest

# Without a GPU, Triton kernels run in Triton's interpreter, which must be chosen before
# triton is first imported in this process (megatron-core may import it early).
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

REPO = pathlib.Path(__file__).resolve().parent.parent

# A model small enough that a few steps take seconds on 2 CPU cores.
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "2",
        "--eval-interval", "0", "--log-interval", "1", "--ddp-bucket-size", "40000"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One built-in corpus (tokenizer + .bin/.idx) for the whole session."""
    return str(tmp_path_factory.mktemp("cache"))


def pytest_terminal_summary(terminalreporter):
    """One line at the end of a run whose real-Slurm tests (tests/test_slurm.py) were
    skipped, saying how to enable them: ``-q`` lists no skip reasons."""
    reasons = [r.longrepr[2] for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and "local Slurm cluster" in str(r.longrepr[2])]
    if reasons:
        why = reasons[0].removeprefix("Skipped: ")
        terminalreporter.write_line(f"{len(reasons)} Slurm tests skipped: the {why} (as root; .ci/run installs it)")


def on_terminal(pytestconfig):
    """A context in which what this process prints reaches the terminal also under pytest's
    capture (``-q`` captures stdout and stderr at the file descriptors): for a wait of
    minutes, which would otherwise look hung."""
    return pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled()


@pytest.fixture(scope="session")
def cpu_kernels_built(pytestconfig):
    """The C++ CPU kernels, built in this process first, at its priority: a run with
    --loco-kernels auto on an unbuilt cache trains on torch while they build in the
    background (niced), so a test that expects auto to pick them, or runs them in a
    subprocess whose time limit cannot hold a first build, asks for this. A build already
    running gets this process's priority while it is waited for, and the wait says so
    on the terminal every 20 s (loco_megatron/loco/build_lock.py)."""
    from loco_megatron.loco import cpu_kernels

    with on_terminal(pytestconfig):
        built = cpu_kernels.extension()
    assert built is not None, "the C++ CPU kernels did not build on this machine"
    return built


def program(name: str) -> str:
    """The path of the program ``name`` that the project's environment installs: next to this
    interpreter (the virtual environment's bin folder, active or not), else on PATH."""
    sys.path.insert(0, str(REPO / "tools"))
    from check_install import find_program

    found = find_program(name)
    assert found, f"{name} is neither next to {sys.executable} nor on PATH (a requirements file installs it)"
    return found


def free_port() -> int:
    """A free TCP port on localhost for a test's store or lighthouse, below the kernel's
    ephemeral range: a port handed out for a bind to port 0 and released can be taken by
    any outgoing connection (gloo opens many; the other xdist worker runs beside) before
    the store listens on it (EADDRINUSE seen in the suite); below that range only another
    listener can take it, and a random pick makes two tests choosing at once unlikely."""
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()  # (seeded from os.urandom: each process picks apart)
    for _ in range(200):
        port = rng.randrange(min(10000, low - 1000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port below {low}")


def spawn_ranks(worker, world: int, results: int, timeout: float = 300) -> list:
    """Run ``worker(rank, world, port, queue)`` on ``world`` spawned processes (a free port
    for their gloo group on localhost) and return the ``results`` items they put on the queue."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    got = [queue.get(timeout=timeout) for _ in range(results)]
    for proc in procs:
        proc.join(timeout=60)
    return got


def read_metrics(path) -> list[dict]:
    p = pathlib.Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def train_losses(metrics: list[dict]) -> dict[int, float]:
    return {m["iteration"]: m["train/lm_loss"] for m in metrics if "train/lm_loss" in m}


def torchrun_command(nproc: int, args: list[str], cache: str, metrics: pathlib.Path,
                     script: str = "pretrain_gpt.py", launcher_args: tuple = ()) -> tuple[list[str], dict]:
    """(argv, env) of a local torchrun of ``script`` writing ``metrics``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *launcher_args, str(REPO / script), *args, "--data-cache-path", cache, "--metrics-jsonl", str(metrics)]
    return cmd, dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


FIXED_ENV = {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
"""Environment the fork server's imports read (tests/forkserver.py): a launch with other
values, or with a PYTHONPATH other than the checkout (the server's ``sys.path``), runs as
a plain process."""


@functools.lru_cache(maxsize=None)
def fork_server() -> str | None:
    """The socket of this session's fork server (started on first use), or None when
    LOCO_TEST_FORKSERVER=0 asks for plain torchruns everywhere."""
    if os.environ.get("LOCO_TEST_FORKSERVER", "1") == "0":
        return None
    folder = tempfile.mkdtemp(prefix="loco_forkserver_")
    path = os.path.join(folder, "sock")
    env = dict(os.environ, PYTHONPATH=str(REPO), **FIXED_ENV)
    log = open(os.path.join(folder, "server.log"), "w")
    server = subprocess.Popen([sys.executable, str(REPO / "tests" / "forkserver.py"), path], cwd=REPO, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    atexit.register(shutil.rmtree, folder, True)  # runs after the kill below (last registered, first run)
    atexit.register(server.kill)
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the test fork server did not start; see {log.name}")
        time.sleep(0.1)
    return path


def _forkable(cmd: list[str], env: dict) -> bool:
    """Whether ``cmd`` is a :func:`torchrun_command` of the plain ``--standalone
    --nproc_per_node`` form, or a ``python script.py`` command, whose environment matches
    the fork server's imports."""
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return ((_script(cmd) is not None or len(cmd) > 5 and cmd[:4] == head and cmd[4].startswith("--nproc_per_node=")
             and cmd[5].endswith(".py")) and all(env.get(k, "") == v for k, v in FIXED_ENV.items())
            and env.get("PYTHONPATH", "") in ("", str(REPO)))


def _script(cmd: list[str]) -> str | None:
    """The script of a ``[sys.executable, "script.py", args...]`` command, else None."""
    return cmd[1] if len(cmd) > 1 and cmd[0] == sys.executable and cmd[1].endswith(".py") else None


class Launch:
    """A launch running on the fork server, used like a ``subprocess.Popen``: ``pid`` is
    torchrun's agent (or the script's process), which leads a process group of its own with
    its workers (kill them with ``os.killpg(pid, ...)``); ``poll()``, ``wait(timeout)`` and ``returncode`` as Popen's
    (the status comes from the server, the agent's parent)."""

    def __init__(self, path: str, cmd: list[str], env: dict, stdout: str, stderr: str, cwd: str | None = None):
        self.args, self.returncode = cmd, None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        script = _script(cmd)
        request = {"env": env, "cwd": str(cwd or REPO), "stdout": stdout, "stderr": stderr}
        if script is None:
            request.update(argv=["--run-path", "--start-method", "fork", *cmd[3:]], script=cmd[5])
        else:  # `python script.py args...`: the script itself, in the forked child
            request.update(argv=cmd[2:], script=str(pathlib.Path(cwd or REPO) / script), python=True)
        self._sock.sendall((json.dumps(request) + "\n").encode())
        self._pending = bytearray()  # the replies, one JSON line each
        self.pid = self._reply(60)["pid"]

    def _reply(self, timeout: float | None) -> dict:
        self._sock.settimeout(timeout)
        while b"\n" not in self._pending:
            chunk = self._sock.recv(4096)
            if not chunk:
                raise RuntimeError("the test fork server closed the connection")
            self._pending.extend(chunk)
        line, _, rest = bytes(self._pending).partition(b"\n")
        self._pending[:] = rest
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._reply(timeout)["status"]
            except (socket.timeout, TimeoutError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._sock.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0.001)
        except subprocess.TimeoutExpired:
            return None


def start_launch(cmd: list[str], env: dict, log: str) -> subprocess.Popen | Launch:
    """Start a :func:`torchrun_command` ``cmd`` writing stdout and stderr to the file ``log``:
    on the fork server where :func:`run_launch` would run it there, else as a process in a
    session of its own. Either way ``os.killpg(job.pid, sig)`` reaches its agent and workers."""
    path = fork_server() if _forkable(cmd, env) else None
    if path is None:
        with open(log, "w") as out:
            return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    open(log, "w").close()  # there when this returns, as with Popen (the launch truncates it again)
    return Launch(path, cmd, env, log, log)


def run_launch(cmd: list[str], env: dict | None, timeout: float, cwd=REPO,
               fork: bool = True) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=...)``
    for a :func:`torchrun_command` ``cmd`` or a ``[sys.executable, "script.py", ...]`` one; one of
    plain ``--standalone --nproc_per_node`` form, or a script, runs on the fork server (the
    same torchrun CLI, its workers forked from an interpreter that has imported torch and
    megatron-core; or the script in such a fork; the result has ``forked = True``), any other
    as a process. ``env`` None: this process's, with the fork server's fixed values and the
    checkout on PYTHONPATH. ``fork`` False: always a process of its own (fresh interpreters)."""
    if env is None:
        env = dict(os.environ, PYTHONPATH=str(REPO), **FIXED_ENV)
    path = fork_server() if fork and _forkable(cmd, env) else None
    if path is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as out:
        files = {"stdout": os.path.join(out, "stdout"), "stderr": os.path.join(out, "stderr")}
        job = Launch(path, cmd, env, **files, cwd=cwd)
        try:
            status = job.wait(timeout)
        except subprocess.TimeoutExpired as err:
            os.killpg(job.pid, 9)  # the agent and its workers (the child's own process group)
            job.wait(60)  # the server has reaped the agent
            err.pgid = job.pid
            raise
        with open(files["stdout"], errors="replace") as o, open(files["stderr"], errors="replace") as e:
            result = subprocess.CompletedProcess(cmd, status, o.read(), e.read())
        result.forked = True
        return result


def recorded_collectives(folder: pathlib.Path, world: int) -> dict[int, list]:
    """Each rank's collectives as tests/record_collectives.py wrote them (``[group ranks, op,
    elements]`` in issue order), after asserting that every rank of each communicator
    issued the same operations in the same order (where gloo forgives, NCCL hangs)."""
    logs = {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)}
    for comm in {tuple(g) for log in logs.values() for g, _, _ in log}:
        seqs = [[(op, n) for g, op, n in logs[r] if tuple(g) == comm] for r in comm]
        assert all(s == seqs[0] for s in seqs), comm
    return logs


def torchrun(nproc: int, args: list[str], cache: str, tmp_path: pathlib.Path, script: str = "pretrain_gpt.py",
             timeout: int = 600, name: str = "run", plain: bool = False) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``script`` on ``nproc`` local ranks; returns the process and its metrics.
    ``plain``: a torchrun process of its own (fresh interpreters), never the fork server."""
    metrics = tmp_path / f"{name}.jsonl"
    cmd, env = torchrun_command(nproc, args, cache, metrics, script)
    proc = run_launch(cmd, env, timeout, fork=not plain)
    crash = re.search(r"Signal (11 \(SIGSEGV\)|7 \(SIGBUS\)) received", proc.stdout + proc.stderr)
    saved = {"--save", "--load"} & set(args) or "LOCO_TEST_RECORD_DIR" in env
    if crash and getattr(proc, "forked", False) and not saved:
        # The fork server's workers are forked by torchrun's agent after its store threads
        # started (tests/forkserver.py): a memory fault there is the harness's hazard, not
        # necessarily the program's. A launch that wrote no checkpoint runs once more as a
        # plain torchrun (fresh interpreters, as users run it), which must then pass; the
        # fault's Python stack (faulthandler) is reported as a warning.
        trace = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith(("Fatal Python", "  File"))]
        warnings.warn(f"fork-server launch died of {crash.group(1)}; rerun as a plain torchrun. "
                      f"First stack lines: {trace[:12]}")
        metrics.unlink(missing_ok=True)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise AssertionError(f"{' '.join(cmd)} failed with {proc.returncode}:\n{tail}")
    return proc, read_metrics(metrics)


def torchrun_runs(nproc: int, args: list[str], cache: str, tmp_path: pathlib.Path, runs: list[tuple[str, list[str]]],
                  resume_at: int | None = None, timeout: int = 600):
    """One torchrun of tests/matrix_run.py doing ``runs`` ((name, extra args), ...) one
    after another in the same processes (start-up is most of a tiny run's cost on CPU),
    each run with ``args + extra``, its per-step parameter-identity and wire checks and its
    own metrics file; it stops at the first run that fails. ``resume_at``: a run with
    --load resumes from that iteration (MATRIX_RESUME_AT). Returns the process and
    {name: (that run's tagged stdout, its metrics)}."""
    cmd, env = torchrun_command(nproc, args, cache, tmp_path / "unused.jsonl", script="tests/matrix_run.py")
    env["MATRIX_RUNS"] = json.dumps([[name, [*extra, "--metrics-jsonl", str(tmp_path / f"{name}.jsonl")]]
                                     for name, extra in runs])
    if resume_at is not None:
        env["MATRIX_RESUME_AT"] = str(resume_at)
    proc = run_launch(cmd, env, timeout)
    console = dict(re.findall(r"=== run (\w+) ===\n(.*?)(?==== run |\Z)", proc.stdout, re.S))
    out = {}
    for name, _ in runs:
        mine = [line.replace(f" run={name}", "") for line in proc.stdout.splitlines() if f" run={name} " in line]
        rank0 = [line for line in console.get(name, "").splitlines() if " run=" not in line]
        out[name] = ("\n".join(mine + rank0) + "\n", read_metrics(tmp_path / f"{name}.jsonl"))
    return proc, out


def finished_run(launch: tuple, runs: list[tuple[str, list[str]]], name: str) -> tuple[str, list[dict]]:
    """(stdout, metrics) of run ``name`` of a :func:`torchrun_runs` ``launch`` of ``runs``;
    raises with the launch's output tail unless that run ran to its end (a later run
    started, or it was the last one and the launch exited 0)."""
    proc, out = launch
    names = [n for n, _ in runs]
    later = names[names.index(name) + 1:]
    if not (f"=== run {later[0]} ===" in proc.stdout if later else proc.returncode == 0):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise AssertionError(f"run {name} of a shared torchrun (runs {names}) did not finish "
                             f"(exit {proc.returncode}):\n{tail}")
    return out[name]
