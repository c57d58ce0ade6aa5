"""Checkpoint folders on disk: naming, discovery, checksums and the atomic commit.

Both formats write ``SAVE/iter_N.tmp/``; once every rank's write succeeded rank 0
renames it to ``iter_N`` and only then rewrites ``latest`` (write-to-temp + rename),
so a crash at any point leaves the previous checkpoint as the one ``--load`` picks.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil

LATEST = "latest_checkpointed_iteration.txt"
COMMITTED = re.compile(r"iter_(\d{7})")
SIDECAR = "sha256.rank_{rank:05d}.json"
"""torch_dist: per writing rank, {file name: SHA-256} of the files that rank wrote."""


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


def cause(e: BaseException, where: pathlib.Path) -> str:
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


def commit(tmp: pathlib.Path, final: pathlib.Path, iteration: int) -> None:
    """Rank 0, after every rank's write finished: ``iter_N.tmp`` -> ``iter_N``, then ``latest``."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    latest_tmp = final.parent / (LATEST + ".tmp")
    latest_tmp.write_text(f"{iteration}\n")
    os.replace(latest_tmp, final.parent / LATEST)
    shutil.rmtree(old, ignore_errors=True)


def write_sidecar(folder: pathlib.Path, rank: int, names: list[str]) -> None:
    """Record the SHA-256 of the files ``rank`` wrote into ``folder`` (checked at load)."""
    digests = {name: sha256(folder / name) for name in sorted(names)}
    (folder / SIDECAR.format(rank=rank)).write_text(json.dumps(digests))


def sidecar_entries(folder: pathlib.Path) -> list[tuple[str, str]]:
    """Every (file name, SHA-256) the writing ranks recorded, sorted by name."""
    out = []
    for side in sorted(folder.glob("sha256.rank_*.json")):
        out.extend(json.loads(side.read_text()).items())
    return sorted(out)
