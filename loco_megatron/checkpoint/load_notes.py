"""What the ranks' objects reset or took over while a checkpoint loaded, said once.

A hook decides on its own rank whether its part of the loaded state fits (its buckets, the
shapes of its error buffers or agreed shards), so one rank can reset while the others
restore. A hook records such a decision as a line in its ``load_notes`` list instead of
printing it; once every object is loaded, :func:`announce` gathers every rank's lines (one
collective, issued by every rank at the same point of the load) and rank 0 prints each
distinct line once, naming the ranks it happened on. A reset on rank 5 alone is never
silent, and a reset on all 64 ranks is one line, not 64.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch.distributed as dist

__all__ = ["announce", "describe_ranks"]


def describe_ranks(ranks: list[int], world: int) -> str:
    """``every rank``, ``rank 3`` or ``ranks 0-2, 5`` (runs of consecutive ranks joined)."""
    if len(ranks) == world:
        return "every rank"
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def announce(objects: Iterable, log: Callable[[str], None], group=None) -> list[str]:
    """Collective over ``group`` (default: the world): gather and clear the ``load_notes``
    of ``objects`` (those without the attribute have none) and ``log`` each distinct line
    on rank 0 with the ranks it came from. Returns the lines rank 0 logged ([] elsewhere).
    An all_gather_object: the load path only, never a training step."""
    mine: list[str] = []
    for obj in objects:
        notes = getattr(obj, "load_notes", None)
        if notes:
            mine.extend(dict.fromkeys(notes))
            notes.clear()
    world = dist.get_world_size(group)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if dist.get_rank(group) != 0:
        return []
    where: dict[str, list[int]] = {}
    for r, lines in enumerate(everyone):
        for line in lines:
            where.setdefault(line, []).append(r)
    out = [f"{line} ({describe_ranks(ranks, world)})" for line, ranks in where.items()]
    for line in out:
        log(line)
    return out
