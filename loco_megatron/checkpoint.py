"""Per-rank checkpoints with atomic commit and bit-exact resume.

Layout::

    SAVE/iter_0000100/rank_00000.pt ...   one file per rank (its TP/PP/DP shard)
    SAVE/latest_checkpointed_iteration.txt

Each rank writes into ``iter_N.tmp/`` its ``rank_R.pt`` and a ``rank_R.json`` (SHA-256 of
the ``.pt``, the iteration, the layout); once every rank succeeded (one all-reduce) rank
0 renames the folder to ``iter_N`` and only then rewrites the ``latest`` file
(write-to-temp + rename). A crash at any point leaves the previous checkpoint as the
one ``--load`` picks; a failed write (disk full, read-only mount) removes ``iter_N.tmp``
and ends the run with one line. At load the checksum is verified before unpickling.

What a rank saves: every object registered in ``stateful`` (anything with
``state_dict``/``load_state_dict``: model chunks, optimizer, LR scheduler, the data
iterator, the trainer counters, LoCo's error buffers — the extension point), plus
the RNG states and the parallel layout it was written with.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import random
import shutil
import zipfile
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from loco_megatron.config import ConfigError

LATEST = "latest_checkpointed_iteration.txt"
_COMMITTED = re.compile(r"iter_(\d{7})")
OPTIONAL_STATES = ("health",)
"""States absent from checkpoints written before they existed; those load without them."""


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


def committed_checkpoints(root: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """(iteration, folder) of every committed ``iter_N`` in ``root`` (not ``.tmp``/``.old``), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _COMMITTED.fullmatch(p.name))]
    return sorted(found)


def _sha256(path: pathlib.Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _cause(e: BaseException, where: pathlib.Path) -> str:
    """A short reason for a failed write. torch.save reports a full disk as a bare
    RuntimeError ('basic_ios::clear: iostream error'), so look at the free space too."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    try:
        if shutil.disk_usage(where).free < 1 << 20:
            return "no space left on device"
    except OSError:
        pass
    return str(e).splitlines()[0][:120] if str(e) else type(e).__name__


class Checkpointer:
    def __init__(self, save: Optional[str], load: Optional[str], rank: int, layout_key: dict,
                 device: Optional[torch.device] = None):
        self.save_root = pathlib.Path(save) if save else None
        self.load_root = pathlib.Path(load) if load else None
        self.rank, self.layout_key = rank, layout_key
        self.device = device or torch.device("cpu")  # where the agreement flags live (CUDA for NCCL)
        self.start_note = ""
        """One line for the console: resuming (from where, and why that one) or starting fresh."""

    # -- discovery / validation (before training starts) ------------------------------
    def find_resume_dir(self) -> Optional[pathlib.Path]:
        """The checkpoint ``--load`` resumes from, None to start fresh; ConfigError if bad.

        No ``latest`` file but committed ``iter_N`` folders (the file was lost, or the folder
        was copied without it): resume from the newest one, saying so, rather than start
        fresh and later overwrite them. ``iter_N`` folders only exist once every rank's
        file was written, so the newest is complete.
        """
        if self.load_root is None:
            self.start_note = "starting fresh (no --load)"
            return None
        latest = self.load_root / LATEST
        if latest.is_file():
            text = latest.read_text().strip()
            if not text.isdigit():
                raise ConfigError(f"--load: {latest} does not hold an iteration number")
            path = _iter_dir(self.load_root, int(text))
            if not path.is_dir():
                raise ConfigError(f"--load: {latest} names iteration {int(text)} but {path} does not exist")
            self.start_note = f"resuming from {path} ({LATEST})"
        else:
            found = committed_checkpoints(self.load_root)
            if not found:
                self.start_note = f"starting fresh: no checkpoint in --load {self.load_root}"
                return None
            path = found[-1][1]
            self.start_note = (f"resuming from {path}: {self.load_root} has no {LATEST}, "
                               f"so the newest complete checkpoint is used")
        file = path / f"rank_{self.rank:05d}.pt"
        if not file.is_file():
            raise ConfigError(f"--load: {path} has no file for rank {self.rank}")
        if not zipfile.is_zipfile(file):  # torch.save's format; cheap check before any set-up
            raise ConfigError(f"--load: {file} is not a readable checkpoint")
        self._check_sidecar_layout(path)
        return path

    @staticmethod
    def iteration_of(path: Optional[pathlib.Path]) -> int:
        return int(_COMMITTED.fullmatch(path.name).group(1)) if path is not None else 0

    def _check_sidecar_layout(self, path: pathlib.Path) -> None:
        """Refuse a layout mismatch from the small ``rank_R.json`` (before the model is built)."""
        meta = path / f"rank_{self.rank:05d}.json"
        if not self.layout_key or not meta.is_file():
            return  # pre-check without a layout yet, or a checkpoint older than the sidecars
        saved = json.loads(meta.read_text()).get("layout", {})
        self._compare_layout(saved, path)

    def _compare_layout(self, saved: dict, path: pathlib.Path) -> None:
        if saved != self.layout_key:
            diff = {k: (saved.get(k), v) for k, v in self.layout_key.items() if saved.get(k) != v}
            raise ConfigError(f"--load: {path} was saved with a different model/parallel layout "
                              f"(saved vs now: {diff})")

    def check_save_target(self, resume: Optional[pathlib.Path]) -> None:
        """Every rank, before any set-up: ``--save`` is writable (probe file created and
        removed), and, unless the run resumes from that same folder, no committed
        checkpoint there is newer than where this run starts (it would be overwritten:
        e.g. a fresh start after a mistyped --load, or another run's folder)."""
        if self.save_root is None:
            return
        probe = self.save_root / f".write_probe.rank{self.rank}.{os.getpid()}"
        try:
            self.save_root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"--save: cannot write to {self.save_root} ({_cause(e, self.save_root)})") from None
        if resume is not None and resume.parent.resolve() == self.save_root.resolve():
            # Same run resuming (--load = --save): a newer folder can only be one committed
            # just before a crash cut the `latest` update; the resume re-creates it bit-exactly.
            return
        start = self.iteration_of(resume)
        newer = [p.name for it, p in committed_checkpoints(self.save_root) if it > start]
        if newer:
            raise ConfigError(
                f"--save: {self.save_root} already holds {', '.join(newer[-3:])}, newer than the iteration "
                f"this run starts from ({start}); they would be overwritten: resume with --load "
                f"{self.save_root}, or move them away")

    # -- save ---------------------------------------------------------------------------
    def _all_ok(self, ok: bool) -> bool:
        """Collective: True when every rank's ``ok`` is (replaces a barrier)."""
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0.0

    def save(self, iteration: int, stateful: dict) -> pathlib.Path:
        assert self.save_root is not None
        final = _iter_dir(self.save_root, iteration)
        tmp = final.with_name(final.name + ".tmp")
        error = ""
        if self.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = f"cannot create {tmp} ({_cause(e, self.save_root)})"
        if self._all_ok(not error):
            payload = {"iteration": iteration, "layout": self.layout_key, "rng": rng_state(),
                       **{name: obj.state_dict() for name, obj in stateful.items()}}
            part = tmp / f"rank_{self.rank:05d}.pt.part"
            try:
                torch.save(payload, part)
                meta = {"iteration": iteration, "sha256": _sha256(part), "layout": self.layout_key}
                (tmp / f"rank_{self.rank:05d}.json").write_text(json.dumps(meta))
                os.replace(part, tmp / f"rank_{self.rank:05d}.pt")
            except (OSError, RuntimeError) as e:
                error = f"writing {part} failed ({_cause(e, tmp)})"
        if not self._all_ok(not error):  # every rank's file is complete before the commit
            self._abandon(tmp, error)
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

    def _abandon(self, tmp: pathlib.Path, error: str) -> None:
        """Collective failure path: the same one line on every rank, no partial folder."""
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        first = next(e for e in errors if e)
        kept = committed_checkpoints(self.save_root)
        kept_note = f"{kept[-1][1].name} is the latest checkpoint" if kept else "no earlier checkpoint"
        raise ConfigError(f"--save: {first}; removed {tmp.name}, {kept_note}")

    # -- load ---------------------------------------------------------------------------
    def load(self, path: pathlib.Path, stateful: dict) -> int:
        """Verify the checksum, restore every registered object and the RNG; returns the
        saved iteration."""
        file = path / f"rank_{self.rank:05d}.pt"
        meta = path / f"rank_{self.rank:05d}.json"
        if meta.is_file():  # checkpoints written before checksums have none to verify
            want = json.loads(meta.read_text()).get("sha256")
            if want and _sha256(file) != want:
                raise ConfigError(f"--load: {file} does not match its checksum in {meta.name} (corrupt file)")
        try:
            payload = torch.load(file, map_location="cpu", weights_only=False)
        except Exception as e:
            raise ConfigError(f"--load: {file} is not a readable checkpoint ({str(e).splitlines()[0][:100]})") from None
        self._compare_layout(payload.get("layout", {}), path)
        for name, obj in stateful.items():
            if name not in payload:
                if name in OPTIONAL_STATES:
                    continue
                raise ConfigError(f"--load: {file} has no '{name}' state")
            obj.load_state_dict(payload[name])
        set_rng_state(payload["rng"])
        return int(payload["iteration"])
