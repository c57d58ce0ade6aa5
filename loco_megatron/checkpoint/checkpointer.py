"""``Checkpointer``: where a run resumes from, the save-target checks, and saving/loading
in either format with atomic commit (see :mod:`loco_megatron.checkpoint.files`).

``--ckpt-format torch`` layout (fast, resumes only with the same layout)::

    SAVE/iter_0000100/rank_00000.pt ...   one file per rank (its TP/PP/DP shard)
    SAVE/iter_0000100/rank_00000.json     SHA-256 of the .pt, the iteration, the layout
    SAVE/latest_checkpointed_iteration.txt

``--ckpt-format torch_dist`` (the default; reshardable): see
:mod:`loco_megatron.checkpoint.torch_dist`. ``--load`` reads either format, whichever the
folder holds. A failed write (disk full, read-only mount) removes ``iter_N.tmp`` and ends
the run with one line.

What is saved: every object registered in ``stateful`` (anything with
``state_dict``/``load_state_dict``: model chunks, optimizer, LR scheduler, the data
iterator, the trainer counters, LoCo's error buffers - the extension point), plus the RNG
states and the parallel layout it was written with.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
import zipfile
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.checkpoint import torch_dist
from loco_megatron.checkpoint.async_save import AsyncWriter
from loco_megatron.checkpoint.files import (LATEST, COMMITTED, cause, commit, committed_checkpoints, iter_dir,
                                           sha256, write_sidecar)
from loco_megatron.checkpoint.rng import rng_state, set_rng_state
from loco_megatron.checkpoint.torch_dist import OPTIONAL_STATES
from loco_megatron.config import ConfigError


class Checkpointer:
    def __init__(self, save: Optional[str], load: Optional[str], rank: int, layout_key: dict,
                 device: Optional[torch.device] = None, ckpt_format: str = "torch", async_save: bool = False,
                 run_config: Optional[dict] = None, log: Callable[[str], None] = print):
        self.save_root = pathlib.Path(save) if save else None
        self.load_root = pathlib.Path(load) if load else None
        self.rank, self.layout_key = rank, layout_key
        self.device = device or torch.device("cpu")  # where the agreement flags live (CUDA for NCCL)
        self.ckpt_format, self.run_config = ckpt_format, run_config
        self.log = log
        """Prints one line (rank 0 only in training)."""
        self.writer = AsyncWriter() if async_save else None
        self.timings: list[dict] = []
        """ckpt/ metrics of saves finished since the last ``take_timings()``."""
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
            path = iter_dir(self.load_root, int(text))
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
        if torch_dist.is_torch_dist(path):
            if self.layout_key:  # a different model shape cannot load; another layout can
                saved = torch_dist.saved_common(path).get("layout", {})
                if saved.get("model") != self.layout_key.get("model"):
                    raise ConfigError(f"--load: {path} holds a model of another shape (saved [layers, hidden, "
                                      f"vocab, experts] {saved.get('model')}, this run {self.layout_key.get('model')})")
            return path
        file = path / f"rank_{self.rank:05d}.pt"
        if not file.is_file():
            raise ConfigError(f"--load: {path} has no file for rank {self.rank}")
        if not zipfile.is_zipfile(file):  # torch.save's format; cheap check before any set-up
            raise ConfigError(f"--load: {file} is not a readable checkpoint")
        self._check_sidecar_layout(path)
        return path

    @staticmethod
    def iteration_of(path: Optional[pathlib.Path]) -> int:
        return int(COMMITTED.fullmatch(path.name).group(1)) if path is not None else 0

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
            raise ConfigError(f"--save: cannot write to {self.save_root} ({cause(e, self.save_root)})") from None
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
        """Collective. Write ``stateful`` at ``iteration`` and commit it. With --async-save
        this returns once the state is handed to the background writer (after waiting for
        the previous save); the commit happens in ``poll``/``wait``."""
        assert self.save_root is not None
        t0 = time.perf_counter()
        self.wait()  # a second save waits for the first (one write in flight)
        final = iter_dir(self.save_root, iteration)
        tmp = final.with_name(final.name + ".tmp")
        error = ""
        if self.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = f"cannot create {tmp} ({cause(e, self.save_root)})"
        if not self._all_ok(not error):
            self._abandon(tmp, error)
        if self.ckpt_format == "torch":
            error = self._write_rank_file(tmp, iteration, stateful)
            self._finish(tmp, final, iteration, t0, error)
            return final
        sd = torch_dist.state_dict(stateful, self.layout_key, self.run_config, iteration,
                                   is_loading=False, per_rank=True)
        try:
            request = torch_dist.save(tmp, sd, async_save=self.writer is not None)
        except Exception as e:  # noqa: BLE001 - DCP wraps OSErrors of any rank in its own exception
            request, error = None, f"writing {tmp} failed ({cause(e, tmp)})"
        if request is None:
            self._finish(tmp, final, iteration, t0, error, lambda: torch_dist.written_by(tmp, self.rank))
        else:
            request.add_finalize_fn(lambda: self._finish(tmp, final, iteration, t0, "",
                                                         lambda: torch_dist.written_by(tmp, self.rank)))
            self.writer.schedule(request)
            self.timings.append({"ckpt/blocking_s": time.perf_counter() - t0, "ckpt/iteration": iteration})
        return final

    def _write_rank_file(self, tmp: pathlib.Path, iteration: int, stateful: dict) -> str:
        """--ckpt-format torch: this rank's whole state into ``rank_R.pt`` (+ its checksum)."""
        payload = {"iteration": iteration, "layout": self.layout_key, "rng": rng_state(),
                   **{name: obj.state_dict() for name, obj in stateful.items()}}
        part = tmp / f"rank_{self.rank:05d}.pt.part"
        try:
            torch.save(payload, part)
            meta = {"iteration": iteration, "sha256": sha256(part), "layout": self.layout_key}
            (tmp / f"rank_{self.rank:05d}.json").write_text(json.dumps(meta))
            os.replace(part, tmp / f"rank_{self.rank:05d}.pt")
        except (OSError, RuntimeError) as e:
            return f"writing {part} failed ({cause(e, tmp)})"
        return ""

    def _finish(self, tmp: pathlib.Path, final: pathlib.Path, iteration: int, t0: float, error: str,
                written: Optional[Callable[[], list]] = None) -> None:
        """Collective, after this rank's write: checksums, agreement, commit by rank 0."""
        if written is not None and not error:
            try:
                write_sidecar(tmp, self.rank, written())
            except OSError as e:
                error = f"writing checksums into {tmp} failed ({cause(e, tmp)})"
        if not self._all_ok(not error):  # every rank's files are complete before the commit
            self._abandon(tmp, error)
        if self.rank == 0:
            commit(tmp, final, iteration)
        dist.barrier()
        write_s = time.perf_counter() - t0
        if self.writer is None:
            self.timings.append({"ckpt/blocking_s": write_s, "ckpt/write_s": write_s, "ckpt/iteration": iteration})
        else:
            self.timings.append({"ckpt/write_s": write_s, "ckpt/iteration": iteration})

    def poll(self) -> None:
        """Collective: commit a background write that every rank finished (no wait)."""
        if self.writer is not None:
            self.writer.poll()

    def wait(self) -> None:
        """Collective: wait for a background write and commit it (before a next save / exit)."""
        if self.writer is not None:
            self.writer.wait()

    def take_timings(self) -> list[dict]:
        out, self.timings = self.timings, []
        return out

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
        """Verify the checksums, restore every registered object and the RNG; returns the
        saved iteration."""
        if torch_dist.is_torch_dist(path):
            return torch_dist.load(path, stateful, self.layout_key, self.log)
        file = path / f"rank_{self.rank:05d}.pt"
        meta = path / f"rank_{self.rank:05d}.json"
        if meta.is_file():  # checkpoints written before checksums have none to verify
            want = json.loads(meta.read_text()).get("sha256")
            if want and sha256(file) != want:
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
