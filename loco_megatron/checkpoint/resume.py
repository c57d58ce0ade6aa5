"""Where a run resumes from and whether ``--save`` is safe: the checks a start makes on
its checkpoint folders before any set-up (data flow: config > these checks > set-up >
training > :class:`~loco_megatron.checkpoint.checkpointer.Checkpointer` saving).

``--load``: which ``iter_N`` folder to resume from (``latest``, else the newest committed
folder, else a fresh start), refused with one line when it holds a model of another shape
or (``--ckpt-format torch``) another parallel layout, or a rank's file is missing or not a
checkpoint. ``--save``: writable, and holding no committed checkpoint newer than where the
run starts (which the run would overwrite). :class:`Checkpointer` keeps the methods that
call these (``find_resume_dir``, ``check_save_target``, ``iteration_of``).
"""

from __future__ import annotations

import os
import pathlib
import zipfile
from typing import Optional

from loco_megatron.checkpoint import torch_dist
from loco_megatron.checkpoint.files import LATEST, COMMITTED, cause, committed_checkpoints, iter_dir, read_json, \
    recover_latest
from loco_megatron.checkpoint.model_shape import shape_difference
from loco_megatron.config import ConfigError
from loco_megatron.data.inputs import check_load_folder


def find_resume_dir(load_root: Optional[pathlib.Path], rank: int, layout_key: dict,
                    collective: bool = False) -> tuple[Optional[pathlib.Path], str]:
    """(the checkpoint ``--load`` (``load_root``) resumes from, None to start fresh; one
    line for the console saying which and why); ConfigError if bad.

    No ``latest`` file but committed ``iter_N`` folders (the file was lost, or the folder
    was copied without it): resume from the newest one, saying so, rather than start
    fresh and later overwrite them. ``iter_N`` folders only exist once every rank's
    file was written, so the newest is complete. ``latest`` naming a missing folder (a
    crash while re-saving that iteration): ``iter_N.old``, else the newest complete one.

    ``collective`` (after the process group exists): also check this rank's (``rank``)
    own file (--ckpt-format torch) and agree on the outcome, so a bad file on one rank
    fails every rank with the same line; without it (the pre-check before set-up, where a
    lone rank's exit would leave the others waiting at start-up) they are skipped.
    ``layout_key``: the run's layout (empty: not known yet, the model shape is not compared).
    """
    if load_root is None:
        return None, "starting fresh (no --load)"
    check_load_folder(str(load_root))  # a file: not "no checkpoint in it, starting fresh"
    latest = load_root / LATEST
    if latest.is_file():
        text = latest.read_text().strip()
        if not text.isdigit():
            raise ConfigError(f"--load: {latest} does not hold an iteration number")
        path = iter_dir(load_root, int(text))
        note = f"resuming from {path} ({LATEST})"
        if not path.is_dir():
            found = recover_latest(load_root, int(text))
            if found is None:
                raise ConfigError(f"--load: {latest} names iteration {int(text)} but {path} does not exist")
            path, why = found
            note = f"resuming from {path}: {LATEST} names iteration {int(text)} but {why}"
    else:
        found = committed_checkpoints(load_root)
        if not found:
            return None, f"starting fresh: no checkpoint in --load {load_root}"
        path = found[-1][1]
        note = f"resuming from {path}: {load_root} has no {LATEST}, so the newest complete checkpoint is used"
    if torch_dist.is_sharded(path):
        if layout_key:  # a different model shape cannot load; another layout can
            error = ""
            try:
                saved = torch_dist.saved_common(path).get("layout", {})
                differs = shape_difference(saved.get("model"), layout_key.get("model"))
                if differs:
                    error = f"--load: {path} holds a model of another shape ({differs})"
                else:
                    error = optimizer_difference(saved, layout_key, path)
            except ConfigError as e:  # e.g. a truncated common.pt
                error = str(e)
            if collective:  # agreed: printed once, and no rank goes on alone if only some failed
                torch_dist.agree_or_raise(error)
            elif error:
                raise ConfigError(error)
        return path, note
    if collective:
        error = ""
        file = path / f"rank_{rank:05d}.pt"
        if not file.is_file():
            error = f"--load: {path} has no file for rank {rank}"
        elif not zipfile.is_zipfile(file):  # torch.save's format; cheap check before any set-up
            error = f"--load: {file} is not a readable checkpoint (rank {rank})"
        else:
            try:
                check_sidecar_layout(path, rank, layout_key)
            except ConfigError as e:
                error = str(e)
        torch_dist.agree_or_raise(error)
    return path, note


def iteration_of(path: Optional[pathlib.Path]) -> int:
    """The iteration of an ``iter_N`` (or ``iter_N.old``) folder; 0 for None (a fresh start)."""
    return int(COMMITTED.match(path.name).group(1)) if path is not None else 0


def check_sidecar_layout(path: pathlib.Path, rank: int, layout_key: dict) -> None:
    """--ckpt-format torch: refuse a layout mismatch from the small ``rank_R.json`` of
    ``rank`` in ``path`` (before the model is built)."""
    meta = path / f"rank_{rank:05d}.json"
    if not layout_key or not meta.is_file():
        return  # pre-check without a layout yet, or a checkpoint older than the sidecars
    try:
        saved = read_json(meta).get("layout", {})
    except ValueError as e:
        raise ConfigError(f"--load: {e}") from None
    compare_layout(saved, layout_key, path)


def compare_layout(saved: dict, layout_key: dict, path: pathlib.Path) -> None:
    """ConfigError (one line) when the ``saved`` layout of the checkpoint at ``path`` is not
    the run's ``layout_key``: the model's shape first, then the parallel layout."""
    differs = shape_difference(saved.get("model"), layout_key.get("model"))
    if differs:
        raise ConfigError(f"--load: {path} holds a model of another shape ({differs})")
    if optimizer_difference(saved, layout_key, path):
        raise ConfigError(optimizer_difference(saved, layout_key, path))
    diff = {k: (saved.get(k), v) for k, v in layout_key.items() if k != "model" and saved.get(k) != v}
    if diff:
        raise ConfigError(f"--load: {path} was saved with a different model/parallel layout (saved vs now: {diff})")


def optimizer_difference(saved: dict, layout_key: dict, path: pathlib.Path) -> str:
    """The one-line refusal of a resume under another --optimizer ("" when it is the same):
    AdamW's moments and Muon's momentum cannot stand in for each other, and a run must not
    silently start one of them from zero (a layout key without it: adam)."""
    was, now = saved.get("optimizer", "adam"), layout_key.get("optimizer", "adam")
    if was == now:
        return ""
    return (f"--load: {path} was trained with --optimizer {was} and this run asks for --optimizer {now}; "
            f"the optimizer state of one cannot become the other's: resume with --optimizer {was}")


def check_save_target(save_root: Optional[pathlib.Path], rank: int, resume: Optional[pathlib.Path]) -> None:
    """Every rank, before any set-up: ``--save`` (``save_root``; None: nothing to check)
    is writable (probe file created and removed), and, unless the run resumes from that
    same folder, no committed checkpoint there is newer than where this run starts
    (``resume``; it would be overwritten: e.g. a fresh start after a mistyped --load, or
    another run's folder)."""
    if save_root is None:
        return
    probe = save_root / f".write_probe.rank{rank}.{os.getpid()}"
    try:
        save_root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--save: cannot write to {save_root} ({cause(e, save_root)})") from None
    if resume is not None and resume.parent.resolve() == save_root.resolve():
        # Same run resuming (--load = --save): a newer folder can only be one committed
        # just before a crash cut the `latest` update; the resume re-creates it bit-exactly.
        return
    start = iteration_of(resume)
    newer = [p.name for it, p in committed_checkpoints(save_root) if it > start]
    if newer:
        raise ConfigError(
            f"--save: {save_root} already holds {', '.join(newer[-3:])}, newer than the iteration "
            f"this run starts from ({start}); they would be overwritten: resume with --load "
            f"{save_root}, or move them away")
