"""``--loco-kernels``: which implementation of LoCo's compress / decompress-and-sum runs
(the torch reference, the fused C++ CPU kernels, or the fused Triton GPU kernels)."""

from __future__ import annotations

import importlib.util
from typing import Callable, Optional, Sequence

from loco_megatron.progress import progress


BUILDING = "the C++ CPU kernels are building in the background (first use only)"
"""Why ``auto`` runs torch on a CPU device while a first build runs (:func:`choose_kernels`)."""


def choose_kernels(choice: str, device_type: str, interpret: bool, bits: int, block_size: int,
                   error_bits: int, error_feedback: bool, cpu_builder: Optional[Callable] = None,
                   options: Sequence[str] = (), announce: Optional[Callable[[str], None]] = None,
                   param_gather_bits: int = 0, background: bool = False) -> tuple[str, Optional[str]]:
    """``(kernels, why)``: ``"torch"``, ``"triton"`` or ``"cpu"`` for ``--loco-kernels choice``,
    and, when a fused path was possible in principle but torch runs (``auto`` on a shape or
    option the device's kernels cannot serve, or a C++ build that failed), one phrase
    saying why (else None). ValueError (one line, naming the reason) when ``triton``/``cpu``
    is asked for and cannot run this configuration.

    ``options``: the quantiser options in use that differ from the original scheme (as
    flags, :meth:`.quantize.QuantOptions.non_default`). Both the C++ and the Triton
    kernels implement all of them (kept for callers; it refuses nothing).

    ``auto``: triton on CUDA, cpu on a CPU device when the C++ extension builds, else torch.
    ``cpu`` whose extension cannot be built (no compiler) falls back to torch, with one
    line printed once (:func:`.cpu_kernels.extension`; ``cpu_builder`` replaces the build).
    ``announce`` gets one line before the C++ kernels are compiled (first use only), and
    one line with the time taken every 20 s while they compile.
    ``background``: ``auto`` on a CPU device does not wait for a first build: it returns
    torch with :data:`BUILDING` as the reason (the caller starts the build, see
    :func:`.cpu_kernels.start_background_build`); ``cpu`` (demanded) still builds here.
    ``param_gather_bits`` (``--param-gather-bits``, 0: off): the parameter gather runs on
    the same kernels, so the narrower of the two widths sizes the smallest Triton block.
    """
    if choice == "torch":
        return "torch", None
    if choice == "cpu" or (choice == "auto" and device_type == "cpu"):
        from loco_megatron.loco import cpu_kernels

        why = cpu_kernels.unsupported(bits, block_size, error_bits, error_feedback)
        if device_type != "cpu":
            why = f"needs a CPU device, got {device_type}"
        if why is not None:
            if choice == "auto":
                return "torch", f"--loco-kernels cpu {why}"
            raise ValueError(f"--loco-kernels cpu {why}")
        building = cpu_kernels.needs_build()
        if building and background and choice == "auto":
            failed = cpu_kernels.build_failure()
            return "torch", BUILDING if failed is None else f"the C++ CPU kernels could not be built ({failed})"
        if announce is not None and building:
            announce(cpu_kernels.BUILD_NOTE)
        with progress("building LoCo's C++ CPU kernels", announce if building else None):
            built = cpu_kernels.extension(*([cpu_builder] if cpu_builder else []))
        return ("cpu", None) if built is not None else ("torch", "the C++ CPU kernels could not be built")
    why = None
    if importlib.util.find_spec("triton") is None:
        why = "triton is not installed (pip install -r requirements-triton.txt)"
    elif device_type != "cuda" and not interpret:
        why = "needs a CUDA device (or TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
    elif block_size & (block_size - 1) or block_size < 8 * (8 // min(bits, param_gather_bits or bits)):
        why = f"needs a power-of-two --loco-block-size, got {block_size}"
    elif error_feedback and error_bits != 8:
        why = f"supports the int8 error buffer only (--loco-error-bits 8), got {error_bits}"
    if choice == "auto":
        if why is None and device_type == "cuda":
            return "triton", None
        return "torch", (f"--loco-kernels triton {why}" if device_type == "cuda" else None)
    if why is not None:
        raise ValueError(f"--loco-kernels triton {why}")
    return "triton", None


def kernels_line(kernels: str, grads_compressed: bool, param_gather_bits: int, why: Optional[str],
                 param_options: str = "") -> str:
    """The start-up line naming the kernels in use, e.g. ``kernels: grads cpu, params cpu``
    (``kernels``: the resolved ``--loco-kernels``); ``why`` (from :func:`choose_kernels`)
    adds why the gradients fell back to torch; ``param_options`` (e.g. ``2-bit
    uniform/mse/hadamard/nearest``) follows the parameter gather's kernels in parentheses.

    The parameter gather (``--param-gather-bits``) runs on the fused kernels the gradients'
    ``--loco-kernels`` resolved to (cpu or triton), else on torch (:class:`.hooks.ParamGatherHook`,
    :func:`param_kernels`)."""
    grads = kernels if grads_compressed else "off (megatron's reduce-scatter)"
    params = param_kernels(kernels) if param_gather_bits else "off (megatron's all-gather)"
    if param_gather_bits and param_options:
        params += f" ({param_options})"
    line = f"kernels: grads {grads}, params {params}"
    return line + (f"; torch because {why}" if why and grads_compressed else "")


def param_kernels(kernels: str) -> str:
    """The parameter gather's kernels for the resolved ``--loco-kernels``: the same fused
    kernels (C++ encode and decode-and-apply on cpu, Triton on triton), else torch."""
    return kernels if kernels in ("cpu", "triton") else "torch"


def decompressor(kernels: str) -> Callable:
    """The decompress-and-sum of the resolved ``kernels`` (``"torch"``, ``"cpu"``, ``"triton"``),
    each with the contract of :func:`.collectives.decompress_into`: ``(recv, layout, out,
    scale=1.0)``. Imported on demand (Triton and the C++ build only where they run)."""
    if kernels == "triton":
        from loco_megatron.loco import triton_kernels

        return triton_kernels.decompress_sum
    if kernels == "cpu":
        from loco_megatron.loco import cpu_kernels

        return cpu_kernels.decompress_sum
    from loco_megatron.loco.collectives import decompress_into

    return decompress_into


def hook_kernels(choice: str) -> tuple[str, Callable]:
    """``(kernels, decompress)`` of a gradient hook for ``--loco-kernels choice``: the trainer
    resolves ``auto`` before building the hooks (it knows the device); a hook built directly
    with ``auto`` runs torch. ``decompress``: that kernels' :func:`decompressor`."""
    kernels = choice if choice != "auto" else "torch"
    return kernels, decompressor(kernels)
