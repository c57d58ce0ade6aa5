"""A rank of a 2-rank torchrun (gloo) that saves a stand-in model's checkpoint at iteration
1, then meets one injected fault (test-only: the fault is patched into this process, the
library has no hook for it) and reports what every rank saw:

    torchrun --nproc_per_node 2 tests/ckpt_fault_worker.py SCENARIO ROOT

SCENARIO: shard (rank 1's shard write: disk full), common (rank 0's common.pt: disk full),
async (rank 1's background shard write: disk full), missing (a shard deleted together with
its sha256.rank_N.json), torch_corrupt (--ckpt-format torch: rank 1's file bit-flipped),
idle (save, then wait to be killed). Prints ``ERROR <line>`` (the one line the run would
end with), ``LEFT <names in ROOT>`` and ``LOADED <value>`` (the previous checkpoint
loaded back) per rank.
"""

import builtins
import errno
import os
import pathlib
import sys
import time
import warnings

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


def disk_full(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def fail_shard_writes() -> None:
    """Opening a .distcp file for writing fails (in this process and the writers it forks)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def full_open(file, mode="r", *args, **kwargs):
        if str(file).endswith(".distcp") and "w" in mode:
            raise disk_full(file)
        return builtins.open(file, mode, *args, **kwargs)

    filesystem_async.open = full_open  # shadows the builtin inside megatron's writer module


def fail_common_write() -> None:
    real_save = torch.save

    def full_save(obj, f, *args, **kwargs):
        if str(f).endswith("common.pt"):
            raise disk_full(f)
        return real_save(obj, f, *args, **kwargs)

    torch.save = full_save


def main(scenario: str, root: pathlib.Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fmt = "torch" if scenario == "torch_corrupt" else "torch_dist"
    layout = {"world_size": dist.get_world_size(), "tp": 1, "pp": 1, "ep": 1, "model": [1, 3, 2, None]}
    ck = Checkpointer(str(root), None, rank, layout, ckpt_format=fmt, async_save=scenario == "async",
                      log=lambda _: None)
    ck.save(1, {"model": Weights(1.0)})
    ck.wait()
    if scenario == "idle":
        print(f"SAVED rank={rank} pid={os.getpid()}", flush=True)
        time.sleep(300)  # the test kills the ranks long before
        return
    error = ""
    try:
        if scenario in ("shard", "async") and rank == 1:
            fail_shard_writes()
        if scenario == "common" and rank == 0:
            fail_common_write()
        if scenario in ("shard", "common", "async"):
            ck.save(2, {"model": Weights(2.0)})
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
        if scenario in ("missing", "torch_corrupt"):
            loader = Checkpointer(None, str(root), rank, layout, ckpt_format=fmt, log=lambda _: None)
            loader.load(loader.find_resume_dir(collective=True), {"model": Weights(0.0)})
    except ConfigError as e:
        error = str(e)
    print(f"ERROR rank={rank} {error}", flush=True)
    dist.barrier()
    print(f"LEFT rank={rank} {sorted(p.name for p in root.iterdir())}", flush=True)
    if scenario in ("shard", "common", "async"):
        loader = Checkpointer(None, str(root), rank, layout, ckpt_format=fmt, log=lambda _: None)
        weights = Weights(0.0)
        loader.load(loader.find_resume_dir(collective=True), {"model": weights})
        print(f"LOADED rank={rank} {weights.w.unique().tolist()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from loco_megatron.platform import detect_platform, platform_context

    warnings.filterwarnings("ignore")
    with platform_context(detect_platform(0)):  # megatron's checkpoint code asks for a CUDA device
        main(sys.argv[1], pathlib.Path(sys.argv[2]))
