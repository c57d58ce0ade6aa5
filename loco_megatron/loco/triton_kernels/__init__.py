"""Fused Triton kernels for LoCo's compress and decompress-and-sum (GPU; CPU under
``TRITON_INTERPRET=1`` for tests), for every quantiser option (:class:`.quantize.QuantOptions`).

They compute exactly what the pure-torch reference (:mod:`.quantize`,
:class:`.LoCoCompressor`, :func:`.collectives.decompress_into`) computes, in one pass
over memory per bucket:

* :func:`compress`: reads ``g`` (fp32/bf16) and the int8 error with its block scales;
  writes packed codes, fp32 block scales, the updated int8 error and its scales (into
  scratch: the NaN/Inf rule needs the whole buffer's verdict before the error may
  change, so the caller selects new-or-old on the device), and per-block sums for the
  metrics. Codes and scales are bit-identical to the reference: the same fp32
  operations in the same order (:mod:`.jit`), IEEE division (``div_rn``),
  round-half-even, no contracted multiply-add.
* :func:`decompress_sum`: reads the ``W`` received rows (codes + scales) of one shard
  and writes ``scale * sum_r D(codes_r, scales_r)``, summed in fp32 in rank order (and,
  with the Hadamard rotation, unrotated once per block before the scaling), into the
  shard (cast to its dtype) - bit-identical to the reference.
* :func:`param_apply`: the parameter gather's decode-and-apply of one gathered row,
  ``dst = cast(float(src) + D(codes, scales))`` (the contract of ``csrc/param_apply.h``),
  bit-identical to :func:`.param_delta.add_delta` of :func:`.param_delta.decode_chunk`.

The kernels themselves are in :mod:`.kernels`, their helpers in :mod:`.jit`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from loco_megatron.loco import quantize as qz
from loco_megatron.loco import rotation as rot
from loco_megatron.loco.triton_kernels import jit, kernels  # noqa: F401  (tk.jit, tk.kernels)
from loco_megatron.loco.triton_kernels.kernels import _compress_kernel, _decompress_sum_kernel, _param_apply_kernel

__all__ = ["compress", "decompress_sum", "param_apply", "triton_interpreted"]


def _no_fma(t: torch.Tensor) -> bool:
    """Compiled for an NVIDIA GPU (PTX inline assembly available); the interpreter and
    ROCm take the plain product."""
    return t.is_cuda and torch.version.hip is None and not triton_interpreted()


def triton_interpreted() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1, chosen before import)."""
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
    return isinstance(_compress_kernel, InterpretedFunction)


def _tiles(t: torch.Tensor) -> int:
    """Tiles of :func:`_rows` blocks each compress program walks: many blocks per program on a
    GPU (32 at B=256: its set-up is paid once per 8192 elements, and the grid stays small);
    one under the interpreter, whose programs are Python either way."""
    return 8 if t.is_cuda else 1


def _rows(t: torch.Tensor) -> int:
    """Quantisation blocks per program: a 1024-element tile on a GPU (B=256); on CPU, under
    the interpreter, big tiles, since there every program costs Python overhead."""
    return 4 if t.is_cuda else 64


@functools.lru_cache(maxsize=64)
def _signs_cached(block_size: int, seed: int, device: str) -> torch.Tensor:
    """fp32 ``[block_size]`` Hadamard signs, derived once per (block, seed, device); read-only."""
    return rot.signs(block_size, seed, device)


def _signs(opts: qz.QuantOptions, block_size: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    return _signs_cached(block_size, opts.seed, str(like.device)) if opts.rotation == "hadamard" else None


def _as_i32(key: int) -> int:
    """The 32-bit key as a signed int32 (the kernel reinterprets it as uint32): always an
    ``i32`` argument, so keys from 2**31 on do not compile a second (``i64``) copy."""
    key = int(key) & 0xFFFFFFFF
    return key - (1 << 32) if key >= 1 << 31 else key


def compress(g: torch.Tensor, err, err_scales, beta: float, bits: int, block_size: int,
             new_err, new_err_scales, stats: torch.Tensor, row_numel: int = None,
             row_blocks: int = None, num_blocks: int = None, options: Optional[qz.QuantOptions] = None,
             key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused compress of flat ``g`` (``numel`` elements in rows of ``row_numel``,
    each padded to ``row_blocks`` whole blocks; default: one row).

    ``err``/``err_scales``: int8 ``[nb, B]`` and fp32 ``[nb]`` (None without error
    feedback; rotated with the Hadamard rotation, as the reference stores it);
    ``new_err``/``new_err_scales`` receive the updated error; ``stats`` fp32 ``[nb, 3]``
    receives per-block ``(sum e_new^2, sum resid^2, sum h^2)``. ``options``: the quantiser
    options (``block_size`` a power of two); ``key``: :func:`.quantize.noise_key` of this
    step (stochastic rounding). Returns ``(codes, scales)`` as :func:`quantize_blockwise` does.
    """
    opts = options or qz.DEFAULT_OPTIONS
    numel = g.numel()
    row_numel = numel if row_numel is None else row_numel
    row_blocks = -(-row_numel // block_size) if row_blocks is None else row_blocks
    nb = (-(-numel // row_numel) * row_blocks if numel else 0) if num_blocks is None else num_blocks
    codes = torch.empty(nb * block_size * bits // 8, dtype=torch.uint8, device=g.device)
    scales = torch.empty(nb, dtype=torch.float32, device=g.device)
    has_err = err is not None
    dummy = scales  # never dereferenced when HAS_ERR (or ROTATE) is False
    signs = _signs(opts, block_size, g)
    rows, tiles = _rows(g), _tiles(g)
    _compress_kernel[(triton.cdiv(nb, rows * tiles),)](
        g.reshape(-1), err if has_err else dummy, err_scales if has_err else dummy, codes, scales,
        new_err if has_err else dummy, new_err_scales if has_err else dummy, stats,
        dummy if signs is None else signs, numel, nb, row_numel, row_blocks, float(beta), 1.0 - beta,
        block_size ** -0.5, _as_i32(key),
        BITS=bits, B=block_size, LOG_B=block_size.bit_length() - 1, ROWS=rows, HAS_ERR=has_err,
        UNIFORM=opts.quantizer == "uniform", MSE=opts.scale == "mse", ROTATE=signs is not None,
        STOCHASTIC=opts.rounding == "stochastic", NO_FMA=_no_fma(g), TILES=tiles,
        EVEN=row_numel % block_size == 0)
    return codes, scales


def decompress_sum(recv: torch.Tensor, layout, out: torch.Tensor, scale: float = 1.0) -> None:
    """Write ``scale * sum_r D(row r)`` of ``recv`` (uint8 ``[W, row_bytes]``) into ``out``
    (this rank's shard: its first ``out.numel() <= layout.shard`` elements, any float
    dtype); the contract of :func:`.collectives.decompress_into`, bit-identical to it
    (``layout.options``: signed uniform scales need nothing; the rotation is undone)."""
    assert recv.is_contiguous() and layout.row_bytes % 4 == 0 and layout.code_bytes % 4 == 0
    assert out.dtype in (torch.float32, torch.bfloat16, torch.float16), out.dtype
    bf16 = out.dtype == torch.bfloat16
    signs = _signs(getattr(layout, "options", None) or qz.DEFAULT_OPTIONS, layout.block_size, recv)
    rows = _rows(recv)
    B = layout.block_size
    _decompress_sum_kernel[(triton.cdiv(layout.shard_blocks, rows),)](
        recv, recv.view(torch.float32), out.view(torch.uint16) if bf16 else out,
        recv.view(torch.float32) if signs is None else signs, out.numel(), layout.shard_blocks, layout.row_bytes,
        layout.code_bytes, float(scale), B ** -0.5, WORLD=layout.world, BITS=layout.bits, B=B,
        LOG_B=B.bit_length() - 1, ROWS=rows, ROTATE=signs is not None, OUT_BF16=bf16, NO_FMA=_no_fma(recv))


_PARAM_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The parameter dtypes :func:`param_apply` takes, as its kernel's ``DTYPE`` (bf16 travels as uint16 bits)."""


def param_apply(codes: torch.Tensor, scales: torch.Tensor, layout, src: torch.Tensor, dst: torch.Tensor,
                new: Optional[torch.Tensor] = None, dst2: Optional[torch.Tensor] = None, swap: bool = False,
                blocks: Optional[tuple[int, int]] = None) -> Optional[torch.Tensor]:
    """Blocks ``blocks = (b0, b1)`` (default: all) of one gathered row applied to its shard,
    with the arguments of :func:`.cpu_kernels.param_apply` (``codes``: the uint8 row,
    ``scales``: its fp32 ``[blocks]`` of :func:`.param_delta.row_scales`, ``src``/``dst``:
    ``[S]``, fp32/bf16/fp16, the same tensor in place; the own shard's ``new``, ``dst2``,
    ``swap``). Returns the own shard's float64 ``[2]`` ``(sum (result - new)^2, sum new^2)``
    on the device (no host sync), else None."""
    assert src.dtype in _PARAM_DTYPES and dst.dtype == src.dtype, (src.dtype, dst.dtype)
    B = layout.block_size
    b0, b1 = blocks if blocks is not None else (0, layout.blocks)
    per_block = B * layout.bits // 8
    lo, hi = b0 * B, min(b1 * B, src.numel())
    rows = _rows(src)
    grid = triton.cdiv(b1 - b0, rows)
    own = new is not None
    norms = torch.empty(grid, 2, dtype=torch.float32, device=src.device) if own else scales

    def param(t: Optional[torch.Tensor]) -> torch.Tensor:  # the slice, bf16 as its bits; None: unused
        t = src if t is None else t
        return t[lo:hi].view(torch.uint16) if t.dtype == torch.bfloat16 else t[lo:hi]

    signs = _signs(layout.options, B, src)
    _param_apply_kernel[(grid,)](
        codes[b0 * per_block:b1 * per_block], scales[b0:b1], param(src), param(dst), param(new), param(dst2), norms,
        scales if signs is None else signs, hi - lo, b1 - b0, B ** -0.5, BITS=layout.bits, B=B,
        LOG_B=B.bit_length() - 1, ROWS=rows, ROTATE=signs is not None, DTYPE=_PARAM_DTYPES[src.dtype], OWN=own,
        HAS_DST2=dst2 is not None, SWAP=bool(swap), NO_FMA=_no_fma(src))
    return norms.double().sum(dim=0) if own else None
