"""Weight-difference quantisation for the parameter all-gather: pure tensor functions.

No torch.distributed and no megatron here. A bucket's flat parameter buffer of
``N = W * S`` elements is split into ``W`` shards of ``S`` elements; rank ``j`` owns
shard ``j`` (the distributed optimizer updates it). Every rank holds the *agreed*
parameters ``A`` (``[W, S]``, the parameter dtype), bit-identical on all ranks.

One gather, for the owner of shard ``j`` with updated values ``P_j``:

* ``d_j = P_j - A_j`` in fp32, zero-padded to whole blocks of ``B`` elements;
* ``(codes_j, scales_j) = quantize_blockwise(d_j)`` (LoCo's quantiser: symmetric,
  one fp32 scale per block, round half to even);
* every rank, the owner included, sets ``A_j <- cast(float(A_j) + D(Q(d_j)))``.

Invariant: every input of that update (``A_j``, codes, scales) is bit-identical on
all ranks and the arithmetic is elementwise and deterministic, so ``A`` stays
bit-identical on every rank. Because ``d`` is always taken against ``A``, rounding
does not accumulate: after a gather ``P_j - A_j`` is one quantisation of one
difference (plus the cast to the parameter dtype).

Non-finite differences: a shard whose scales are not all finite is *not* applied
(``A_j`` unchanged on every rank - the decision depends only on the gathered scales,
so it is identical everywhere) and is counted, so the caller can fail loudly.

Wire row of one shard: ``uint8 [code_bytes + 4 * blocks]`` = packed codes followed by
the fp32 scales' bytes.
"""

from __future__ import annotations

import torch

from loco_megatron.loco import quantize as qz

PARAM_GATHER_BITS = (4, 8)


class DeltaLayout:
    """Sizes of one bucket's compressed parameter all-gather."""

    def __init__(self, numel: int, world: int, bits: int, block_size: int, kernels: str = "torch"):
        """``kernels``: ``"torch"`` (the reference) or ``"cpu"`` (the fused C++ quantise and
        dequantise of :mod:`.cpu_kernels`: the same codes, scales and deltas, bit for bit)."""
        if bits not in PARAM_GATHER_BITS:
            raise ValueError(f"param-gather bits must be one of {PARAM_GATHER_BITS}, got {bits}")
        if numel % world:
            raise ValueError(f"buffer of {numel} elements does not split over {world} ranks")
        self.numel, self.world, self.bits, self.block_size = numel, world, bits, block_size
        self.kernels = kernels
        self.shard = numel // world
        self.blocks = qz.num_blocks(self.shard, block_size)
        self.code_bytes = qz.packed_nbytes(self.shard, bits, block_size)
        self.row_bytes = self.code_bytes + 4 * self.blocks

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the gathered ``[W, row_bytes]`` buffer (the all-gather's output)."""
        return self.world * self.row_bytes


def encode_delta(new: torch.Tensor, agreed: torch.Tensor, layout: DeltaLayout) -> torch.Tensor:
    """One shard's wire row (uint8 ``[row_bytes]``) for ``d = new - agreed``.

    ``new``, ``agreed``: ``[S]`` of any float dtype (compared in fp32).
    """
    d = new.float() - agreed.float()
    if layout.kernels == "cpu":  # the LoCo compress kernel without error feedback quantises d
        from loco_megatron.loco import cpu_kernels

        codes, scales, _ = cpu_kernels.compress(d, None, None, 0.0, layout.bits, layout.block_size, d.numel())
    else:
        codes, scales = qz.quantize_blockwise(d, layout.bits, layout.block_size)
    return torch.cat([codes, scales.view(torch.uint8)])


def decode_rows(rows: torch.Tensor, layout: DeltaLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered rows (uint8 ``[W, row_bytes]``) -> fp32 deltas ``[W, S]`` and a bool
    ``[W]`` mask of shards whose scales are all finite (non-finite shards' deltas are
    zeroed, so adding them is a no-op)."""
    scales = rows[:, layout.code_bytes:].contiguous().view(torch.float32)  # [W, blocks]
    finite = torch.isfinite(scales).all(dim=1)
    safe = torch.where(finite.unsqueeze(1), scales, torch.zeros_like(scales))
    if layout.kernels == "cpu":  # one fused dequantise per row (zeroed scales: a zero delta)
        from loco_megatron.loco import cpu_kernels

        safe_rows = torch.cat([rows[:, :layout.code_bytes], safe.view(torch.uint8)], dim=1)
        deltas = torch.empty(layout.world, layout.shard, dtype=torch.float32, device=rows.device)
        for j in range(layout.world):
            cpu_kernels.decompress_sum(safe_rows[j:j + 1], layout, deltas[j])
        return deltas, finite
    codes = rows[:, :layout.code_bytes].reshape(-1)
    q = qz.unpack_codes(codes, layout.bits, layout.block_size).view(layout.world, layout.blocks, layout.block_size)
    deltas = torch.mul(q, safe.unsqueeze(2)).view(layout.world, -1)[:, :layout.shard]
    return deltas, finite


def add_delta(agreed: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``cast(float(agreed) + delta)`` at ``agreed``'s dtype: the one formula every rank uses."""
    return (agreed.float() + delta).to(agreed.dtype)


class AgreedShard:
    """The one extra shard per bucket the owner keeps between gathers.

    ``buffer`` is the bucket's flat parameter buffer; ``own`` its rank's ``[S]`` view.
    Two modes, depending on whether the optimizer's fp32 main parameters *are* that
    view (fp32 models: megatron's distributed optimizer steps the model buffer itself):

    * ``main_aliased=False`` (bf16/fp16 params, separate fp32 main params): ``spare``
      holds the agreed own shard; the optimizer's copy-back overwrites ``own`` with the
      new values before the gather;
    * ``main_aliased=True`` (fp32 params): between gathers ``own`` holds the agreed
      shard (what the model computes with) and ``spare`` the exact main shard;
      :meth:`begin_step` before the optimizer step exchanges them, so the optimizer updates
      the exact values and ``spare`` holds the agreed shard during the gather.

    Extra memory: ``S`` elements of the parameter dtype per bucket, i.e. ``element_size
    / W`` bytes per parameter.
    """

    def __init__(self, own: torch.Tensor, main_aliased: bool):
        self.own, self.main_aliased = own, main_aliased
        self.spare = own.detach().clone()
        self.pending = False
        """True between :meth:`begin_step` and the gather (or :meth:`cancel_step`)."""

    def _exchange(self) -> None:
        if self.main_aliased:
            tmp = self.own.clone()
            self.own.copy_(self.spare)
            self.spare.copy_(tmp)

    def begin_step(self) -> None:
        """Before the optimizer step: an update of ``own`` is coming (aliased: put the
        exact main shard where the optimizer reads it)."""
        if not self.pending:
            self._exchange()
            self.pending = True

    def cancel_step(self) -> None:
        """The step was skipped: no update to gather (aliased: agreed shard back in place)."""
        if self.pending:
            self._exchange()
            self.pending = False

    def agreed(self) -> torch.Tensor:
        """The agreed own shard (from before the step) while an update is pending."""
        return self.spare

    def finish(self, new_agreed: torch.Tensor) -> None:
        """After the gather: ``own`` <- the new agreed shard; ``spare`` <- exact main
        (aliased) or the agreed shard (not aliased)."""
        if self.main_aliased:
            self.spare.copy_(self.own)
        else:
            self.spare.copy_(new_agreed)
        self.own.copy_(new_agreed)
        self.pending = False

    def state_dict(self) -> dict:
        """Aliased: the exact main shard; else the agreed own shard (clones)."""
        assert not self.pending, "checkpoint taken with a parameter update pending"
        return {"spare": self.spare.clone(), "main_aliased": self.main_aliased}

    def load_state_dict(self, sd: dict | None) -> None:
        """``sd=None`` (a checkpoint written without compressed gathers): the loaded model
        shard is both agreed and main."""
        self.pending = False
        if sd is None or sd["main_aliased"] != self.main_aliased:
            self.spare.copy_(self.own)
            return
        if sd["spare"].shape != self.spare.shape:
            raise ValueError(f"param-gather shard of {tuple(sd['spare'].shape)} elements in the checkpoint, "
                             f"{tuple(self.spare.shape)} here")
        self.spare.copy_(sd["spare"])
        if not self.main_aliased:
            self.own.copy_(self.spare)  # the model shard is the agreed one
