"""LoCo's per-buffer state machine (paper Alg. 1, steps compensate/quantise/update).

For one flat gradient buffer ``g`` (N elements) at optimizer step t:

1. compensate   ``h = g + e``                      (``e = 0`` without error feedback)
2. quantise     ``q, s = Q_b(h)``                  (:mod:`loco_megatron.loco.quantize`)
3. update error ``e <- beta*e + (1-beta)*(h - D(q, s))``
4. reset        ``e = 0`` at every ``reset_interval``-th step (before compensating)

The error is stored block-wise in int8 with an fp32 scale per block (about 1.016
bytes per element at block 256) unless ``error_bits`` asks for bf16/fp32. If ``h`` has
a NaN/Inf the stored error is left exactly as it was (selected with ``torch.where``,
no host sync), so a non-finite value can never enter the error buffer; the codes and
scales still carry the overflow to the receiver.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Optional

import torch

from loco_megatron.loco import quantize as qz


def resolve_kernels(choice: str, device_type: str, interpret: bool, bits: int, block_size: int,
                    error_bits: int, error_feedback: bool, cpu_builder: Optional[Callable] = None) -> str:
    """``"torch"``, ``"triton"`` or ``"cpu"`` for ``--loco-kernels choice``; ValueError (one
    line, naming the reason) when ``triton``/``cpu`` is asked for and cannot run this shape.

    ``auto``: triton on CUDA, cpu on a CPU device when the C++ extension builds, else torch.
    ``cpu`` whose extension cannot be built (no compiler) falls back to torch, with one
    line printed once (:func:`.cpu_kernels.extension`; ``cpu_builder`` replaces the build).
    """
    if choice == "torch":
        return "torch"
    if choice == "cpu" or (choice == "auto" and device_type == "cpu"):
        from loco_megatron.loco import cpu_kernels

        why = cpu_kernels.unsupported(bits, block_size, error_bits, error_feedback)
        if device_type != "cpu":
            why = f"needs a CPU device, got {device_type}"
        if why is not None:
            if choice == "auto":
                return "torch"
            raise ValueError(f"--loco-kernels cpu {why}")
        built = cpu_kernels.extension(*([cpu_builder] if cpu_builder else []))
        return "cpu" if built is not None else "torch"
    why = None
    if importlib.util.find_spec("triton") is None:
        why = "triton is not installed (pip install -r requirements-triton.txt)"
    elif device_type != "cuda" and not interpret:
        why = "needs a CUDA device (or TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
    elif block_size & (block_size - 1) or block_size < 8 * (8 // bits):
        why = f"needs a power-of-two --loco-block-size, got {block_size}"
    elif error_feedback and error_bits != 8:
        why = f"supports the int8 error buffer only (--loco-error-bits 8), got {error_bits}"
    if choice == "auto":
        return "triton" if why is None and device_type == "cuda" else "torch"
    if why is not None:
        raise ValueError(f"--loco-kernels triton {why}")
    return "triton"


class Workspace:
    """Scratch buffers reused across calls and buckets, grown to the largest request.

    Compression of one bucket finishes before the next starts (same stream), so one
    workspace serves every bucket of a run: the transient memory is two fp32 copies of
    the largest bucket, never of the whole model.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple, device, dtype=torch.float32) -> torch.Tensor:
        n = shape[0] * shape[1]
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.device != torch.device(device) or buf.dtype != dtype:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:n].view(shape)


class LoCoCompressor:
    """LoCo compressor for one flat buffer of ``numel`` elements (padded to whole blocks)."""

    def __init__(self, numel: int, bits: int = 4, beta: float = 0.8, block_size: int = 256,
                 error_bits: int = 8, reset_interval: int = 1024, error_feedback: bool = True,
                 device: Optional[torch.device] = None, kernels: str = "torch"):
        if bits not in qz.SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {qz.SUPPORTED_BITS}, got {bits}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if error_bits not in (8, 16, 32):
            raise ValueError(f"error_bits must be 8, 16 or 32, got {error_bits}")
        if block_size <= 0 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
        if kernels not in ("torch", "triton", "cpu"):
            raise ValueError(f"kernels must be 'torch', 'triton' or 'cpu', got {kernels!r}")
        if kernels != "torch" and error_feedback and error_bits != 8:
            raise ValueError(f"the {kernels} kernels store the error in int8 only (error_bits=8)")
        if kernels == "cpu":
            from loco_megatron.loco import cpu_kernels

            if cpu_kernels.extension() is None:
                raise ValueError("the C++ CPU kernels are unavailable here (see the line above); use kernels='torch'")
        self.kernels = kernels
        self.numel, self.bits, self.beta = numel, bits, beta
        self.block_size, self.error_bits = block_size, error_bits
        self.reset_interval, self.error_feedback = reset_interval, error_feedback
        self.num_blocks = qz.num_blocks(numel, block_size)
        self.padded_numel = self.num_blocks * block_size
        self.last_stats: Optional[torch.Tensor] = None
        """fp32 ``[4]`` sums from the last :meth:`compress` (see there)."""
        self.step = 0
        """Number of compress() calls so far (one per optimizer step); drives the reset."""
        dev = device or torch.device("cpu")
        if not error_feedback:
            self._err = self._err_scales = None
        elif error_bits == 8:
            self._err = torch.zeros(self.num_blocks, block_size, dtype=torch.int8, device=dev)
            self._err_scales = torch.zeros(self.num_blocks, dtype=torch.float32, device=dev)
        else:
            dtype = torch.bfloat16 if error_bits == 16 else torch.float32
            self._err = torch.zeros(self.num_blocks, block_size, dtype=dtype, device=dev)
            self._err_scales = None

    # -- error storage ---------------------------------------------------------------
    def _error_blocks(self) -> torch.Tensor:
        """fp32 ``[num_blocks, block_size]`` view of the stored error."""
        if self._err is None:
            return torch.zeros(self.num_blocks, self.block_size, device=torch.device("cpu"))
        if self.error_bits == 8:
            return self._err.float() * self._err_scales.unsqueeze(1)
        return self._err.float()

    def _store_error(self, e: torch.Tensor, finite: torch.Tensor, scratch: torch.Tensor) -> None:
        """Store ``e`` unless ``finite`` (0-d bool tensor) is False; selected on the device
        with ``torch.where`` so that there is no host sync."""
        if self.error_bits == 8:
            scales = qz.block_scales(e, 8, scratch=scratch)
            codes = qz.round_codes_(e, scales, 8, out=scratch).to(torch.int8)
            torch.where(finite, codes, self._err, out=self._err)
            torch.where(finite, scales, self._err_scales, out=self._err_scales)
        else:
            torch.where(finite, e.to(self._err.dtype), self._err, out=self._err)

    def error(self) -> torch.Tensor:
        """The current error ``e`` as fp32, ``numel`` elements."""
        return self._error_blocks().reshape(-1)[: self.numel].clone()

    def error_nbytes(self) -> int:
        """Bytes held across steps for the error (codes + scales)."""
        if self._err is None:
            return 0
        n = self._err.numel() * self._err.element_size()
        return n + (self._err_scales.numel() * 4 if self._err_scales is not None else 0)

    # -- the algorithm ---------------------------------------------------------------
    def compress(self, grad: torch.Tensor, workspace: Optional["Workspace"] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-4 for one gradient ``grad`` (``numel`` elements, any float dtype).

        Returns ``(codes, scales)`` exactly as :func:`quantize_blockwise` of ``h = g + e``
        would and advances the error state and the step counter. ``workspace`` lends
        two fp32 ``[num_blocks, block_size]`` scratch buffers (shared by all buckets of
        a run, so no full-size copy is allocated per call). Afterwards
        :attr:`last_stats` holds fp32 ``[4]`` device sums for the metrics:
        ``(sum e_new^2, sum (h - D(q))^2, sum h^2, numel)``, all zero when ``h`` is not
        finite. No host synchronisation happens here.
        """
        if grad.numel() != self.numel:
            raise ValueError(f"expected {self.numel} elements, got {grad.numel()}")
        if self.reset_interval and self.step and self.step % self.reset_interval == 0:
            self.reset()
        ws = workspace or Workspace()
        if self.kernels == "triton":
            return self._compress_triton(grad, ws)
        if self.kernels == "cpu":
            return self._compress_cpu(grad, ws)
        shape = (self.num_blocks, self.block_size)
        g = qz._blocks(grad, self.block_size)
        h = ws.get("h", shape, g.device)
        work = ws.get("work", shape, g.device)
        # 1. h = g + e (int8 error * per-block scale is one fused widening multiply).
        if self._err is None:
            h.copy_(g)
        elif self.error_bits == 8:
            torch.mul(self._err, self._err_scales.unsqueeze(1), out=h).add_(g)
        else:
            torch.add(g, self._err, out=h)
        # 2. quantise; a non-finite block has a non-finite scale (amax propagates NaN).
        scales = qz.block_scales(h, self.bits, scratch=work)
        finite = torch.isfinite(scales).all()
        q = qz.round_codes_(h, scales, self.bits, out=work)
        codes = qz.pack_codes(q.to(torch.int8), self.bits)
        # 3. residual h - D(q), in place: work becomes the residual.
        resid = torch.addcmul(h, q, scales.unsqueeze(1), value=-1.0, out=work)
        stats = [torch.linalg.vector_norm(resid).square(), torch.linalg.vector_norm(h).square()]
        if self._err is not None:
            # e_new = beta*e + (1-beta)*(h - D) with e = h - g, computed in place in h.
            new_e = h.sub_(g).mul_(self.beta).add_(resid, alpha=1.0 - self.beta)
            stats.insert(0, torch.linalg.vector_norm(new_e).square())
            self._store_error(new_e, finite, work)
        else:
            stats.insert(0, torch.zeros((), device=g.device))
        stats.append(torch.tensor(float(self.numel), device=g.device))
        # Keep the NaN of a bad step out of the metrics as well as out of the error.
        self.last_stats = torch.where(finite, torch.stack(stats), torch.zeros(4, device=g.device))
        self.step += 1
        return codes, scales

    def _compress_triton(self, grad: torch.Tensor, ws: "Workspace") -> tuple[torch.Tensor, torch.Tensor]:
        """The same step as :meth:`compress` in one fused kernel (see :mod:`.triton_kernels`)."""
        from loco_megatron.loco import triton_kernels

        shape, dev = (self.num_blocks, self.block_size), grad.device
        ef = self._err is not None
        new_err = ws.get("new_err", shape, dev, torch.int8) if ef else None
        new_scales = ws.get("new_err_scales", (self.num_blocks, 1), dev).view(-1) if ef else None
        stats = ws.get("stats", (self.num_blocks, 3), dev)
        codes, scales = triton_kernels.compress(grad.reshape(-1), self._err, self._err_scales, self.beta,
                                                self.bits, self.block_size, new_err, new_scales, stats)
        finite = torch.isfinite(scales).all()
        if ef:  # the NaN/Inf rule needs the whole buffer's verdict: select on the device
            torch.where(finite, new_err, self._err, out=self._err)
            torch.where(finite, new_scales, self._err_scales, out=self._err_scales)
        sums = torch.cat([stats.sum(dim=0), torch.tensor([float(self.numel)], device=dev)])
        self.last_stats = torch.where(finite, sums, torch.zeros(4, device=dev))
        self.step += 1
        return codes, scales

    def _compress_cpu(self, grad: torch.Tensor, ws: "Workspace") -> tuple[torch.Tensor, torch.Tensor]:
        """The same step as :meth:`compress` in the fused C++ kernel (see :mod:`.cpu_kernels`).

        ``grad`` may be ``[rows, S]`` (each row padded to whole blocks inside the kernel)
        or flat. One pass over ``grad``, the new error going to an int8 scratch from the
        workspace (1 byte per element of the largest bucket, shared by all buckets) that
        is copied over the error when every scale is finite: measured faster than the
        scratch-free two-pass scheme (README, "Fused kernels").
        """
        from loco_megatron.loco import cpu_kernels

        g = grad if grad.dim() == 2 else grad.reshape(-1)
        if g.dtype not in (torch.float32, torch.bfloat16):
            g = g.float()
        scratch = (None, None)
        if self._err is not None:
            shape = (self.num_blocks, self.block_size)
            scratch = (ws.get("new_err", shape, g.device, torch.int8),
                       ws.get("new_err_scales", (self.num_blocks, 1), g.device).view(-1))
        codes, scales, self.last_stats = cpu_kernels.compress(
            g, self._err, self._err_scales, self.beta, self.bits, self.block_size, self.numel, *scratch)
        self.step += 1
        return codes, scales

    def reset(self) -> None:
        """``e = 0``."""
        if self._err is not None:
            self._err.zero_()
        if self._err_scales is not None:
            self._err_scales.zero_()

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = {"step": self.step, "numel": self.numel, "bits": self.bits,
              "block_size": self.block_size, "error_bits": self.error_bits}
        if self._err is not None:
            sd["error"] = self._err.clone()
        if self._err_scales is not None:
            sd["error_scales"] = self._err_scales.clone()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for key in ("numel", "block_size", "error_bits"):
            if sd.get(key) != getattr(self, key):
                raise ValueError(f"LoCo state has {key}={sd.get(key)}, this run has {getattr(self, key)}")
        self.step = int(sd["step"])
        if self._err is not None:
            self._err.copy_(sd["error"])
        if self._err_scales is not None:
            self._err_scales.copy_(sd["error_scales"])
