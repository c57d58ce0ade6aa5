"""The scratch memory LoCo's compressors share within a run."""

from __future__ import annotations

import torch


class Workspace:
    """Scratch buffers reused across calls and buckets, grown to the largest request.

    Compression of one bucket finishes before the next starts (same stream), so one
    workspace serves every bucket of a run. The compressor works through a bucket in
    chunks of at most ``chunk_elements`` elements, so the scratch it asks for is bounded
    by the chunk size, never by the bucket or the model. :attr:`nbytes` is what the
    workspace holds now (the high-water mark: buffers are never shrunk).
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple, device, dtype=torch.float32) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.device != torch.device(device) or buf.dtype != dtype:
            self._buffers.pop(name, None)  # free the old one before allocating the larger one
            buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:n].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
