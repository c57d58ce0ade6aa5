"""SparseLoCo's per-replica state: the error-feedback buffer of one channel, and the step
that turns an outer gradient into a payload (pure tensor functions, no collectives).

Per exchange, with ``e`` the buffer (fp32 ``[numel]``, zero at the start)::

    e <- beta * e + delta          (error feedback; without it: e <- delta)
    payload = top-k of |e| per chunk, quantised and packed   (:mod:`.codec`)
    e <- e - decoded(payload)      (error feedback only)

so what is not sent (the other entries, and each sent value's quantisation error) stays in
``e`` for later exchanges. ``e`` is this replica's own: its size and meaning do not depend on
how many replicas exchange, so it is kept when others leave or join.
"""

from __future__ import annotations

from typing import Optional

import torch

from loco_megatron.diloco.sparse.chunks import ChunkPlan
from loco_megatron.diloco.sparse.codec import PayloadLayout, encode


class SparseCompressor:
    """The state and the encoding step of one channel (module docstring). ``plan``: its
    shard's chunks; ``topk``: entries per chunk; ``bits``: 2, 4, 8 or 0 (fp32 values)."""

    def __init__(self, plan: ChunkPlan, topk: int, bits: int, beta: float = 0.95, error_feedback: bool = True,
                 device: Optional[torch.device] = None):
        self.plan, self.topk, self.bits, self.beta = plan, topk, bits, beta
        self.layout = PayloadLayout(plan, topk, bits)
        self.error_feedback = error_feedback
        self.error = torch.zeros(plan.numel, dtype=torch.float32, device=device) if error_feedback else None
        """fp32 ``[numel]``: what was not sent yet (None without error feedback)."""

    def compress(self, delta: torch.Tensor, weight: float = 1.0) -> tuple[torch.Tensor, tuple]:
        """The payload of this exchange (uint8 ``[layout.nbytes]``; ``weight``: the factor
        ``delta`` was scaled by, carried in it: :mod:`.codec`) and what it decodes to
        (:func:`.codec.decode`'s triple); updates the error buffer. A non-finite value of the
        buffer afterwards (an overflowed outer gradient, sent as such so the mean is dropped)
        is reset to 0, so it cannot poison every later exchange."""
        if self.error is None:
            return encode(delta, self.plan, self.layout, weight)
        e = self.error
        e.mul_(self.beta).add_(delta)
        payload, entries = encode(e, self.plan, self.layout, weight)
        pos, values, valid = entries
        if pos.numel():  # (positions of one payload are distinct: an exact subtraction each)
            e.index_put_((pos,), -torch.where(valid, values, torch.zeros((), device=e.device)), accumulate=True)
        torch.nan_to_num_(e, nan=0.0, posinf=0.0, neginf=0.0)
        return payload, entries

    def error_nbytes(self) -> int:
        return self.error.numel() * 4 if self.error is not None else 0

    def state_dict(self) -> dict:
        """A copy (a discarded exchange puts it back)."""
        return {"error": self.error.clone() if self.error is not None else None}

    def load_state_dict(self, sd: dict) -> None:
        if self.error is not None:
            if sd.get("error") is None or sd["error"].numel() != self.error.numel():
                raise ValueError("the SparseLoCo error buffer in the checkpoint does not fit this shard")
            self.error.copy_(sd["error"])

    def reset(self) -> None:
        if self.error is not None:
            self.error.zero_()
