"""Megatron's dataset index caches in a folder that several jobs share (elastic DiLoCo's
replica jobs, each with a global rank 0 of its own): one job writing slowly while another
starts."""

from __future__ import annotations

import io
import time

import torch.multiprocessing as mp


def _job(cache: str, index_cache: str, slow: bool, ready, building, queue) -> None:
    """One job of one rank (no torch.distributed: its own rank 0) building the train and
    validation datasets of the tiny default run; ``slow``: its first shuffle index is
    written half (then ``ready``), and the rest 3 s after the other job has begun its build
    (``building``), as a large index on a slow filesystem would be. Puts (slow, the first
    samples' token sums or the error)."""
    import numpy

    from loco_megatron.cli import parse_config
    from loco_megatron.data.dataset import build_datasets, resolve_data

    if slow:
        real = numpy.save

        def save(file, arr, *args, **kwargs):
            if not str(file).endswith("shuffle_index.npy") or ready.is_set():
                return real(file, arr, *args, **kwargs)
            buf = io.BytesIO()
            real(buf, arr, *args, **kwargs)
            data = buf.getvalue()
            with open(file, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                ready.set()
                building.wait(300)
                time.sleep(3)
                f.write(data[len(data) // 2:])

        numpy.save = save
    config = parse_config(["--train-iters", "20", "--eval-interval", "0"])
    sources = resolve_data(config, cache)
    if not slow:
        building.set()
    try:
        train, _ = build_datasets(config, sources, index_cache)
        queue.put((slow, [int(train[i]["tokens"].sum()) for i in range(4)]))
    except Exception as err:  # (reported to the test, which names it)
        queue.put((slow, f"{type(err).__name__}: {err}"))


def test_jobs_sharing_the_index_cache_never_read_a_file_being_written(cache_dir, tmp_path):
    """Guards against a job reading megatron's shuffle index while another job's rank 0 is
    still writing it (3 elastic replica jobs started together on one cache folder: 'mmap
    length is greater than file size', the job died at start-up): job A writes its shuffle
    index slowly; job B, started once half of it is on disk, finds the other index files
    there and would read the half file; under the cache lock it waits, and both build the
    same samples."""
    ctx = mp.get_context("spawn")
    ready, building, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    index_cache = str(tmp_path / "index")
    a = ctx.Process(target=_job, args=(cache_dir, index_cache, True, ready, building, queue))
    a.start()
    assert ready.wait(300), "job A never reached its shuffle index"
    b = ctx.Process(target=_job, args=(cache_dir, index_cache, False, ready, building, queue))
    b.start()
    got = dict(queue.get(timeout=300) for _ in range(2))
    for p in (a, b):
        p.join(timeout=60)
    assert isinstance(got[True], list) and got[False] == got[True], got
