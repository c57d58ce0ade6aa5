"""LoCo's per-buffer state machine (paper Alg. 1, steps compensate/quantise/update).

For one flat gradient buffer ``g`` (N elements) at optimizer step t:

1. compensate   ``h = g + e``                      (``e = 0`` without error feedback)
2. quantise     ``q, s = Q_b(h)``                  (:mod:`loco_megatron.loco.quantize`)
3. update error ``e <- beta*e + (1-beta)*(h - D(q, s))``
4. reset        ``e = 0`` at every ``reset_interval``-th step (before compensating)

The error is stored block-wise in int8 with an fp32 scale per block (about 1.016
bytes per element at block 256) unless ``error_bits`` asks for bf16/fp32
(:class:`~loco_megatron.loco.error_state.ErrorBuffer`). If ``h`` has a NaN/Inf the stored
error is left exactly as it was (selected with ``torch.where``, no host sync), so a
non-finite value can never enter the error buffer; the codes and scales still carry the
overflow to the receiver.

Quantiser options (:class:`~.quantize.QuantOptions`) change step 2 only, except the
Hadamard rotation: then the whole step runs in the rotated domain (``h = R(g) + e``,
the error is stored rotated; ``R`` is linear, so this is the same algorithm on ``R(g)``)
and the receiver unrotates the sum. Stochastic rounding draws its bits from
``(options.seed, stream, step)``: ``stream`` names the buffer and rank, ``step`` is
checkpointed, so a resumed run rounds exactly as an uninterrupted one. The gain
correction (``gain_correction``, torch kernels only; DiLoCo's outer exchange uses it)
refits step 2's scales so that ``<D(q, s), h> = |h|^2`` per block
(:func:`~.quantize.unbiased_scales_`), before step 3 reads them.

In the data flow (CLI > config > set-up > train step > gradient/parameter sync >
checkpoint and metrics) a compressor is built at set-up for each gradient bucket that
leaves its rank and runs inside the gradient sync; the torch reference here, or one fused
kernel (C++ on CPU, Triton on GPU) that gives the same bits.
"""

from __future__ import annotations

from typing import Optional

import torch

from loco_megatron.loco import quantize as qz
from loco_megatron.loco import rotation as rot
from loco_megatron.loco.error_state import ErrorBuffer, LoCoStateMismatch, load_compressor_states
from loco_megatron.loco.workspace import Workspace

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "LoCoCompressor", "LoCoStateMismatch", "load_compressor_states"]


DEFAULT_CHUNK_ELEMENTS = 1 << 22
"""Elements the torch path compensates/quantises at a time: 2 fp32 scratch buffers of
16 MiB each, whatever the bucket size (``--no-overlap-grad-reduce`` makes a whole
pipeline stage one bucket)."""


class LoCoCompressor:
    """LoCo compressor for one flat buffer of ``numel`` elements in ``rows`` rows.

    The buffer is split into ``rows`` consecutive rows of ``S = ceil(numel / rows)``
    elements (the last may be shorter, or even empty), and each row is zero-padded to
    ``P = ceil(S / B) * B`` (whole blocks), so a block never straddles two rows (two
    destinations of a reduce-scatter) and no padded copy of the buffer is ever made.
    Codes, scales and the error cover ``rows * P / B`` blocks, row-major.
    ``rows = 1`` is a plain flat buffer whose last block is zero-padded.
    """

    def __init__(self, numel: int, bits: int = 4, beta: float = 0.8, block_size: int = 256,
                 error_bits: int = 8, reset_interval: int = 1024, error_feedback: bool = True,
                 device: Optional[torch.device] = None, kernels: str = "torch", rows: int = 1,
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, options: Optional[qz.QuantOptions] = None,
                 stream: int = 0, gain_correction: bool = False):
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
        if gain_correction and kernels != "torch":
            raise ValueError(f"gain_correction is implemented by the torch kernels only, not {kernels!r}")
        if kernels != "torch" and error_feedback and error_bits != 8:
            raise ValueError(f"the {kernels} kernels store the error in int8 only (error_bits=8)")
        self.options = options or qz.DEFAULT_OPTIONS
        self._plain = not self.options.non_default()  # today's scheme: the exact fast torch ops
        if self.options.rotation == "hadamard":
            rot.check_block_size(block_size)
        if kernels == "cpu":
            from loco_megatron.loco import cpu_kernels

            if cpu_kernels.extension() is None:
                raise ValueError("the C++ CPU kernels are unavailable here (see the line above); use kernels='torch'")
        if rows < 1 or chunk_elements < block_size:
            raise ValueError(f"rows must be >= 1 and chunk_elements >= block_size, got {rows}, {chunk_elements}")
        self.kernels = kernels
        self.gain_correction = gain_correction
        """Refit each block's scale so the decoded block is not shrunk (:func:`~.quantize.unbiased_scales_`)."""
        self.numel, self.bits, self.beta = numel, bits, beta
        self.block_size, self.error_bits = block_size, error_bits
        self.reset_interval, self.error_feedback = reset_interval, error_feedback
        self.rows = rows
        self.row_numel = -(-numel // rows)
        self.row_blocks = qz.num_blocks(self.row_numel, block_size)
        self.num_blocks = rows * self.row_blocks
        self.padded_numel = self.num_blocks * block_size
        self.chunk_blocks = max(1, chunk_elements // block_size)
        self._chunk_list = self._chunks()  # fixed by the shape: not rebuilt every step
        self._stats_consts: Optional[tuple] = None  # see _stats
        self.last_stats: Optional[torch.Tensor] = None
        """fp32 ``[4]`` sums from the last :meth:`compress` (see there)."""
        self.step = 0
        """Number of compress() calls so far (one per optimizer step); drives the reset."""
        dev = device or torch.device("cpu")
        self.stream = stream
        self._signs = rot.signs(block_size, self.options.seed, dev) if self.options.rotation == "hadamard" else None
        self.error_buffer = ErrorBuffer(self.num_blocks, block_size, error_bits, dev) if error_feedback else None
        """The error ``e`` held across steps (None without error feedback)."""

    # -- the error (stored in :attr:`error_buffer`) -------------------------------------
    def error(self) -> torch.Tensor:
        """The current error ``e`` as fp32, ``numel`` elements (row padding removed;
        unrotated when the error is stored in the rotated domain)."""
        if self.error_buffer is None:
            blocks = torch.zeros(self.num_blocks, self.block_size, device=torch.device("cpu"))
        else:
            blocks = self.error_buffer.blocks()
        if self._signs is not None:
            blocks = rot.unrotate(blocks, self._signs.to(blocks.device))
        blocks = blocks.view(self.rows, -1)[:, : self.row_numel]
        return blocks.reshape(-1)[: self.numel].clone()

    def error_nbytes(self) -> int:
        """Bytes held across steps for the error (codes + scales)."""
        return self.error_buffer.nbytes() if self.error_buffer is not None else 0

    def workspace_nbytes(self) -> int:
        """Scratch this compressor asks of its :class:`Workspace`: two fp32 chunks (torch; three
        with the gain correction), or the int8 new error and its scales (the fused kernels;
        Triton adds 3 fp32 sums per block)."""
        new_err = self.num_blocks * (self.block_size + 4) if self.error_buffer is not None else 0
        if self.kernels == "triton":
            return new_err + self.num_blocks * 12
        if self.kernels == "cpu":
            return new_err
        return (3 if self.gain_correction else 2) * 4 * min(self.chunk_blocks, self.num_blocks) * self.block_size

    # -- the algorithm ---------------------------------------------------------------
    def _chunks(self) -> list[tuple[int, int, int, int]]:
        """``(block0, block1, elem0, elem1)`` pieces of at most ``chunk_blocks`` blocks,
        never crossing a row: blocks ``[block0, block1)`` hold the buffer's elements
        ``[elem0, elem1)`` followed by zero padding."""
        out = []
        for r in range(self.rows):
            row_start = r * self.row_numel
            row_end = min(row_start + self.row_numel, self.numel)
            for c in range(0, self.row_blocks, self.chunk_blocks):
                c1 = min(c + self.chunk_blocks, self.row_blocks)
                e0 = min(row_start + c * self.block_size, row_end)
                e1 = min(row_start + c1 * self.block_size, row_end)
                out.append((r * self.row_blocks + c, r * self.row_blocks + c1, e0, e1))
        return out

    def _compensate(self, flat: torch.Tensor, chunk: tuple, h: torch.Tensor) -> torch.Tensor:
        """fp32 blocks ``h = g + e`` of one chunk into scratch ``h`` (returned); the
        gradient part ``g`` is also left in ``h`` when there is no error."""
        b0, b1, e0, e1 = chunk
        n = e1 - e0
        hv = h.view(-1)
        hv[:n].copy_(flat[e0:e1])  # widens bf16 in the copy: no fp32 copy of the bucket
        hv[n:].zero_()
        if self._signs is not None:  # the step runs in the rotated domain: h = R(g) + e
            h.copy_(rot.rotate(h, self._signs))
        if self.error_buffer is None:
            return h
        return self.error_buffer.add_to_(h, b0, b1)

    def compress(self, grad: torch.Tensor, workspace: Optional["Workspace"] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-4 for one gradient ``grad`` (``numel`` elements, any float dtype).

        Returns ``(codes, scales)``: uint8 ``[num_blocks * block_size * bits / 8]`` and
        fp32 ``[num_blocks]``, exactly as :func:`quantize_blockwise` of each zero-padded
        row of ``h = g + e`` would, and advances the error state and the step counter.
        ``workspace`` lends the scratch (two fp32 chunks of at most ``chunk_elements``,
        shared by all buckets of a run). Afterwards :attr:`last_stats` holds fp32 ``[4]``
        device sums for the metrics: ``(sum e_new^2, sum (h - D(q))^2, sum h^2, numel)``,
        all zero when ``h`` is not finite. No host synchronisation happens here.

        A bucket larger than one chunk takes two passes: the first computes every
        block's scale (a NaN/Inf anywhere must keep the *whole* error unchanged, so the
        verdict is needed before any block's error may change), the second quantises
        and updates the error chunk by chunk.
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
        opts, plain = self.options, self._plain
        key = qz.noise_key(opts.seed, self.stream, self.step)
        flat, dev = grad.reshape(-1), grad.device
        chunks = self._chunk_list
        cb = min(self.chunk_blocks, self.num_blocks)
        h_buf = ws.get("h", (cb, self.block_size), dev)
        work_buf = ws.get("work", (cb, self.block_size), dev)
        scales = torch.empty(self.num_blocks, dtype=torch.float32, device=dev)
        codes = torch.empty(self.num_blocks * self.block_size * self.bits // 8, dtype=torch.uint8, device=dev)
        if len(chunks) > 1:  # pass 1: every block's scale, for the whole buffer's verdict
            for chunk in chunks:
                b0, b1 = chunk[:2]
                h = self._compensate(flat, chunk, h_buf[: b1 - b0])
                scales[b0:b1] = (qz.block_scales(h, self.bits, scratch=work_buf[: b1 - b0]) if plain
                                 else qz.option_scales(h, self.bits, opts))
            # 2. a non-finite block has a non-finite scale (amax propagates NaN).
            finite = torch.isfinite(scales).all()
        sums = torch.zeros(3, dtype=torch.float32, device=dev)
        code_bytes = self.block_size * self.bits // 8
        for chunk in chunks:
            b0, b1, e0, e1 = chunk
            h, work = h_buf[: b1 - b0], work_buf[: b1 - b0]
            self._compensate(flat, chunk, h)  # 1. h = g + e
            s = scales[b0:b1]
            if len(chunks) == 1:
                s.copy_(qz.block_scales(h, self.bits, scratch=work) if plain else qz.option_scales(h, self.bits, opts))
                finite = torch.isfinite(s).all()
            noise = (qz.uniform_noise(b1 - b0, self.block_size, key, b0, dev)
                     if opts.rounding == "stochastic" else None)
            q = qz.levels_(h, s, self.bits, opts, out=work, noise=noise)
            if self.gain_correction:  # before the residual: the error feedback sees the refit scale
                qz.unbiased_scales_(h, q, s, ws.get("gain", (cb, self.block_size), dev)[: b1 - b0])
            codes[b0 * code_bytes:b1 * code_bytes] = qz.pack_codes(qz.level_codes(q, opts), self.bits)
            # 3. residual h - D(q), in place: work becomes the residual.
            resid = torch.addcmul(h, q, s.unsqueeze(1), value=-1.0, out=work)
            sums[1] += torch.linalg.vector_norm(resid).square()
            sums[2] += torch.linalg.vector_norm(h).square()
            if self.error_buffer is not None:
                # e_new = beta*e + (1-beta)*(h - D) with e = h - g, computed in place in h
                # (the padding holds g = 0, so only the gradient's elements are subtracted).
                if self._signs is None:
                    h.view(-1)[: e1 - e0].sub_(flat[e0:e1])
                else:  # h - R(g) would round differently: re-read e as it was added
                    h.zero_()
                    self.error_buffer.add_to_(h, b0, b1)
                new_e = h.mul_(self.beta).add_(resid, alpha=1.0 - self.beta)
                sums[0] += torch.linalg.vector_norm(new_e).square()
                self.error_buffer.store_(new_e, finite, work, b0, b1)
        self.last_stats = self._stats(sums, finite)
        self.step += 1
        return codes, scales

    def _stats(self, sums: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """:attr:`last_stats` from the fp32 ``[3]`` device sums: ``numel`` appended, all zero
        when ``finite`` (0-d bool) is False, so the NaN of a bad step stays out of the
        metrics as well as out of the error. The ``[1]`` numel and the ``[4]`` zeros are
        device constants made once: a fresh ``torch.tensor`` from a Python value here would
        be a blocking pageable host-to-device copy inside the backward hooks."""
        dev = sums.device
        if self._stats_consts is None or self._stats_consts[0].device != dev:
            self._stats_consts = (torch.full((1,), float(self.numel), device=dev), torch.zeros(4, device=dev))
        numel, zeros = self._stats_consts
        return torch.where(finite, torch.cat([sums, numel]), zeros)

    def _error_tensors(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The stored error as the fused kernels take it: int8 ``[num_blocks, block_size]``
        and fp32 ``[num_blocks]`` (None, None without error feedback); the C++ kernel writes
        the new error into them itself, the Triton one into scratch (:meth:`_compress_triton`)."""
        buf = self.error_buffer
        return (buf.values, buf.scales) if buf is not None else (None, None)

    def _compress_triton(self, grad: torch.Tensor, ws: "Workspace") -> tuple[torch.Tensor, torch.Tensor]:
        """The same step as :meth:`compress` in one fused kernel (see :mod:`.triton_kernels`)."""
        from loco_megatron.loco import triton_kernels

        shape, dev = (self.num_blocks, self.block_size), grad.device
        buf = self.error_buffer
        ef = buf is not None
        new_err = ws.get("new_err", shape, dev, torch.int8) if ef else None
        new_scales = ws.get("new_err_scales", (self.num_blocks,), dev) if ef else None
        stats = ws.get("stats", (self.num_blocks, 3), dev)
        codes, scales = triton_kernels.compress(
            grad.reshape(-1), *self._error_tensors(), self.beta, self.bits, self.block_size, new_err, new_scales, stats,
            row_numel=self.row_numel, row_blocks=self.row_blocks, num_blocks=self.num_blocks, options=self.options,
            key=qz.noise_key(self.options.seed, self.stream, self.step))
        finite = torch.isfinite(scales).all()
        if ef:  # the NaN/Inf rule needs the whole buffer's verdict: select on the device
            buf.keep_if_finite_(finite, new_err, new_scales)
        self.last_stats = self._stats(stats.sum(dim=0), finite)
        self.step += 1
        return codes, scales

    def _compress_cpu(self, grad: torch.Tensor, ws: "Workspace") -> tuple[torch.Tensor, torch.Tensor]:
        """The same step as :meth:`compress` in the fused C++ kernel (see :mod:`.cpu_kernels`).

        The flat ``grad`` is split into this compressor's rows inside the kernel (each
        padded to whole blocks, a ragged last row included). One pass over ``grad``, the
        new error going to an int8 scratch from the workspace (1 byte per element of the
        largest bucket, shared by all buckets) that is copied over the error when every
        scale is finite: measured faster than the scratch-free two-pass scheme (README,
        "Fused kernels").
        """
        from loco_megatron.loco import cpu_kernels

        g = grad.reshape(-1)
        if g.dtype not in (torch.float32, torch.bfloat16):
            g = g.float()
        scratch = (None, None)
        if self.error_buffer is not None:
            shape = (self.num_blocks, self.block_size)
            scratch = (ws.get("new_err", shape, g.device, torch.int8),
                       ws.get("new_err_scales", (self.num_blocks,), g.device))
        key = qz.noise_key(self.options.seed, self.stream, self.step) if self.options.rounding == "stochastic" else 0
        codes, scales, self.last_stats = cpu_kernels.compress(
            g, *self._error_tensors(), self.beta, self.bits, self.block_size, self.numel, *scratch,
            rows=self.rows, options=None if self._plain else self.options, key=key)
        self.step += 1
        return codes, scales

    def reset(self) -> None:
        """``e = 0``."""
        if self.error_buffer is not None:
            self.error_buffer.zero_()

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = {"step": self.step, "numel": self.numel, "rows": self.rows, "bits": self.bits,
              "block_size": self.block_size, "error_bits": self.error_bits,
              "error_feedback": self.error_buffer is not None, "rotation": self.options.rotation,
              "rotation_seed": self.options.seed if self._signs is not None else None}
        if self.error_buffer is not None:
            sd.update(self.error_buffer.state_dict())
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore the error and step counter; :class:`LoCoStateMismatch` (naming what
        differs) when ``sd`` was written for another buffer shape or error format."""
        saved_ef = "error" in sd
        if saved_ef != (self.error_buffer is not None):
            raise LoCoStateMismatch(f"error feedback was {'on' if saved_ef else 'off'} in the checkpoint "
                                    f"(--loco-error-feedback changed)")
        for key in ("numel", "rows", "bits", "block_size", "error_bits"):
            if sd.get(key, 1 if key == "rows" else None) != getattr(self, key):
                raise LoCoStateMismatch(f"{key}={sd.get(key)} in the checkpoint, {getattr(self, key)} now")
        # The error is stored in the rotated domain of one sign pattern.
        saved = (sd.get("rotation", "none"), sd.get("rotation_seed"))
        now = (self.options.rotation, self.options.seed if self._signs is not None else None)
        if saved != now:
            raise LoCoStateMismatch(f"rotation {saved[0]} (seed {saved[1]}) in the checkpoint, {now[0]} "
                                    f"(seed {now[1]}) now (--loco-rotation/--loco-quant-seed changed)")
        self.step = int(sd["step"])
        if self.error_buffer is not None:
            self.error_buffer.load_state_dict(sd)
