"""How replicas find out that their models differ, and take one of them.

Every cycle each lane host puts :func:`state_hash` of its lane's outer state (agreed
parameters, momentum, outer steps) in its fingerprint. Replicas at equal progress hold the
same state by construction, except where nothing made them agree yet: the start of a run
(replicas of other layouts initialise their weights differently: megatron seeds each TP
slice apart), a whole-run restart from checkpoints written at different moments, a first
agreement that failed. Then the cycle *agrees* (:func:`adopt`): every participant takes
one participant's state, bit for bit, and trains on from it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from loco_megatron.diloco.elastic.cycle import config_hash

_CHUNK = 1 << 24
"""Elements hashed at a time (bounded scratch: two int64 copies of a chunk)."""


def tensor_sums(t: torch.Tensor) -> tuple[int, int, int]:
    """``(numel, sum, sum of squares)`` of ``t``'s fp32 bit patterns as integers, modulo
    2^64: integer sums wrap around the same whatever the order they are added in, so the
    result does not depend on the device or the reduction order (a float sum would)."""
    x = t.detach().reshape(-1).view(torch.int32)
    s1 = torch.zeros((), dtype=torch.int64, device=t.device)
    s2 = torch.zeros((), dtype=torch.int64, device=t.device)
    for chunk in x.split(_CHUNK):
        c = chunk.to(torch.int64)
        s1 += c.sum()
        s2 += (c * c).sum()
    mask = (1 << 64) - 1
    return t.numel(), int(s1.item()) & mask, int(s2.item()) & mask  # (host syncs: outer steps only)


def state_hash(agreed: dict[str, torch.Tensor], momentum: dict[str, Optional[torch.Tensor]],
               outer_steps: int) -> int:
    """A positive 63-bit hash of a lane's outer state (per channel its agreed parameters and
    momentum, fp32 ``[N]``; the outer step count)."""
    parts: list = [outer_steps]
    for key in sorted(agreed):
        m = (momentum or {}).get(key)
        parts.append((key, tensor_sums(agreed[key]), None if m is None else tensor_sums(m)))
    return config_hash(parts) or 1


def adopt(agreed: dict[str, torch.Tensor], momentum: dict[str, Optional[torch.Tensor]], mine: bool,
          all_reduce: Callable[[torch.Tensor], None]) -> tuple[dict, dict]:
    """The source's agreed parameters and momentum on every participant (collective over
    the cycle's participants, one sum per tensor in channel order): the source puts its
    own, the others zeros, so the sum is the source's bit for bit (``x + 0 = x``; the
    source takes the sum too, so even a ``-0.0`` reads alike everywhere). ``mine``: this
    replica is the source. Returns new tensors (applied when the cycle commits)."""
    out_a, out_m = {}, {}
    for key in sorted(agreed):
        a = agreed[key].clone() if mine else torch.zeros_like(agreed[key])
        m = momentum.get(key)
        m = None if m is None else (m.clone() if mine else torch.zeros_like(m))
        for t in (a, m):
            if t is not None and t.numel():
                all_reduce(t)
        out_a[key], out_m[key] = a, m
    return out_a, out_m
