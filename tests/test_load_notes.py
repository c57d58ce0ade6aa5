"""Load notes: what one rank's hooks reset while a checkpoint loaded is said once, by rank 0,
naming the ranks (3 real gloo ranks)."""

import os

import torch.distributed as dist

from loco_megatron.checkpoint.load_notes import announce, describe_ranks
from test_collectives import _spawn  # tests/ is on the path


class _Hook:
    def __init__(self, notes):
        self.load_notes = list(notes)


def _worker(rank, world, port, queue, collected):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        hooks = [_Hook(["LoCo: reset"] if rank > 0 else []), _Hook(["agreed taken over", "agreed taken over"]),
                 object()]  # an object without notes
        logged: list[str] = []
        returned = announce(hooks, logged.append)
        queue.put((rank, (logged, returned, [h.load_notes for h in hooks[:2]])))
        collected.wait(timeout=120)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_reset_on_some_ranks_is_said_once_naming_them():
    """Guards against resets announced by rank 0 only (a reset on rank 1 alone was silent),
    against one line per rank (64 ranks, 64 lines), and against notes that stay behind and
    are announced again at the next load: rank 0 logs each distinct line once with the
    ranks it happened on, the others log nothing, every hook's notes are cleared."""
    out = _spawn(_worker, 3)
    logged, returned, left = out[0]
    assert logged == returned == ["agreed taken over (every rank)", "LoCo: reset (ranks 1-2)"]
    for rank in (1, 2):
        assert out[rank][0] == [] and out[rank][1] == []
    assert all(notes == [] for r in out for notes in out[r][2])


def test_describe_ranks():
    """Guards against rank lists that misname the ranks (runs joined, singular, all)."""
    assert describe_ranks([3], 8) == "rank 3"
    assert describe_ranks([0, 1, 2, 5, 7], 8) == "ranks 0-2, 5, 7"
    assert describe_ranks(list(range(4)), 4) == "every rank"
