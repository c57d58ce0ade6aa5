"""LoCo's error state: the error ``e`` a compressor holds across optimizer steps (paper
Alg. 1's error buffer; :class:`ErrorBuffer`), and restoring a hook's compressors from a
checkpoint (:func:`load_compressor_states`). In the data flow (CLI > config > set-up >
train step > gradient/parameter sync > checkpoint and metrics) it is what the gradient
sync carries from one step to the next and what the checkpoint saves of LoCo; the
algorithm that reads and updates it is :mod:`loco_megatron.loco.compressor`."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from loco_megatron.loco import quantize as qz


class LoCoStateMismatch(ValueError):
    """A checkpointed LoCo state that does not fit this compressor (the message says why)."""


class ErrorBuffer:
    """The error ``e`` of one compressor's ``num_blocks`` blocks of ``block_size``, row-major.

    ``error_bits`` 8: :attr:`values` int8 ``[num_blocks, block_size]`` with one fp32 scale
    per block in :attr:`scales` ``[num_blocks]`` (about 1.016 bytes per element at block
    256; the block's ``max|e| / 127``, rounded half to even as the quantiser rounds);
    16/32: :attr:`values` bf16/fp32 ``[num_blocks, block_size]``, :attr:`scales` None.
    A new error is written only where the step is finite: the verdict is a 0-d bool
    device tensor and the choice a ``torch.where`` (no host sync), so a NaN/Inf can never
    enter the buffer. Every update is in place: the fused kernels are handed the tensors."""

    def __init__(self, num_blocks: int, block_size: int, error_bits: int, device: torch.device):
        self.error_bits, self.block_size = error_bits, block_size
        if error_bits == 8:
            self.values = torch.zeros(num_blocks, block_size, dtype=torch.int8, device=device)
            self.scales: Optional[torch.Tensor] = torch.zeros(num_blocks, dtype=torch.float32, device=device)
        else:
            dtype = torch.bfloat16 if error_bits == 16 else torch.float32
            self.values = torch.zeros(num_blocks, block_size, dtype=dtype, device=device)
            self.scales = None

    def blocks(self, b0: int = 0, b1: Optional[int] = None) -> torch.Tensor:
        """fp32 ``[b1 - b0, block_size]`` copy of the stored error of blocks ``[b0, b1)``."""
        b1 = self.values.shape[0] if b1 is None else b1
        if self.error_bits == 8:
            return self.values[b0:b1].float() * self.scales[b0:b1].unsqueeze(1)
        return self.values[b0:b1].float()

    def add_to_(self, h: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
        """``h += e`` for blocks ``[b0, b1)`` (fp32 ``h`` of their shape, in place; returns ``h``)."""
        if self.error_bits == 8:
            # h = e + g with e = int8 * scale: the same product and sum, in the same order,
            # as the unchunked spec (mul then add), so results do not depend on chunking.
            e = torch.mul(self.values[b0:b1], self.scales[b0:b1].unsqueeze(1))
        else:
            e = self.values[b0:b1].float()
        return torch.add(e, h, out=h)

    def store_(self, e: torch.Tensor, finite: torch.Tensor, scratch: torch.Tensor, b0: int, b1: int) -> None:
        """Store fp32 ``e`` (``[b1 - b0, block_size]``) as the error of blocks ``[b0, b1)``
        unless ``finite`` (0-d bool tensor) is False; ``scratch``: fp32 of ``e``'s shape."""
        err = self.values[b0:b1]
        if self.error_bits == 8:
            scales = qz.block_scales(e, 8, scratch=scratch)
            codes = qz.round_codes_(e, scales, 8, out=scratch).to(torch.int8)
            torch.where(finite, codes, err, out=err)
            err_s = self.scales[b0:b1]
            torch.where(finite, scales, err_s, out=err_s)
        else:
            torch.where(finite, e.to(err.dtype), err, out=err)

    def keep_if_finite_(self, finite: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
        """Take a fused kernel's whole new error (int8 ``values`` and fp32 ``scales``, of this
        buffer's shapes) unless ``finite`` (0-d bool tensor) is False."""
        torch.where(finite, values, self.values, out=self.values)
        torch.where(finite, scales, self.scales, out=self.scales)

    def zero_(self) -> None:
        """``e = 0``."""
        self.values.zero_()
        if self.scales is not None:
            self.scales.zero_()

    def nbytes(self) -> int:
        """Bytes held across steps (codes + scales)."""
        n = self.values.numel() * self.values.element_size()
        return n + (self.scales.numel() * 4 if self.scales is not None else 0)

    def state_dict(self) -> dict:
        """``error`` (and ``error_scales`` with int8 storage): copies of the stored tensors."""
        sd = {"error": self.values.clone()}
        if self.scales is not None:
            sd["error_scales"] = self.scales.clone()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Copy :meth:`state_dict`'s tensors back in place (the shapes were checked by the caller)."""
        self.values.copy_(sd["error"])
        if self.scales is not None:
            self.scales.copy_(sd["error_scales"])


def load_compressor_states(compressors: dict, sd: Optional[dict], log: Callable[[str], None]) -> None:
    """A hook's ``load_state_dict``: restore every compressor of ``compressors`` (key ->
    :class:`~loco_megatron.loco.compressor.LoCoCompressor`) from the checkpointed ``sd``
    (key -> its ``state_dict()``). When ``sd`` does not fit (other buckets, or any
    compressor's :class:`LoCoStateMismatch`), every compressor is reset to zero error and
    ``log`` gets one line saying why; a LoCo state this run has no compressors for is
    ignored with one line. ``sd`` None: the checkpoint was written under another layout
    (the loader said so): nothing to do."""
    if sd is None:
        return
    if sd and not compressors:
        log("LoCo: off (or nothing to compress) in this run: the checkpoint's error state is not used")
        return
    why = None
    if set(sd) != set(compressors):
        only_saved = sorted(set(sd) - set(compressors))[:1]
        only_here = sorted(set(compressors) - set(sd))[:1]
        why = f"its buckets differ (saved only: {only_saved or '-'}, here only: {only_here or '-'})"
    else:
        for key, c in compressors.items():
            try:
                c.load_state_dict(sd[key])
            except LoCoStateMismatch as e:
                why = f"{key}: {e}"
                break
    if why is not None:
        for c in compressors.values():
            c.reset()
        log(f"LoCo: the checkpoint's error state does not fit this run ({why}); starting the error buffers at zero")
