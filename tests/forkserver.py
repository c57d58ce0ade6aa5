"""A fork server for the test suite's local torchruns (tests/conftest.py starts it).

Most of a tiny CPU run's wall time is start-up: every rank imports torch and
megatron-core (8-16 s per process on 2 busy cores) before it trains for a second or two.
This process imports them once; for each launch it forks a child that runs torchrun's own
CLI (``torch.distributed.run.main``) with ``--run-path --start-method fork``: the real
elastic agent, rendezvous and failure reports, but workers forked from an interpreter that
has already imported everything instead of fresh ``python -u script.py`` processes.

Fork safety: this process starts no thread (imports only; nothing of torch runs), so each
child holds a consistent copy. The workers are forked by torchrun's agent after its store
started threads, which a plain torchrun never does: a worker that dies of a memory fault
prints its Python stack (faulthandler, inherited), and ``conftest.torchrun`` reruns a
launch that saved nothing as a plain torchrun, with a warning. Environment read at import
time is this process's: conftest starts it with the launches' fixed values
(``OMP_NUM_THREADS=1``, the same ``TRITON_INTERPRET``, the checkout on PYTHONPATH) and runs
a launch with other values, or with launcher flags beyond ``--standalone
--nproc_per_node``, as a plain process instead.

Protocol (one launch per connection on a Unix socket, one JSON line each way): request
``{"argv", "script", "env", "cwd", "stdout", "stderr"}`` (stdout and stderr may name one
file; ``"python": true`` runs the script itself with ``argv``, as ``python script.py``
would, instead of torchrun); replies ``{"pid": P}`` when the child is forked (its own
process group: a timeout or a test's kill ends the agent and its workers together) and
``{"status": S}`` when it exits (``S`` as ``subprocess`` reports it: the exit code, or
minus the signal). Launches run side by side (elastic replicas): each has a waiter process
of its own, forked from this one.
"""

from __future__ import annotations

import faulthandler
import io
import json
import os
import runpy
import socket
import sys
import traceback


def _preload() -> None:
    """What every launch's ranks import (see pretrain_gpt.py and loco_megatron.training); the
    imports' warnings are silenced, and the interpreter's default filters kept for the
    launches (ResourceWarning and DeprecationWarning ignored, as in a plain process)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch  # noqa: F401
        import torch.distributed.run  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.distributed  # noqa: F401
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
        import megatron.core.datasets.gpt_dataset  # noqa: F401
        import megatron.core.tokenizers.text  # noqa: F401  (transformers: ~4 s of each rank's start)
        import sentencepiece  # noqa: F401
        import loco_megatron.cli  # noqa: F401
        import loco_megatron.training.trainer  # noqa: F401


def _child(req: dict) -> int:
    """The forked launch: torchrun's CLI on the request's argv (or, with ``python``, the
    script itself, as ``python script argv...`` runs it), output to its files."""
    os.setpgid(0, 0)  # the client's timeout kills the agent and its workers together
    out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    # One file for both (a job's log): one descriptor, so neither stream overwrites the other.
    err = out if req["stderr"] == req["stdout"] else os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                                             0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for f in {out, err}:
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # Line-buffered streams on the new files (torchrun runs its workers with `python -u`;
    # a line here is one write, so ranks sharing the file never split each other's lines).
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", line_buffering=True,
                                  errors="backslashreplace")
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(req["script"])))  # as `python script.py` does
    from torch.distributed import run

    try:
        if req.get("python"):  # `python script.py argv...`
            sys.argv = [req["script"], *req["argv"]]
            runpy.run_path(req["script"], run_name="__main__")
        else:
            run.main(req["argv"])
    except SystemExit as e:  # as the interpreter exits: None is 0, a message goes to stderr with 1
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # as python (and the torchrun command) reports a failure: traceback, exit 1
        traceback.print_exc()
        return 1
    return 0


def _launch(conn: socket.socket, req: dict) -> None:
    """In a process of its own (one per launch, so that launches run side by side): fork the
    launch, reply its pid, wait for it, reply its status."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        conn.close()
        code = 1
        try:
            code = _child(req)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    except OSError:
        pass
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall((json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    except OSError:
        pass


def serve(path: str) -> None:
    parent = os.getppid()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path + ".tmp")
    os.replace(path + ".tmp", path)  # the client waits for the path: it appears ready
    sock.listen(16)
    sock.settimeout(1.0)
    while os.getppid() == parent:  # the test session ended: so does this server
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap the launches' waiters that are done
                pass
        except ChildProcessError:
            pass
        try:
            conn, _ = sock.accept()
        except socket.timeout:
            continue
        with conn:
            conn.settimeout(None)
            req = json.loads(conn.makefile("r").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:  # the waiter: forks the launch and reports on this connection
                sock.close()
                try:
                    _launch(conn, req)
                finally:
                    os._exit(0)


if __name__ == "__main__":
    # A crash in a forked worker (a signal, not an exception) prints its Python stack to the
    # launch's stderr file: the handler and fd 2 are inherited by every child.
    faulthandler.enable()
    _preload()
    serve(sys.argv[1])
