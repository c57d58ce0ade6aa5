"""Per-step accounting of data-parallel gradient communication.

One :class:`CommStats` per run is passed to the gradient-sync hook, which records
*intervals* (pairs of clock marks) and byte counts as buckets launch and complete;
the trainer calls :meth:`CommStats.take` once per step.

Clocks: on CPU a mark is ``time.perf_counter()`` (wall-clock at launch and at
completion of the work handle). On CUDA a mark is an event recorded on the current
stream, so an interval is what that stream saw: for ``exposed`` (marks around
``wait()``) exactly the stall of the compute stream; for ``total`` (launch to the
mark after ``wait()``) an upper bound of the collective's duration. Intervals are kept
until :meth:`take_seconds`, which the trainer calls once per log interval: resolving an
event waits for the device to reach it, so that wait happens there and never every step.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

KINDS = ("grad_sync_total", "grad_sync_exposed", "compress", "decompress", "param_gather", "param_compress",
         "param_decompress", "outer_time", "outer_exposed")
"""Interval kinds: ``comm/<kind>_s``. ``outer_time`` / ``outer_exposed``: DiLoCo's outer
exchanges, end to end (counted at the step that completes them) and the part the training
loop waited for or spent compressing."""


class WallClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def clock_for(device: torch.device):
    """CUDA events on a GPU, wall-clock otherwise."""
    return CudaEventClock() if torch.device(device).type == "cuda" else WallClock()


class CommStats:
    """Intervals, bytes and LoCo error sums of the current step."""

    def __init__(self, clock=None):
        self.clock = clock or WallClock()
        self._param_sums: Optional[torch.Tensor] = None
        self._intervals: list[tuple[str, object, object]] = []
        self._reset()

    def _reset(self) -> None:
        self.grad_bytes_sent = 0
        """Payload bytes handed to gradient collectives (codes + scales)."""
        self.grad_bytes_uncompressed = 0
        """What the same syncs cost at the gradient buffer's dtype."""
        self.grad_bytes_compressed_part = 0
        """Of ``grad_bytes_uncompressed``, the part that was sent compressed."""
        self.grad_bytes_sent_intra = 0
        """Two-hop LoCo: bytes this rank sent to other ranks of its node (hop 1)."""
        self.grad_bytes_sent_inter = 0
        """Two-hop LoCo: bytes this rank sent to ranks on other nodes (hop 2)."""
        self._loco_sums: Optional[torch.Tensor] = None
        self.param_bytes_sent = 0
        """Bytes of the parameter all-gathers' gathered buffers (codes + scales, or params)."""
        self.param_bytes_uncompressed = 0
        """What the same gathers cost at the parameter dtype."""
        self.outer_bytes_sent = 0
        """DiLoCo: bytes this rank sent to the other replicas (outer exchanges started this step)."""
        self.outer_bytes_uncompressed = 0
        """What the same outer exchanges cost as fp32 ring all-reduces."""
        self.outer_bytes_bf16_every_step = 0
        """DiLoCo's reference: what a bf16 ring all-reduce of this rank's shard between the
        replicas would send at this step (every step, without DiLoCo)."""

    def add_interval(self, kind: str, start, end) -> None:
        assert kind in KINDS, kind
        self._intervals.append((kind, start, end))

    def add_bytes(self, sent: int, uncompressed: int, compressed: bool) -> None:
        self.grad_bytes_sent += sent
        self.grad_bytes_uncompressed += uncompressed
        if compressed:
            self.grad_bytes_compressed_part += uncompressed

    def add_hop_bytes(self, intra: int, inter: int) -> None:
        self.grad_bytes_sent_intra += intra
        self.grad_bytes_sent_inter += inter

    def add_param_bytes(self, sent: int, uncompressed: int) -> None:
        self.param_bytes_sent += sent
        self.param_bytes_uncompressed += uncompressed

    def add_outer_bytes(self, sent: int, uncompressed: int) -> None:
        self.outer_bytes_sent += sent
        self.outer_bytes_uncompressed += uncompressed

    def add_outer_reference(self, bf16_bytes: int) -> None:
        self.outer_bytes_bf16_every_step += bf16_bytes

    def add_param_error(self, sums: torch.Tensor) -> None:
        """float64 ``[3]`` device sums ``(||agreed-main||^2, ||main||^2, non-finite shards)``
        of one compressed parameter gather (kept across :meth:`take`; see :meth:`take_param_sums`)."""
        self._param_sums = sums.clone() if self._param_sums is None else self._param_sums + sums

    def take_param_sums(self) -> Optional[torch.Tensor]:
        sums, self._param_sums = self._param_sums, None
        return sums

    def add_loco(self, sums: torch.Tensor) -> None:
        """fp32 ``[4]`` device sums ``(sum e^2, sum (h-D(q))^2, sum h^2, numel)`` of one bucket."""
        self._loco_sums = sums.clone() if self._loco_sums is None else self._loco_sums + sums

    def take_seconds(self) -> dict[str, float]:
        """``comm/<kind>_s`` summed over every interval recorded since the last call (on
        CUDA this waits for the last event: call it once per log interval)."""
        secs = dict.fromkeys(KINDS, 0.0)
        for kind, start, end in self._intervals:
            secs[kind] += self.clock.seconds(start, end)
        self._intervals = []
        return {f"comm/{k}_s": v for k, v in secs.items()}

    def take(self) -> tuple[dict[str, float], Optional[torch.Tensor]]:
        """This step's ``comm/...`` byte figures and LoCo sums (or None), host values the
        hooks counted (no device wait); then start afresh. The seconds: :meth:`take_seconds`."""
        raw = self.grad_bytes_uncompressed
        out = {
            "comm/grad_bytes_sent": float(self.grad_bytes_sent),
            "comm/grad_bytes_uncompressed": float(raw),
            "comm/compression_ratio": self.grad_bytes_sent / raw if raw else 1.0,
            "comm/compressed_fraction": self.grad_bytes_compressed_part / raw if raw else 0.0,
            "comm/grad_bytes_sent_intra": float(self.grad_bytes_sent_intra),
            "comm/grad_bytes_sent_inter": float(self.grad_bytes_sent_inter),
            "comm/param_bytes_sent": float(self.param_bytes_sent),
            "comm/param_bytes_uncompressed": float(self.param_bytes_uncompressed),
            "comm/outer_bytes_sent": float(self.outer_bytes_sent),
            "comm/outer_bytes_uncompressed": float(self.outer_bytes_uncompressed),
            "comm/outer_bytes_bf16_every_step": float(self.outer_bytes_bf16_every_step),
        }
        sums = self._loco_sums
        self._reset()
        return out, sums


def loco_metrics(sums: torch.Tensor) -> dict[str, float]:
    """``loco/error_rms`` and ``loco/quant_rel_error`` from sums added over buckets, steps
    and ranks: RMS of the stored error over all elements, and ``||h - D(q)|| / ||h||``
    (the transmitted gradient's relative error against the compensated one)."""
    err_sq, resid_sq, h_sq, numel = (float(v) for v in sums.tolist())
    return {"loco/error_rms": (err_sq / numel) ** 0.5 if numel else 0.0,
            "loco/quant_rel_error": (resid_sq / h_sq) ** 0.5 if h_sq else 0.0}


def param_metrics(sums: torch.Tensor) -> dict[str, float]:
    """``loco/param_rel_error`` (``||agreed - main|| / ||main||`` over own shards) from
    :meth:`CommStats.add_param_error` sums added over gathers and ranks."""
    err_sq, main_sq, _ = (float(v) for v in sums.tolist())
    return {"loco/param_rel_error": (err_sq / main_sq) ** 0.5 if main_sq else 0.0}
