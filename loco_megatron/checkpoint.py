"""Per-rank checkpoints with atomic commit and bit-exact resume.

Layout::

    SAVE/iter_0000100/rank_00000.pt ...   one file per rank (its TP/PP/DP shard)
    SAVE/latest_checkpointed_iteration.txt

Each rank writes into ``iter_N.tmp/``; after a barrier rank 0 renames the folder to
``iter_N`` and only then rewrites the ``latest`` file (write-to-temp + rename). A
crash at any point leaves the previous checkpoint as the one ``--load`` picks.

What a rank saves: every object registered in ``stateful`` (anything with
``state_dict``/``load_state_dict``: model chunks, optimizer, LR scheduler, the data
iterator, the trainer counters, LoCo's error buffers — the extension point), plus
the RNG states and the parallel layout it was written with.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import zipfile
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from loco_megatron.config import ConfigError

LATEST = "latest_checkpointed_iteration.txt"


def _iter_dir(root: pathlib.Path, iteration: int) -> pathlib.Path:
    return root / f"iter_{iteration:07d}"


def rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


class Checkpointer:
    def __init__(self, save: Optional[str], load: Optional[str], rank: int, layout_key: dict):
        self.save_root = pathlib.Path(save) if save else None
        self.load_root = pathlib.Path(load) if load else None
        self.rank, self.layout_key = rank, layout_key

    # -- discovery / validation (before training starts) ------------------------------
    def find_resume_dir(self) -> Optional[pathlib.Path]:
        """The checkpoint ``--load`` resumes from, None to start fresh; ConfigError if bad."""
        if self.load_root is None:
            return None
        latest = self.load_root / LATEST
        if not latest.is_file():
            return None  # nothing saved yet (e.g. first run of an auto-resuming job)
        text = latest.read_text().strip()
        if not text.isdigit():
            raise ConfigError(f"--load: {latest} does not hold an iteration number")
        path = _iter_dir(self.load_root, int(text))
        file = path / f"rank_{self.rank:05d}.pt"
        if not file.is_file():
            raise ConfigError(f"--load: {path} has no file for rank {self.rank}")
        if not zipfile.is_zipfile(file):  # torch.save's format; cheap check before any set-up
            raise ConfigError(f"--load: {file} is not a readable checkpoint")
        return path

    # -- save ---------------------------------------------------------------------------
    def save(self, iteration: int, stateful: dict) -> pathlib.Path:
        assert self.save_root is not None
        final = _iter_dir(self.save_root, iteration)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        payload = {"iteration": iteration, "layout": self.layout_key, "rng": rng_state(),
                   **{name: obj.state_dict() for name, obj in stateful.items()}}
        part = tmp / f"rank_{self.rank:05d}.pt.part"
        torch.save(payload, part)
        os.replace(part, tmp / f"rank_{self.rank:05d}.pt")
        dist.barrier()  # every rank's file is complete before the commit
        if self.rank == 0:
            old = final.with_name(final.name + ".old")
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            latest_tmp = self.save_root / (LATEST + ".tmp")
            latest_tmp.write_text(f"{iteration}\n")
            os.replace(latest_tmp, self.save_root / LATEST)
            shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    # -- load ---------------------------------------------------------------------------
    def load(self, path: pathlib.Path, stateful: dict) -> int:
        """Restore every registered object and the RNG; returns the saved iteration."""
        file = path / f"rank_{self.rank:05d}.pt"
        try:
            payload = torch.load(file, map_location="cpu", weights_only=False)
        except Exception as e:
            raise ConfigError(f"--load: {file} is not a readable checkpoint ({str(e).splitlines()[0][:100]})") from None
        if payload.get("layout") != self.layout_key:
            diff = {k: (payload.get("layout", {}).get(k), v) for k, v in self.layout_key.items()
                    if payload.get("layout", {}).get(k) != v}
            raise ConfigError(f"--load: {path} was saved with a different model/parallel layout "
                              f"(saved vs now: {diff})")
        for name, obj in stateful.items():
            if name not in payload:
                raise ConfigError(f"--load: {file} has no '{name}' state")
            obj.load_state_dict(payload[name])
        set_rng_state(payload["rng"])
        return int(payload["iteration"])
