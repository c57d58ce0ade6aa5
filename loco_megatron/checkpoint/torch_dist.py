"""The ``torch_dist`` format: megatron-core ``dist_checkpointing`` (torch.distributed.checkpoint).

CONTRACT (relied on by the Hugging Face export; keep it exact): ``SAVE/iter_N/`` is a folder
loadable by ``megatron.core.dist_checkpointing.load``. Its state dict has

- ``"model"``: ``model_chunks[0].module.sharded_state_dict()`` (the GPTModel inside the DDP
  wrapper, so keys read ``decoder.layers.0.mlp.linear_fc1.weight``, no ``module.`` prefix)
  for one chunk; with virtual pipeline stages ``"model0"``, ``"model1"``, ... (one per
  chunk, megatron-LM's keys);
- ``"config"`` (common, non-sharded, written by rank 0): the run's Config as plain
  JSON-able python types (``dataclasses.asdict(config)``), readable with
  ``dist_checkpointing.load_common_state_dict(path)["config"]``.

Besides: ``"optimizer"`` (the distributed optimizer's fp32 main params and Adam moments
as ShardedTensors of each model parameter's shape, see
:mod:`loco_megatron.checkpoint.dist_optimizer`: they reshard across DP, TP, PP and EP), and as common state the LR scheduler, the data
position (a global consumed-samples count), the trainer counters, ``"layout"`` (the
parallel layout and model shape) and ``"iteration"``. State whose shape depends on the
layout (RNG, LoCo's error buffers, the --param-gather-bits shards) is one ShardedObject
per rank under a key naming the layout (``loco.world2_tp1_pp1_ep1/shard_R_W``); at load
it is only asked for when the layout is the same, else the run says so in one line and
each such object gets ``load_state_dict(None)`` after the model was loaded (LoCo starts
its error buffers at zero, the --param-gather-bits hook agrees on the loaded weights).

With ``--diloco-replicas`` (:mod:`.diloco`): ``"model"`` and ``"optimizer"`` are replica 0's
(the contract above holds), replica ``r >= 1``'s are under the same keys prefixed
``diloco.replica{r}.``, and the outer step's agreed parameters and momentum are in model
space (``diloco.agreed.*``, ``diloco.momentum.*``), its error buffers per rank.

Integrity: every writing rank records the SHA-256 of the files it wrote in
``sha256.rank_R.json``; at load the ranks share the checking and agree before any state
is read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import pickle
import re
import warnings
from typing import Callable, Optional

import torch.distributed as dist

from loco_megatron.checkpoint import diloco, files
from loco_megatron.checkpoint.rng import rng_state, set_rng_state
from loco_megatron.config import ConfigError, brief
from loco_megatron.loco.hooks.version import check_megatron_core_version
from loco_megatron.children import become_helper, main_not_rerun, stop_signals_blocked

PER_RANK = ("loco", "param_gather", diloco.NAME)
"""Registered states whose content depends on the parallel layout (one object per rank;
DiLoCo's outer step has a part in model space besides, see :mod:`.diloco`)."""
OPTIONAL_STATES = ("health",)
"""States absent from checkpoints written before they existed; those load without them."""


def is_sharded(path: pathlib.Path) -> bool:
    """Whether ``path`` is a sharded (DCP) checkpoint folder, torch_dist or fsdp_dtensor
    (both have a ``metadata.json``; :func:`.files.sharded_backend` tells which)."""
    return (path / "metadata.json").is_file()


def layout_tag(layout_key: dict) -> str:
    """The parallel layout (model shape and buckets left out) as a key fragment, e.g.
    ``world2_tp1_pp1_ep1``. Per-rank state saved under one tag is read back under the
    same tag; a change of the buckets (their size, or the bf16 norms joining the other
    parameters' buffers) keeps it, and each part whose shape follows the buckets (LoCo's
    error, the --param-gather-bits shards) resets itself with one line."""
    return "_".join(f"{k}{v}" for k, v in layout_key.items()
                    if k not in ("model", "bucket", "bf16_norms")).replace("world_size", "world")


def saved_common(path: pathlib.Path) -> dict:
    """The common (rank 0) state of a torch_dist (or fsdp_dtensor) checkpoint; ConfigError if unreadable."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    try:
        if files.sharded_backend(path) == "fsdp_dtensor":
            # megatron's loader knows no fsdp_dtensor backend; common.pt is its common strategy's file
            return TorchCommonLoadStrategy().load_common(str(path))
        return dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same one-line error
        raise ConfigError(f"--load: {path / 'common.pt'} is not a readable checkpoint ({brief(e)})") from None


def _per_rank(key: str, data, rank: int, world: int):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(key, data, (world,), (rank,), replica_id=0)


def state_dict(stateful: dict, layout_key: dict, run_config: Optional[dict], iteration: int,
               is_loading: bool, per_rank: bool, saved: Optional[dict] = None) -> dict:
    """The sharded state dict to save, or to load into (``is_loading``); ``per_rank``:
    include the layout-keyed per-rank objects (RNG, LoCo). ``saved`` (loading): the
    checkpoint's common state, which says whose model and optimizer keys this rank reads
    and whether there is DiLoCo outer state to read (:mod:`.diloco`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tag = layout_tag(layout_key)
    model_sd = stateful["model"].sharded_state_dict()
    sd = {**model_sd, **common_state(stateful, layout_key, run_config, iteration)}
    saved = saved or {}
    replica = diloco.replica_of(layout_key)
    for name, obj in stateful.items():
        if name == "model":
            continue
        if name == diloco.NAME:
            outer_saved = saved.get(name) if is_loading else obj.common_state()
            if outer_saved is not None:  # a checkpoint without outer state: nothing to read
                sd[name] = diloco.sharded_state_dict(
                    obj, model_sd, is_loading, replica, bool(obj.mu and outer_saved["with_momentum"]),
                    _per_rank(f"{name}.{tag}", None if is_loading else obj.per_rank_state_dict(), rank, world)
                    if per_rank else None)
        elif hasattr(obj, "sharded_state_dict"):
            sd[name] = obj.sharded_state_dict(model_sd, is_loading)
        elif name in PER_RANK and per_rank:
            sd[name] = _per_rank(f"{name}.{tag}", obj.state_dict(), rank, world)
    if per_rank:
        sd["rng"] = _per_rank(f"rng.{tag}", rng_state(), rank, world)
    diloco.assign_replica_keys(sd, list(model_sd), layout_key, saved.get("layout", {}) if is_loading else None)
    return sd


def common_state(stateful: dict, layout_key: dict, run_config: Optional[dict], iteration: int) -> dict:
    """What every rank holds alike (rank 0 writes it to ``common.pt``): the layout, the
    iteration, the run's config, and every registered object but the model, the optimizer
    and whatever else is sharded, and the per-rank ones (counters, schedule, data position)."""
    out = {"layout": layout_key, "iteration": iteration, "config": run_config or {}}
    for name, obj in stateful.items():
        if name not in ("model", "optimizer", *PER_RANK) and not hasattr(obj, "sharded_state_dict"):
            out[name] = obj.state_dict()
    return out


class WorkerErrorLogFilter(logging.Filter):
    """Drops megatron's log line "Local process N encountered an error: ..." (N numbers this
    rank's writer processes: every rank has a "Local process 0"), one per failing rank on
    the console: the failure reaches the ranks' agreement, and the run ends with one line
    naming the ranks, the file and the reason. megatron's other log lines pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Local process ")


class PickledQueue:
    """megatron's write-results queue (``filesystem_async._results_queue``) over a Manager
    queue proxy that carries pickled bytes: the writer that ``put``s pickles the result
    (a dict of torch's ``WriteResult`` lists, or an exception), the rank that ``get``s
    unpickles it, and the Manager in between holds bytes, so it never imports what the
    results reference (torch.distributed.checkpoint, and torch with it). megatron calls
    ``put`` (its write process) and ``get_nowait`` (the rank); ``get`` serves the tests."""

    def __init__(self, queue) -> None:
        self._queue = queue

    def put(self, obj) -> None:
        self._queue.put(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def get_nowait(self):
        return pickle.loads(self._queue.get_nowait())

    def get(self, timeout: float | None = None):
        return pickle.loads(self._queue.get(timeout=timeout))


def start_writer_manager_detached() -> None:
    """megatron's torch_dist writer uses a multiprocessing Manager (a spawned server
    process) to collect write results; megatron starts it at the first save. Start it here
    instead, (1) with /dev/null as stdout/stderr: it inherits them, and when a rank is
    SIGKILLed the orphaned manager keeps the launcher's pipes open, so whatever waits for
    their end (a supervisor, a restart test) hangs; (2) as a helper of the rank
    (:mod:`loco_megatron.children`): it does not outlive its rank, and it ignores
    the SIGTERM that asks the rank for a stop save, which needs it. Called before every
    save (none is in flight then): it also drops a result left in the queue by an abandoned
    --async-save write (finished, never finalized), which the next write's finalize would
    take for its own (a success hiding this write's failure, or the old write's file
    offsets in the new .metadata), and quiets megatron's per-writer error log lines
    (:class:`WorkerErrorLogFilter`). (3) As a plain queue server: it neither re-runs the
    rank's script (:func:`.children.main_not_rerun`) nor unpickles the results
    (:class:`PickledQueue`), so it imports neither torch nor megatron-core (megatron's own
    Manager did both: seconds of CPU per rank at the first save, and its own copy of torch
    in memory)."""
    import multiprocessing as mp
    import queue
    import sys
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    check_megatron_core_version()  # private module state below: refuse untested versions
    worker_log = logging.getLogger(filesystem_async.__name__)
    if not any(isinstance(f, WorkerErrorLogFilter) for f in worker_log.filters):
        worker_log.addFilter(WorkerErrorLogFilter())  # before the writers fork: they inherit it
    if filesystem_async._results_queue is not None:
        while True:
            try:
                filesystem_async._results_queue.get_nowait()
            except queue.Empty:
                return
    sys.stdout.flush()
    sys.stderr.flush()
    saved, null = [os.dup(1), os.dup(2)], os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        manager = SyncManager(ctx=mp.get_context("spawn"))  # megatron's own choice of context
        with stop_signals_blocked(), main_not_rerun():
            manager.start(initializer=become_helper, initargs=(os.getpid(),))
        filesystem_async._results_queue = PickledQueue(manager.Queue())  # the proxy keeps the manager alive
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


@contextlib.contextmanager
def sharded_tensor_warning_ignored():
    """Only during a load: megatron-core's loader goes through torch's deprecated
    ShardedTensor, which warns "Please use DTensor instead and we are deprecating
    ShardedTensor." (a FutureWarning) on every rank at every load; it is about megatron's
    internals, nothing a user can act on, so exactly that warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                                category=FutureWarning)
        yield


def checkpoint_exception() -> type:
    """DCP's exception type: it derives from BaseException, so ``except Exception`` misses it."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def describe_write_failure(e: BaseException, folder: pathlib.Path) -> str:
    """One line for a failed shard write, naming every rank whose write failed (a full disk
    fails them all) and the first one's reason. DCP's CheckpointException (a BaseException,
    so ``except Exception`` misses it) carries {rank: exception} on the coordinator only;
    the other ranks get an empty one ("" here) and the caller's agreement picks rank 0's line."""
    failures = getattr(e, "failures", None)
    if failures:
        ranks = sorted(failures)
        exc = failures[ranks[0]]
        exc = exc[0] if isinstance(exc, tuple) else exc  # (exception, traceback) when wrapped
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        if isinstance(exc, OSError) and exc.filename:
            if len(ranks) == 1:
                return f"writing {exc.filename} failed on {who} ({files.cause(exc, folder)})"
            return f"writing {folder} failed on {who} (rank {ranks[0]}: {exc.filename}: {files.cause(exc, folder)})"
        # megatron's writer reports a worker's OSError as RuntimeError("Worker failure: <it>"),
        # whose text (errno, reason and file) is all that survives the gather to rank 0.
        text = brief(exc).removeprefix("RuntimeError: Worker failure: ")
        reason = files.cause(exc, folder)  # e.g. a full disk that torch's zip writer reports without errno
        note = f" ({reason})" if reason.lower() not in text.lower() else ""
        return f"writing {folder} failed on {who}: {text}{note}"
    if failures is not None:
        return ""
    return f"writing {folder} failed on rank {dist.get_rank()} ({files.cause(e, folder)})"


def without_clock(common: dict) -> dict:
    """The common-state consistency check minus the one per-rank clock (rank 0's is saved)."""
    trainer = {k: v for k, v in common.get("trainer", {}).items() if k != "train_time_s"}
    return {**common, "trainer": trainer}


def written_by(folder: pathlib.Path, rank: int) -> list[str]:
    """The files of ``folder`` this rank wrote (rank 0 also writes the metadata and common state)."""
    names = [p.name for p in folder.glob(f"__{rank}_*.distcp")]
    if rank == 0:
        names += [n for n in (".metadata", "common.pt", "metadata.json") if (folder / n).is_file()]
    return names


def verify(folder: pathlib.Path, rank: int, world: int) -> None:
    """Collective: ranks split the recorded checksums, then all raise the first mismatch.
    Every rank that wrote the checkpoint (the saved world size) must have left its
    sidecar: a shard deleted with its sidecar would otherwise pass, and fail in DCP."""
    error, entries = "", []
    try:
        entries = files.sidecar_entries(folder)
    except ValueError as e:  # every rank reads the same files: reported after the agreement, once
        error = f"--load: {e}"
    if not (error or entries):
        error = f"--load: {folder} has no sha256.rank_*.json (an incomplete copy?)"
    elif entries:
        try:
            writers = int(saved_common(folder).get("layout", {}).get("world_size", 0))
        except ConfigError as e:  # reported after the agreement below, like any other finding
            error, writers = str(e), 0
        missing = files.missing_sidecars(folder, writers)
        if missing:
            side = folder / files.SIDECAR.format(rank=missing[0])
            error = (f"--load: {side} is missing: the files of rank {missing[0]} (of the {writers} that saved) "
                     f"cannot be checked (an incomplete copy?)")
    for i, (name, want) in enumerate(entries):
        if i % world == rank and not error:
            path = folder / name
            if not path.is_file():
                error = f"--load: {path} is missing (listed in the checkpoint's checksums)"
            elif files.sha256(path) != want:
                error = f"--load: {path} does not match its recorded SHA-256 (corrupt file)"
    agree_or_raise(error)


def agree_or_raise(error: str) -> None:
    """Collective: every rank raises the first (lowest rank's) ``error`` as one ConfigError,
    marked agreed (so rank 0 alone prints it), or none does. When only some ranks found it
    (e.g. a file that differs between nodes) and the line names no rank, it says which."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    found = [rank for rank, e in enumerate(errors) if e]
    if found:
        line = errors[found[0]]
        if len(found) < len(errors) and not re.search(r"\brank \d", line):
            line += f" (on rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))} of {len(errors)})"
        agreed = ConfigError(line)
        agreed.agreed = True
        raise agreed


def load(folder: pathlib.Path, stateful: dict, layout_key: dict, log: Callable[[str], None]) -> int:
    """Restore ``stateful`` from ``folder`` under the current layout; returns the iteration.

    The model shape was checked before the model was built; here the parallel layout
    decides whether the per-rank objects (RNG, LoCo, --param-gather-bits state) are read.
    """
    from megatron.core import dist_checkpointing

    verify(folder, dist.get_rank(), dist.get_world_size())
    common = saved_common(folder)
    saved_layout = common.get("layout", {})
    same = layout_tag(saved_layout) == layout_tag(layout_key)
    request = state_dict(stateful, layout_key, None, 0, is_loading=True, per_rank=same, saved=common)
    error, loaded = "", None
    try:
        with sharded_tensor_warning_ignored():
            loaded = dist_checkpointing.load(request, str(folder))
    except (Exception, checkpoint_exception()) as e:  # noqa: BLE001 - one line, whatever megatron/DCP raised
        error = f"--load: {folder} could not be loaded ({brief(e)})"
    agree_or_raise(error)  # DCP raises on every rank: one line, printed once
    stateful["model"].load_sharded_state_dict(loaded)
    restore(folder, stateful, loaded, saved_layout, layout_key, log)
    return int(common["iteration"])


def restore(folder: pathlib.Path, stateful: dict, loaded: dict, saved_layout: dict, layout_key: dict,
            log: Callable[[str], None]) -> None:
    """Every registered object but the model from ``loaded``; the per-rank ones (and the
    RNG) only when ``saved_layout`` has the tag of ``layout_key``, else each gets
    ``load_state_dict(None)`` and the run says so in one line."""
    same = layout_tag(saved_layout) == layout_tag(layout_key)
    for name, obj in stateful.items():
        if name == "model":
            continue
        if name == diloco.NAME:  # model-space part always, per-rank part at the same layout only
            obj.load_state_dict(diloco.loaded_state(loaded.get(name)))
            continue
        if name in PER_RANK and not same:
            # Not read: written for another layout. None tells the object so (after the
            # model was loaded: the parameter hook takes the loaded weights as agreed).
            obj.load_state_dict(None)
            continue
        if name not in loaded:
            if name in OPTIONAL_STATES:
                continue
            raise ConfigError(f"--load: {folder} has no '{name}' state")
        obj.load_state_dict(loaded[name])
    if same:
        set_rng_state(loaded["rng"])
    else:
        gathered = getattr(stateful.get("param_gather"), "shards", None)  # --param-gather-bits' agreed copies
        log(f"checkpoint: saved with layout {layout_tag(saved_layout)}, resuming with {layout_tag(layout_key)}: "
            f"model, optimizer, schedule and data position resharded; RNG re-seeded and LoCo error "
            f"buffers start at zero{'; the loaded model is the agreed parameters of --param-gather-bits' if gathered else ''}"
            f"{diloco.layout_note(layout_key, saved_layout, loaded, stateful.get(diloco.NAME))}")
