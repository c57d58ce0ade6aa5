"""``--loco-kernels``: which implementation of LoCo's compress / decompress-and-sum runs
(the torch reference, the fused C++ CPU kernels, or the fused Triton GPU kernels)."""

from __future__ import annotations

import importlib.util
from typing import Callable, Optional, Sequence


def resolve_kernels(choice: str, device_type: str, interpret: bool, bits: int, block_size: int,
                    error_bits: int, error_feedback: bool, cpu_builder: Optional[Callable] = None,
                    options: Sequence[str] = (), announce: Optional[Callable[[str], None]] = None) -> str:
    """``"torch"``, ``"triton"`` or ``"cpu"`` for ``--loco-kernels choice``; ValueError (one
    line, naming the reason) when ``triton``/``cpu`` is asked for and cannot run this shape.
``options``: the quantiser options in use that differ from the original scheme (as
flags, :meth:`.quantize.QuantOptions.non_default`); the fused kernels implement none of
them, so ``auto`` then picks torch and an explicit ``cpu``/``triton`` names them.

    ``auto``: triton on CUDA, cpu on a CPU device when the C++ extension builds, else torch.
    ``cpu`` whose extension cannot be built (no compiler) falls back to torch, with one
    line printed once (:func:`.cpu_kernels.extension`; ``cpu_builder`` replaces the build).
    ``announce`` gets one line before the C++ kernels are compiled (first use only).
    """
    if choice == "torch":
        return "torch"
    if options:
        if choice == "auto":
            return "torch"
        raise ValueError(f"--loco-kernels {choice} does not implement {', '.join(options)} (use torch or auto)")
    if choice == "cpu" or (choice == "auto" and device_type == "cpu"):
        from loco_megatron.loco import cpu_kernels

        why = cpu_kernels.unsupported(bits, block_size, error_bits, error_feedback)
        if device_type != "cpu":
            why = f"needs a CPU device, got {device_type}"
        if why is not None:
            if choice == "auto":
                return "torch"
            raise ValueError(f"--loco-kernels cpu {why}")
        if announce is not None and cpu_kernels.needs_build():
            announce(cpu_kernels.BUILD_NOTE)
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
