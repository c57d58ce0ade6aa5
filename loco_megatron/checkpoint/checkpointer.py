"""``Checkpointer``: saving and loading a run's state in either format, with atomic commit
(see :mod:`loco_megatron.checkpoint.files`), at the end of the data flow (the trainer hands
it every stateful object after the gradient and parameter sync of a step). Where a run
resumes from and the ``--save`` checks before set-up: :mod:`loco_megatron.checkpoint.resume`
(its methods ``find_resume_dir``/``check_save_target`` call there).

``--ckpt-format torch`` layout (fast, resumes only with the same layout)::

    SAVE/iter_0000100/rank_00000.pt ...   one file per rank (its TP/PP/DP shard)
    SAVE/iter_0000100/rank_00000.json     SHA-256 of the .pt, the iteration, the layout
    SAVE/latest_checkpointed_iteration.txt

``--ckpt-format torch_dist`` (the default; reshardable): see
:mod:`loco_megatron.checkpoint.torch_dist`; ``fsdp_dtensor`` (``--use-megatron-fsdp`` only,
reshardable, the same folder conventions): :mod:`loco_megatron.checkpoint.fsdp_dtensor`.
``--load`` reads any of them, whichever the folder holds. A failed write (disk full,
read-only mount) on any rank, in the foreground or the background, removes ``iter_N.tmp`` and ends the run on every rank with the same one
line naming the file and the rank: each rank catches its own failure, then all agree in
one collective before any other, so no rank is left waiting in a collective the others
skipped. A checkpoint counts as complete only once every writing rank's checksums exist.

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
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.checkpoint import agreed_save, fsdp_dtensor, resume, torch_dist
from loco_megatron.checkpoint.async_save import AsyncWriter
from loco_megatron.checkpoint.files import (cause, commit, committed_checkpoints, fsync, iter_dir, read_json, sha256,
                                           write_durably, write_sidecar)
from loco_megatron.checkpoint.load_notes import announce
from loco_megatron.checkpoint.rng import rng_state, set_rng_state
from loco_megatron.checkpoint.torch_dist import OPTIONAL_STATES
from loco_megatron.config import ConfigError, brief


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
        self.in_flight: Optional[tuple[pathlib.Path, int]] = None
        """--async-save: (iter_N.tmp, N) of the write handed to the background, until committed."""
        self.timings: list[dict] = []
        """ckpt/ metrics of saves finished since the last ``take_timings()``."""
        self.start_note = ""
        """One line for the console: resuming (from where, and why that one) or starting fresh."""

    # -- discovery / validation (before training starts): see resume.py ----------------
    def find_resume_dir(self, collective: bool = False) -> Optional[pathlib.Path]:
        """The checkpoint ``--load`` resumes from, None to start fresh; ConfigError if bad
        (:func:`.resume.find_resume_dir`, whose line is kept in :attr:`start_note`)."""
        path, self.start_note = resume.find_resume_dir(self.load_root, self.rank, self.layout_key, collective)
        return path

    iteration_of = staticmethod(resume.iteration_of)

    def check_save_target(self, resume_dir: Optional[pathlib.Path]) -> None:
        """``--save`` writable and holding nothing newer than ``resume_dir`` (:func:`.resume.check_save_target`)."""
        resume.check_save_target(self.save_root, self.rank, resume_dir)

    def _agree_or_raise(self, error: str) -> None:
        """Collective: every rank raises the first (lowest rank's) error, or none does."""
        torch_dist.agree_or_raise(error)

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
        try:
            if self.ckpt_format == fsdp_dtensor.FORMAT:
                request = fsdp_dtensor.save(tmp, stateful, self.layout_key, self.run_config, iteration,
                                            self.writer is not None, self.device)
            else:
                request = agreed_save.save(
                    tmp, lambda: torch_dist.state_dict(stateful, self.layout_key, self.run_config, iteration,
                                                       is_loading=False, per_rank=True),
                    self.writer is not None, self.device, torch_dist.start_writer_manager_detached,
                    torch_dist.without_clock)
        except agreed_save.SaveFailed as e:  # every rank raised it at the same step
            self._abandon(tmp, str(e))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException (every rank) is a BaseException
            request, error = None, self._write_failure(e, tmp)
        if request is None:
            self._finish(tmp, final, iteration, t0, error, lambda: torch_dist.written_by(tmp, self.rank))
            return final
        request.add_finalize_fn(lambda: self._finish(tmp, final, iteration, t0, "",
                                                     lambda: torch_dist.written_by(tmp, self.rank)))
        try:  # stages to host memory in the foreground (on this rank only), then forks the writer
            self.writer.schedule(request)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory while staging
            error = f"staging {tmp} for --async-save failed on rank {self.rank} ({cause(e, tmp)})"
        if not self._all_ok(not error):
            self.writer.wait_local()  # the ranks that did schedule: their writes end before the folder goes
            self._abandon(tmp, error)
        self.in_flight = (tmp, iteration)
        self.timings.append({"ckpt/blocking_s": time.perf_counter() - t0, "ckpt/iteration": iteration})
        return final

    @staticmethod
    def _write_failure(e: BaseException, tmp: pathlib.Path) -> str:
        """This rank's line for a failed torch_dist write; never empty, as it is the failure flag."""
        return torch_dist.describe_write_failure(e, tmp) or f"writing {tmp} failed (details on rank 0)"

    def _write_rank_file(self, tmp: pathlib.Path, iteration: int, stateful: dict) -> str:
        """--ckpt-format torch: this rank's whole state into ``rank_R.pt`` (+ its checksum);
        this rank's one line when that failed (the caller's agreement ends the save)."""
        part = tmp / f"rank_{self.rank:05d}.pt.part"
        try:
            payload = {"iteration": iteration, "layout": self.layout_key, "rng": rng_state(),
                       **{name: obj.state_dict() for name, obj in stateful.items()}}
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the others must not wait for this rank
            return f"building the state to save into {tmp} failed on rank {self.rank} ({cause(e, tmp)})"
        try:
            torch.save(payload, part)
            fsync(part)
            meta = {"iteration": iteration, "sha256": sha256(part), "layout": self.layout_key}
            write_durably(tmp / f"rank_{self.rank:05d}.json", json.dumps(meta))
            os.replace(part, tmp / f"rank_{self.rank:05d}.pt")
        except Exception as e:  # noqa: BLE001 - torch.save reports a full disk as a RuntimeError
            return f"writing {part} failed on rank {self.rank} ({cause(e, tmp)})"
        return ""

    def _finish(self, tmp: pathlib.Path, final: pathlib.Path, iteration: int, t0: float, error: str,
                written: Optional[Callable[[], list]] = None) -> None:
        """Collective, after this rank's write: checksums, agreement, commit by rank 0."""
        if written is not None and not error:
            try:
                write_sidecar(tmp, self.rank, written())
            except OSError as e:
                error = f"writing checksums into {tmp} failed on rank {self.rank} ({cause(e, tmp)})"
        if not self._all_ok(not error):  # every rank's files are complete before the commit
            self._abandon(tmp, error)
        self.in_flight = None
        error = ""
        if self.rank == 0:
            try:
                commit(tmp, final, iteration)
            except OSError as e:  # e.g. the disk filled up between the shards and `latest`
                error = f"--save: committing {final} failed on rank 0 ({cause(e, final.parent)})"
        self._agree_or_raise(error)  # in place of a barrier: the others learn of rank 0's failure
        write_s = time.perf_counter() - t0
        if self.writer is None:
            self.timings.append({"ckpt/blocking_s": write_s, "ckpt/write_s": write_s, "ckpt/iteration": iteration})
        else:
            self.timings.append({"ckpt/write_s": write_s, "ckpt/iteration": iteration})

    def poll(self) -> None:
        """Collective: commit a background write that every rank finished (no wait)."""
        self._finalize(self.writer.poll if self.writer is not None else None)

    def wait(self) -> None:
        """Collective: wait for a background write and commit it (before a next save / exit)."""
        self._finalize(self.writer.wait if self.writer is not None else None)

    def _finalize(self, step: Optional[Callable[[], None]]) -> None:
        """A background write that failed (on any rank) raises DCP's CheckpointException on
        every rank in megatron's finalization: turn it into the same agreed one-line
        failure as a foreground write, with ``iter_N.tmp`` removed."""
        if step is None or self.in_flight is None:
            return
        try:
            step()
        except ConfigError:  # _finish already agreed on a failure and abandoned the folder
            self.in_flight = None
            raise
        except agreed_save.SaveFailed as e:  # the metadata finalizer's agreement: on every rank
            tmp, _ = self.in_flight
            self.in_flight = None
            self._abandon(tmp, str(e))
        except torch_dist.checkpoint_exception() as e:  # a BaseException, raised on every rank
            tmp, _ = self.in_flight
            self.in_flight = None
            self._abandon(tmp, self._write_failure(e, tmp))

    def finish_in_flight(self, agreed: bool) -> str:
        """On the way out of an aborted run: the one line saying what became of an
        in-flight --async-save ("" when there is none). ``agreed`` (every rank is leaving
        at this same point, e.g. --max-skipped-consecutive or a stop request): finalize it,
        a collective, so a fully written checkpoint is committed rather than lost. Else (an
        error on this rank the others may not share) only wait for this rank's write to end:
        no collective could complete, and ``iter_N.tmp`` stays uncommitted."""
        if self.in_flight is None:
            return ""
        tmp, iteration = self.in_flight
        if not agreed:
            self.writer.wait_local()
            self.in_flight = None
            return (f"--async-save: waited for the in-flight save of iteration {iteration} on rank {self.rank}; "
                    f"not committed ({tmp.name} is left for the next save to replace)")
        try:
            self.wait()
        except ConfigError as e:
            return f"--async-save: the in-flight save of iteration {iteration} failed: {e}"
        return f"--async-save: finished and committed the in-flight save of iteration {iteration} before stopping"

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
        first = next((e for e in errors if e), f"writing {tmp} failed")
        kept = committed_checkpoints(self.save_root)
        kept_note = f"{kept[-1][1].name} is the latest checkpoint" if kept else "no earlier checkpoint"
        error = ConfigError(f"--save: {first}; removed {tmp.name}, {kept_note}")
        error.agreed = True  # every rank raises this same line: rank 0 prints it, once
        raise error

    # -- load ---------------------------------------------------------------------------
    def load(self, path: pathlib.Path, stateful: dict) -> int:
        """Verify the checksums, restore every registered object and the RNG; returns the
        saved iteration."""
        t0 = time.perf_counter()
        fsdp_run, fsdp_ckpt = "fsdp" in self.layout_key, fsdp_dtensor.is_fsdp_dtensor(path)
        if torch_dist.is_sharded(path) and fsdp_run != fsdp_ckpt:
            # Each format's model state is its wrapper's: neither loads into the other.
            error = ConfigError(f"--load: {path} is {'an fsdp_dtensor' if fsdp_ckpt else 'a torch_dist'} checkpoint, "
                                f"which loads {'only' if fsdp_ckpt else 'not'} with --use-megatron-fsdp")
            error.agreed = True  # every rank finds the same from the same files: printed once
            raise error
        if fsdp_ckpt:
            iteration = fsdp_dtensor.load(path, stateful, self.layout_key, self.log)
        elif torch_dist.is_sharded(path):
            iteration = torch_dist.load(path, stateful, self.layout_key, self.log)
        else:
            iteration = self._load_rank_file(path, stateful)
        # Resets and take-overs each rank's hooks decided alone: agreed, said once by rank 0.
        announce(stateful.values(), self.log)
        self.timings.append({"ckpt/load_s": time.perf_counter() - t0, "ckpt/iteration": iteration})
        return iteration

    def _load_rank_file(self, path: pathlib.Path, stateful: dict) -> int:
        """Collective: each rank checks and reads its own file, then all agree (as torch_dist
        does), so a corrupt file on one rank fails every rank with the same line instead
        of one rank's error racing the others' next collective."""
        file = path / f"rank_{self.rank:05d}.pt"
        meta = path / f"rank_{self.rank:05d}.json"
        error, payload, want = "", None, None
        try:
            want = read_json(meta).get("sha256") if meta.is_file() else None  # older: no checksums
        except ValueError as e:
            error = f"--load: {e}"
        if want and sha256(file) != want:
            error = f"--load: {file} does not match its checksum in {meta.name} (corrupt file, rank {self.rank})"
        elif not error:
            try:
                payload = torch.load(file, map_location="cpu", weights_only=False)
            except Exception as e:  # noqa: BLE001 - any unreadable file is the same one-line error
                error = f"--load: {file} is not a readable checkpoint on rank {self.rank} ({brief(e)})"
        self._agree_or_raise(error)
        resume.compare_layout(payload.get("layout", {}), self.layout_key, path)
        for name, obj in stateful.items():
            if name not in payload:
                if name in OPTIONAL_STATES:
                    continue
                raise ConfigError(f"--load: {file} has no '{name}' state")
            obj.load_state_dict(payload[name])
        set_rng_state(payload["rng"])
        return int(payload["iteration"])
