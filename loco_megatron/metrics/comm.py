"""Per-step accounting of data-parallel gradient communication.

One :class:`CommStats` per run is passed to the gradient-sync hook (which adds to it
as buckets complete) and read by the trainer once per step. Times are wall-clock on
CPU (launch to completion of the work handle); exposed time is how long the training
step blocked in ``wait()``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CommStats:
    grad_sync_total_s: float = 0.0
    """Launch-to-completion time of every gradient collective, summed over buckets."""
    grad_sync_exposed_s: float = 0.0
    """Time the step blocked waiting for gradient sync."""
    compress_s: float = 0.0
    """LoCo compensate + quantise + pack time."""
    decompress_s: float = 0.0
    """LoCo dequantise + sum time."""
    grad_bytes_sent: int = 0
    """Payload bytes handed to gradient collectives (codes + scales)."""
    grad_bytes_uncompressed: int = 0
    """What the same syncs cost at the gradient buffer's dtype."""
    grad_bytes_compressed_part: int = 0
    """Of grad_bytes_uncompressed, the part that was sent compressed."""

    def add_sync(self, total_s: float, exposed_s: float, decompress_s: float, bytes_sent: int,
                 bytes_uncompressed: int, compressed: bool) -> None:
        self.grad_sync_total_s += total_s
        self.grad_sync_exposed_s += exposed_s
        self.decompress_s += decompress_s
        self.grad_bytes_sent += bytes_sent
        self.grad_bytes_uncompressed += bytes_uncompressed
        if compressed:
            self.grad_bytes_compressed_part += bytes_uncompressed

    def add_compress(self, seconds: float) -> None:
        self.compress_s += seconds

    def take(self) -> dict[str, float]:
        """This step's figures as ``comm/...`` metrics, then zero the counters."""
        raw = self.grad_bytes_uncompressed
        out = {
            "comm/grad_sync_total_s": self.grad_sync_total_s,
            "comm/grad_sync_exposed_s": self.grad_sync_exposed_s,
            "comm/compress_s": self.compress_s,
            "comm/decompress_s": self.decompress_s,
            "comm/grad_bytes_sent": float(self.grad_bytes_sent),
            "comm/grad_bytes_uncompressed": float(raw),
            "comm/compression_ratio": self.grad_bytes_sent / raw if raw else 1.0,
            "comm/compressed_fraction": self.grad_bytes_compressed_part / raw if raw else 0.0,
        }
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)
        return out
