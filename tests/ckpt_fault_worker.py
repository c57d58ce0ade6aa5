"""A rank of a torchrun (gloo) that meets injected checkpoint faults (test-only: each fault
is patched into this process for one scenario, the library has no hook for it) and reports
what every rank saw:

    torchrun --nproc_per_node N tests/ckpt_fault_worker.py SCENARIO[,SCENARIO...] ROOT

Each scenario runs in ``ROOT/SCENARIO``: a stand-in model's checkpoint at iteration 1, then
the fault. Save faults (on iteration 2's save): build (rank 1's state-dict build: MemoryError;
torch_build: the same under --ckpt-format torch),
staging (rank 1's copy to host memory: a device OOM), staging_async (the same under
--async-save, in the foreground part), shard (rank 1's shard write: disk full), common
(rank 0's common.pt: disk full), async (rank 1's background shard write: disk full),
async_all (every rank's background shard write: a full disk),
dcp_metadata (rank 0's DCP .metadata: disk full), metadata_json (rank 0's metadata.json:
disk full), sidecar (the last rank's checksum file: disk full). Load faults: missing (a
shard deleted together with its sha256.rank_N.json), torch_corrupt (--ckpt-format torch:
rank 1's file bit-flipped), common_unreadable (rank 1 alone cannot read common.pt, as a
node whose copy is truncated: torch's zip reader's long message). idle: save, then wait to be
killed. Prints, tagged ``[SCENARIO]``, ``ERROR`` (the one line the run would end with),
``AGREED`` (whether every rank raised it together: then rank 0 alone prints it), ``LEFT``
(names in the scenario's root) and ``LOADED`` (the previous checkpoint loaded back) per rank.
"""

import builtins
import contextlib
import errno
import os
import pathlib
import sys
import time
import warnings
from unittest import mock

import torch
import torch.distributed as dist

from loco_megatron.checkpoint import Checkpointer
from loco_megatron.config import ConfigError


class Weights:
    """A stand-in model: one tensor sharded over the ranks (so every rank writes a shard)."""

    def __init__(self, value: float):
        self.w = torch.full((2, 3), value)

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        shard = ShardedTensor.from_rank_offsets("w", self.w, (0, dist.get_rank(), dist.get_world_size()),
                                                replica_id=0)
        return {"model": {"w": shard}}

    def load_sharded_state_dict(self, loaded: dict) -> None:
        self.w.copy_(loaded["model"]["w"])

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, sd: dict) -> None:
        self.w.copy_(sd["w"])



def _say(line: str) -> None:
    """One write per line: under an unbuffered stdout ``print`` writes the text and its
    newline apart, and another rank's line can land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

def disk_full(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def full_open(file, mode="r", *args, **kwargs):
    """Opening a .distcp file for writing fails (patched into megatron's writer module, where
    it shadows the builtin; the writers it forks inherit it)."""
    if str(file).endswith(".distcp") and "w" in mode:
        raise disk_full(file)
    return builtins.open(file, mode, *args, **kwargs)


def full_save(real_save):
    def save(obj, f, *args, **kwargs):
        if str(f).endswith("common.pt"):
            raise disk_full(f)
        return real_save(obj, f, *args, **kwargs)
    return save


SAVE_FAULTS = ("build", "torch_build", "staging", "staging_async", "shard", "common", "async", "async_all",
               "dcp_metadata", "metadata_json", "sidecar")
LOAD_FAULTS = ("missing", "torch_corrupt", "common_unreadable")
ZIP_ERROR = ("PytorchStreamReader failed reading zip archive: failed finding central directory. This is an internal "
             "miniz error. If you are seeing this error, there is a high likelihood that your checkpoint file is "
             "corrupted. This can happen if the checkpoint was not saved properly, was transferred incorrectly, or "
             "the file was modified after saving.")
"""What torch.load says of a truncated file (torch 2.13): the line keeps its first sentence, whole."""


def inject(scenario: str, rank: int, world: int, stack: contextlib.ExitStack, model: Weights) -> None:
    """Patch this scenario's fault into this rank (undone when ``stack`` closes)."""
    from megatron.core.dist_checkpointing import core
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from loco_megatron.checkpoint import files

    def fail(exc):
        def raising(*args, **kwargs):
            raise exc
        return raising

    if scenario == "build" and rank == 1:
        stack.enter_context(mock.patch.object(model, "sharded_state_dict", fail(MemoryError())))
    if scenario == "torch_build" and rank == 1:
        stack.enter_context(mock.patch.object(model, "state_dict", fail(MemoryError())))
    if scenario in ("staging", "staging_async") and rank == 1:
        oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        stack.enter_context(mock.patch.object(filesystem_async.FileSystemWriterAsync, "preload_tensors",
                                              staticmethod(fail(oom))))
    if (scenario in ("shard", "async") and rank == 1) or scenario == "async_all":
        stack.enter_context(mock.patch.object(filesystem_async, "open", full_open, create=True))
    if scenario == "common" and rank == 0:
        stack.enter_context(mock.patch.object(torch, "save", full_save(torch.save)))
    if scenario == "dcp_metadata" and rank == 0:
        stack.enter_context(mock.patch.object(filesystem_async.FileSystemWriterAsync, "finish",
                                              fail(disk_full("/ck/.metadata"))))
    if scenario == "metadata_json" and rank == 0:
        stack.enter_context(mock.patch.object(core, "save_config", fail(disk_full("/ck/metadata.json"))))
    if scenario == "sidecar" and rank == world - 1:
        stack.enter_context(mock.patch.object(files, "write_durably", fail(disk_full("/ck/sha256.json"))))


def run(scenario: str, root: pathlib.Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    fmt = "torch" if scenario in ("torch_corrupt", "torch_build") else "torch_dist"
    layout = {"world_size": world, "tp": 1, "pp": 1, "ep": 1, "model": [1, 3, 2, None]}
    ck = Checkpointer(str(root), None, rank, layout, ckpt_format=fmt,
                      async_save=scenario in ("async", "async_all", "staging_async"), log=lambda _: None)
    ck.save(1, {"model": Weights(1.0)})
    ck.wait()
    if scenario == "idle":
        _say(f"SAVED rank={rank} pid={os.getpid()}")
        time.sleep(300)  # the test kills the ranks long before
        return
    error, agreed = "", False
    try:
        if scenario in SAVE_FAULTS:
            with contextlib.ExitStack() as stack:
                model = Weights(2.0)
                inject(scenario, rank, world, stack, model)
                ck.save(2, {"model": model})
                ck.wait()
        if scenario == "missing" and rank == 0:
            folder = root / "iter_0000001"
            for path in [*folder.glob("__1_*.distcp"), folder / "sha256.rank_00001.json"]:
                path.unlink()
        if scenario == "torch_corrupt" and rank == 1:
            victim = root / "iter_0000001" / "rank_00001.pt"
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0x01
            victim.write_bytes(bytes(data))
        dist.barrier()
        if scenario in LOAD_FAULTS:
            loader = Checkpointer(None, str(root), rank, layout, ckpt_format=fmt, log=lambda _: None)
            with contextlib.ExitStack() as stack:
                if scenario == "common_unreadable" and rank == 1:
                    from megatron.core import dist_checkpointing

                    stack.enter_context(mock.patch.object(dist_checkpointing, "load_common_state_dict",
                                                          lambda *a, **k: (_ for _ in ()).throw(RuntimeError(ZIP_ERROR))))
                loader.load(loader.find_resume_dir(collective=True), {"model": Weights(0.0)})
    except ConfigError as e:
        error, agreed = str(e), getattr(e, "agreed", False)
    _say(f"ERROR[{scenario}] rank={rank} {error}")
    _say(f"AGREED[{scenario}] rank={rank} {agreed}")
    dist.barrier()
    _say(f"LEFT[{scenario}] rank={rank} {sorted(p.name for p in root.iterdir())}")
    if scenario in SAVE_FAULTS:
        loader = Checkpointer(None, str(root), rank, layout, ckpt_format=fmt, log=lambda _: None)
        weights = Weights(0.0)
        loader.load(loader.find_resume_dir(collective=True), {"model": weights})
        _say(f"LOADED[{scenario}] rank={rank} {weights.w.unique().tolist()}")
    dist.barrier()


def main(scenarios: str, root: pathlib.Path) -> None:
    dist.init_process_group("gloo")
    for scenario in scenarios.split(","):
        run(scenario, root / scenario)
    dist.destroy_process_group()


if __name__ == "__main__":
    from loco_megatron.platform import detect_platform, platform_context

    warnings.filterwarnings("ignore")
    with platform_context(detect_platform(0)):  # megatron's checkpoint code asks for a CUDA device
        main(sys.argv[1], pathlib.Path(sys.argv[2]))
