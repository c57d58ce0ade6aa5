"""Checkpoint folders on disk: naming, discovery, checksums and the atomic commit.

Both formats write ``SAVE/iter_N.tmp/``; once every rank's write succeeded rank 0
renames it to ``iter_N`` and only then rewrites ``latest`` (write-to-temp + rename),
so a crash at any point leaves the previous checkpoint as the one ``--load`` picks.
Durability: every file is fsynced by the rank that wrote it before the ranks agree, and
the commit fsyncs the folders and ``latest`` around each rename, so a power loss cannot
leave a ``latest`` that names a folder whose files were still in the page cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil

from loco_megatron.config import brief

LATEST = "latest_checkpointed_iteration.txt"
COMMITTED = re.compile(r"iter_(\d{7})")
SIDECAR = "sha256.rank_{rank:05d}.json"
"""torch_dist: per writing rank, {file name: SHA-256} of the files that rank wrote."""


def sharded_backend(path: pathlib.Path) -> str | None:
    """The ``sharded_backend`` a sharded checkpoint folder's ``metadata.json`` names
    (``torch_dist`` or ``fsdp_dtensor``); None when there is no readable one."""
    try:
        return json.loads((path / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return None


def iter_dir(root: pathlib.Path, iteration: int) -> pathlib.Path:
    return root / f"iter_{iteration:07d}"


def committed_checkpoints(root: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """(iteration, folder) of every committed ``iter_N`` in ``root`` (not ``.tmp``/``.old``), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := COMMITTED.fullmatch(p.name))]
    return sorted(found)


def sha256(path: pathlib.Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


SHORT_WRITE = ("unexpected pos", "basic_ios::clear", "iostream error", "file write failed")
"""How torch.save's zip writer reports a write the file system cut short (no errno survives)."""


def cause(e: BaseException, where: pathlib.Path) -> str:
    """A short reason for a failed write. torch.save reports a full disk as a bare
    RuntimeError ('basic_ios::clear: iostream error', '[enforce fail at
    inline_container.cc:672] . unexpected pos 704 vs 598'), so look at the free space too."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    text = brief(e)
    if "no space left on device" in text.lower():
        return "no space left on device"
    try:
        if shutil.disk_usage(where).free < 1 << 20:
            return "no space left on device"
    except OSError:
        pass
    if any(pattern in text for pattern in SHORT_WRITE):
        return f"the file system cut the write short: no space left on device, or over a quota ({text})"
    return text


def fsync(path: pathlib.Path) -> None:
    """Flush a file's (or a folder's entries') data to disk: any descriptor of it will do."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: pathlib.Path, final: pathlib.Path, iteration: int) -> None:
    """Rank 0, after every rank's write finished: ``iter_N.tmp`` -> ``iter_N``, then ``latest``.

    Saving an iteration that already exists moves the old folder to ``iter_N.old`` first;
    a crash between the two renames leaves ``latest`` naming a missing ``iter_N``, which
    :func:`recover_latest` resolves at the next start (``iter_N.old``, else the newest
    complete checkpoint). A stale ``iter_N.old`` next to a present ``iter_N`` is from a
    crash after the second rename: ``iter_N`` is complete, so the stale copy goes.
    """
    old = final.with_name(final.name + ".old")
    fsync(tmp)  # the entries of the files the ranks wrote (their data was fsynced by each writer)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync(final.parent)
    latest_tmp = final.parent / (LATEST + ".tmp")
    write_durably(latest_tmp, f"{iteration}\n")
    os.replace(latest_tmp, final.parent / LATEST)
    fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_latest(root: pathlib.Path, iteration: int) -> tuple[pathlib.Path, str] | None:
    """``latest`` names ``iter_N`` but it is missing (a crash while re-saving iteration N):
    (the folder to resume from, why), or None when nothing usable is left."""
    final = iter_dir(root, iteration)
    old = final.with_name(final.name + ".old")
    if old.is_dir():
        return old, f"{final.name} is missing (a re-save of it was interrupted), so {old.name} is used"
    found = committed_checkpoints(root)
    if found:
        return found[-1][1], f"{final.name} is missing, so the newest complete checkpoint is used"
    return None


def write_sidecar(folder: pathlib.Path, rank: int, names: list[str]) -> None:
    """Record the SHA-256 of the files ``rank`` wrote into ``folder`` (checked at load) and
    fsync them: the sidecar exists only once this rank's files are on disk."""
    digests = {}
    for name in sorted(names):
        digests[name] = sha256(folder / name)
        fsync(folder / name)
    write_durably(folder / SIDECAR.format(rank=rank), json.dumps(digests))


def sidecar_entries(folder: pathlib.Path) -> list[tuple[str, str]]:
    """Every (file name, SHA-256) the writing ranks recorded, sorted by name."""
    out = []
    for side in sorted(folder.glob("sha256.rank_*.json")):
        out.extend(read_json(side).items())
    return sorted(out)


def read_json(path: pathlib.Path) -> dict:
    """A checkpoint's small JSON file (checksums, a rank's layout); ValueError naming the file
    when it is not a JSON object (truncated by a full disk, overwritten, bit rot)."""
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({brief(e)}; a truncated or damaged file?)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object (a damaged file?)")
    return data


def missing_sidecars(folder: pathlib.Path, writers: int) -> list[int]:
    """The ranks among ``writers`` saving ranks whose sidecar is absent: every rank writes one
    (maybe empty), so a missing one is a lost rank's files whose loss its checksums would
    otherwise hide (a shard removed together with its sidecar passes the other checks)."""
    return [r for r in range(writers) if not (folder / SIDECAR.format(rank=r)).is_file()]
