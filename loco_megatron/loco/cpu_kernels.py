"""Fused CPU kernels for LoCo's compress and decompress-and-sum, and the parameter gather's
decode-and-apply (C++, ``csrc/``: ``loco_cpu.cpp``, the Python module, and the units and
headers it lists in ``kernels.h``).

Built at first use with ``torch.utils.cpp_extension.load`` (ninja + the system C++
compiler) into a folder of torch's extensions root (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions/py311_cpu``) named for the sources, the checkout and the ninja
version (:func:`build_directory`), so later processes only load the ``.so`` and two
checkouts never rebuild each other's. Every build and load runs the pinned ninja
(:func:`pinned_ninja`) whatever is first on PATH. ``python -m loco_megatron.loco.cpu_kernels``
builds them (what a run with ``--loco-kernels auto`` starts in the background,
:func:`start_background_build`). The source is compiled for baseline x86-64 plus an
AVX2+FMA copy of every hot loop, chosen at run time by CPU feature detection, so the build
runs on any x86-64 CPU (and on other architectures, without the AVX2 copy).

The kernels compute what the torch reference computes (:mod:`.quantize`,
:class:`.LoCoCompressor`, :func:`.collectives.decompress_into`), bit for bit for codes,
scales and decompressed sums; the stored error matches within one int8 step.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Callable, Optional

import torch

from loco_megatron.loco import quantize as qz
from loco_megatron.loco import rotation as rot
from loco_megatron.loco.build_lock import LOCK_FILE, build_lock

CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "loco_cpu.cpp"
"""The Python module's unit (argument checks and dispatch; ``PYBIND11_MODULE``)."""
SOURCES = (SOURCE, CSRC / "param_apply.cpp", CSRC / "isa_base.cpp", CSRC / "isa_avx2.cpp", CSRC / "isa_avx512.cpp")
"""The translation units, which ninja compiles in parallel (torch passes ``MAX_JOBS``, default
the CPU count): one per instruction-set copy of the hot loops, the largest part of the build,
so that no single compiler process holds all three (``csrc/kernels.h``)."""
HEADERS = tuple(CSRC / h for h in ("kernels.h", "compress.h", "decompress.h", "param_apply.h", "quant_options.h",
                                   "isa_copy.h", "module.h"))
"""Included by :data:`SOURCES`; their contents are part of the build folder's name
(:func:`build_directory`), so an edited header builds anew."""
MAX_BLOCK = 8192
"""Largest --loco-block-size the kernels take (their per-thread block buffers are on the stack)."""

CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fno-math-errno"]
"""-ffp-contract=off: never fuse a multiply and an add that the reference rounds twice;
-fopenmp: ``#pragma omp simd`` and at::parallel_for's OpenMP backend (torch's own libgomp
is reused at load time)."""


NAME = "loco_cpu_kernels"
BUILD_NOTE = ("building LoCo's C++ CPU kernels (first use only, ~1.5-2.5 min on 2 cores; cached in torch's "
              "extensions folder)")
"""The line printed before a build in the foreground (``--loco-kernels cpu``). Measured from an empty
TORCH_EXTENSIONS_DIR on 2 idle cores (no AVX-512): 1 min 32 s wall, 2 min 45 s of CPU for the four units
built there; with the AVX-512 unit as well (a CPU that has it): 2 min 18 s wall, 4 min 4 s of CPU. The
three instruction-set units are most of it; on cores shared with other work the wall time grows with
the load."""
BUILT_MARK = "loco_built"
"""Written into the build folder once the module has been built and loaded, holding the
ninja version that built it (:func:`built_mark`): a ``.so`` that ninja is still linking is
never taken for a finished build, nor one that another ninja built (:func:`needs_build`)."""
FAILED_MARK = "loco_build_failed"
"""Written by a background build that failed (no compiler, a compile error), holding the
reason: later runs do not start it again for the same sources (:func:`build_failure`)."""


AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
"""What the AVX-512 copy needs (loco_cpu.cpp's ``isa_level`` checks the same at run time)."""


@functools.lru_cache(maxsize=None)
def max_isa(cpuinfo: str = "/proc/cpuinfo") -> int:
    """The highest instruction-set copy to compile: 1 (no AVX-512 copy) on an x86-64 Linux
    machine whose ``cpuinfo`` flags lack any of :data:`AVX512_FLAGS`, else 2 (every copy; a
    system without that file or its ``flags`` line is not asked). The AVX-512 unit is a
    third of the build and never runs on such a CPU."""
    try:
        with open(cpuinfo) as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), None)
    except OSError:
        return 2
    return 2 if flags is None or all(f in flags for f in AVX512_FLAGS) else 1


def units() -> list[pathlib.Path]:
    """The :data:`SOURCES` compiled on this machine (:func:`max_isa`)."""
    return [f for f in SOURCES if max_isa() >= 2 or f.name != "isa_avx512.cpp"]


def cflags() -> list[str]:
    """:data:`CFLAGS` and the highest copy compiled in (``LOCO_MAX_ISA``, csrc/kernels.h)."""
    return [*CFLAGS, f"-DLOCO_MAX_ISA={max_isa()}"]


@functools.lru_cache(maxsize=None)
def pinned_ninja() -> tuple[str, str]:
    """``(executable, version)`` of the ninja that builds (and loads) the kernels: the
    ``ninja`` package's, which requirements.txt pins (``ninja.BIN_DIR``, next to this
    interpreter), whatever is first on PATH; without that package, the first ``ninja`` on
    PATH; ``("", "none")`` when there is neither (torch's build then fails, saying so).

    One ninja per build folder: two ninja versions take each other's ``.ninja_log`` (a
    format and a command hash of their own) for changed commands, so a launch by absolute
    path (the system's ninja first on PATH) and one with the environment's ``bin`` on PATH
    rebuilt every unit of each other's build."""
    try:
        import ninja as package

        path = os.path.join(package.BIN_DIR, "ninja") if package.BIN_DIR else ""
    except ImportError:
        path = ""
    if not (path and os.access(path, os.X_OK)):
        path = shutil.which("ninja") or ""
    if not path:
        return "", "none"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):  # torch's build runs it again and says why
        return path, "unknown"
    return path, out.stdout.strip()


def built_mark() -> str:
    """What :data:`BUILT_MARK` holds for a build by :func:`pinned_ninja` (its version)."""
    return f"ninja {pinned_ninja()[1]}\n"


@contextlib.contextmanager
def _pinned_ninja_first():
    """``os.environ``'s PATH with :func:`pinned_ninja`'s folder first, restored on leaving:
    torch runs ``ninja`` by name (its availability check and the build, whose environment is
    a copy of ``os.environ``). Only the build and load under :func:`.build_lock.build_lock` run
    inside it, before any training step; nothing else sees the change afterwards."""
    before = os.environ.get("PATH")
    folder = os.path.dirname(pinned_ninja()[0])
    if folder:
        os.environ["PATH"] = os.pathsep.join([folder, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _checkout_key() -> str:
    """16 hex digits of the sha256 of every source and header, the compiler flags, the
    ninja version (:func:`pinned_ninja`: another one would rebuild everything) and this
    checkout's path (torch's ``build.ninja`` names the sources by path, so another checkout
    in the same folder would rebuild it even with identical sources)."""
    h = hashlib.sha256(str(CSRC).encode())
    for f in (*SOURCES, *HEADERS):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(" ".join(cflags()).encode())
    h.update(built_mark().encode())
    return h.hexdigest()[:16]


def build_directory() -> pathlib.Path:
    """``<torch extensions root>/loco_cpu_kernels_<key>`` (:func:`_checkout_key`), created."""
    from torch.utils import cpp_extension

    return pathlib.Path(cpp_extension._get_build_directory(f"{NAME}_{_checkout_key()}", verbose=False))


def needs_build() -> bool:
    """Whether loading the kernels compiles them first: no finished build in
    :func:`build_directory` yet, one whose mark names another ninja (:func:`built_mark`;
    a mark without one is an older version's), or a source or header newer than it. ninja
    decides by modification time, so a fresh clone or a checkout that rewrote the files
    (same contents, same folder name) recompiles; a run that took the old build for current
    would then compile in the foreground at start-up instead of in the background."""
    mark = build_directory() / BUILT_MARK
    try:
        if mark.read_text() != built_mark():
            return True
    except OSError:
        return True
    built = mark.stat().st_mtime
    return any(f.stat().st_mtime > built for f in (*SOURCES, *HEADERS))


def build_failure() -> Optional[str]:
    """Why the background build of these sources failed (one line, naming its log), or None."""
    mark = build_directory() / FAILED_MARK
    return (mark.read_text().strip() or "see its log") if mark.is_file() else None


def start_background_build() -> Optional[pathlib.Path]:
    """Start ``python -m loco_megatron.loco.cpu_kernels`` as a process of its own (its own
    session: it outlives this run, which it never slows by a lock), writing its output to
    ``build.log`` in :func:`build_directory`; returns that log, or None when a build of this
    folder is already running (its flock is held), which is then left to finish."""
    folder = build_directory()
    with open(folder / LOCK_FILE, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        fcntl.flock(handle, fcntl.LOCK_UN)
    log = folder / "build.log"
    with open(log, "w") as out:
        # cwd: the checkout, so that ``-m`` imports this package (and builds these sources).
        subprocess.Popen([sys.executable, "-m", "loco_megatron.loco.cpu_kernels"], stdout=out,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                         cwd=str(CSRC.parents[2]))
    return log


def _build_with_torch(verbose: bool = False, background: bool = False):
    """Build (first use) or load the module in :func:`build_directory`, under its
    :func:`.build_lock.build_lock`, with :func:`pinned_ninja` (torch runs ninja at every
    load: a ninja of another version would rebuild it all); ``background``: this is the
    niced background build, writing to ``build.log`` there (a process that needs the
    kernels raises its priority rather than wait on it at nice 10)."""
    from torch.utils import cpp_extension

    folder = build_directory()
    with build_lock(folder, background, folder / "build.log" if background else None), _pinned_ninja_first():
        module = cpp_extension.load(name=NAME, sources=[str(f) for f in units()], extra_cflags=cflags(),
                                    extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=verbose)
        (folder / BUILT_MARK).write_text(built_mark())
        (folder / FAILED_MARK).unlink(missing_ok=True)
        return module


@functools.lru_cache(maxsize=None)
def extension(builder: Callable = _build_with_torch):
    """The built module, or None when it cannot be built (then prints one line, once per
    process and builder). ``builder()`` returns the module or raises."""
    try:
        return builder()
    except Exception as e:  # no compiler, no ninja, a broken toolchain: all mean "use torch"
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        print(f"loco: the C++ CPU kernels could not be built ({reason}); using the torch reference",
              file=sys.stderr, flush=True)
        return None


def unsupported(bits: int, block_size: int, error_bits: int, error_feedback: bool) -> Optional[str]:
    # Every quantiser option (uniform grid, mse scale, Hadamard rotation, stochastic
    # rounding) is implemented; the rotation's power-of-two block is checked by the config.
    """Why the kernels cannot run this configuration (one phrase), or None."""
    if bits not in (2, 4, 8):
        return f"supports 2, 4 or 8 bits, got {bits}"
    if block_size % 8 or not 0 < block_size <= MAX_BLOCK:
        return f"needs a --loco-block-size that is a multiple of 8 up to {MAX_BLOCK}, got {block_size}"
    if error_feedback and error_bits != 8:
        return f"supports the int8 error buffer only (--loco-error-bits 8), got {error_bits}"
    return None


def compress(g: torch.Tensor, err: Optional[torch.Tensor], err_scales: Optional[torch.Tensor], beta: float,
             bits: int, block_size: int, numel: int, err_scratch: Optional[torch.Tensor] = None,
             err_scales_scratch: Optional[torch.Tensor] = None, isa: int = -1, rows: int = 0,
             options: Optional[qz.QuantOptions] = None, key: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused LoCo step of ``g`` (contiguous fp32/bf16 ``[rows, S]``, or 1-D = one row;
    or, with ``rows > 0``, flat ``g`` split into ``rows`` rows of ``ceil(N / rows)``, the
    last ones shorter); each row is treated as zero-padded to ``P = ceil(S/B)*B``, no copy
    is made.

    ``err``/``err_scales``: int8 ``[rows*P/B, B]`` and fp32 ``[rows*P/B]`` (None without
    error feedback), updated in place unless a scale is non-finite. With scratch (int8
    and fp32 of the same sizes) the step is one pass into the scratch, copied over when
    finite; without, two passes (scales first, then codes and the error in place).
    Returns ``(codes uint8 [rows*P*bits/8], scales fp32 [rows*P/B], stats fp32 [4])``,
    ``stats = (sum e'^2, sum resid^2, sum h^2, numel)``, zeros when not finite.
    ``isa`` forces a lower instruction-set copy (0 baseline, 1 AVX2+FMA, 2 AVX-512; tests);
    -1 (and anything the CPU lacks) runs the best one. Needs :func:`extension` to have
    built (callers check it once, up front).

    ``options``: the quantiser options (:class:`.quantize.QuantOptions`; with the Hadamard
    rotation the error is in the rotated domain, as the reference stores it); ``key``:
    :func:`.quantize.noise_key` of this step for stochastic rounding.
    """
    empty = torch.empty(0)
    pick = (lambda t: empty if t is None else t)
    one_pass = err is None or err_scratch is not None
    opts = options or qz.DEFAULT_OPTIONS
    signs = _signs(block_size, opts)
    return tuple(extension().compress(g.contiguous(), pick(err), pick(err_scales), float(beta), bits, block_size,
                                          not one_pass, pick(err_scratch), pick(err_scales_scratch), float(numel),
                                          isa, rows, int(opts.quantizer == "uniform"), opts.scale == "mse",
                                          pick(signs), _rot_scale(block_size), opts.rounding == "stochastic",
                                          int(key)))


@functools.lru_cache(maxsize=64)
def _signs(block_size: int, opts: qz.QuantOptions) -> Optional[torch.Tensor]:
    """fp32 ``[block_size]`` Hadamard signs of ``opts`` (None without rotation); derived once
    per (block, options), not per bucket per step. Read-only to the kernels."""
    return rot.signs(block_size, opts.seed) if opts.rotation == "hadamard" else None


def _rot_scale(block_size: int) -> float:
    """``B ** -0.5`` as the reference's ``mul_`` uses it (torch rounds the Python float to
    fp32; so does the kernel)."""
    return block_size ** -0.5


def decompress_sum(recv: torch.Tensor, layout, out: torch.Tensor, scale: float = 1.0, isa: int = -1) -> None:
    """``out = scale * sum_r D(recv[r])`` (rank order, fp32 sums) for uint8 ``[W, row_bytes]``
    ``recv``; the contract of :func:`.collectives.decompress_into`, bit-identical to it."""
    # out.numel() <= layout.shard: a ragged last row writes only its prefix. With the
    # Hadamard rotation the sum is unrotated (before the scaling), as the reference does.
    opts = getattr(layout, "options", None) or qz.DEFAULT_OPTIONS
    signs = _signs(layout.block_size, opts)
    extension().decompress_sum(recv, layout.code_bytes, out.numel(), layout.bits, layout.block_size, out,
                               float(scale), isa, torch.empty(0) if signs is None else signs,
                               _rot_scale(layout.block_size))


def param_apply(codes: torch.Tensor, scales: torch.Tensor, layout, src: torch.Tensor, dst: torch.Tensor,
                new: Optional[torch.Tensor] = None, dst2: Optional[torch.Tensor] = None, swap: bool = False,
                blocks: Optional[tuple[int, int]] = None, isa: int = -1) -> tuple[float, float]:
    """Blocks ``blocks = (b0, b1)`` (default: all) of one gathered row applied to its shard:
    ``dst = cast(float(src) + D(codes, scales))``, bit-identical to
    :func:`.param_delta.add_delta` of :func:`.param_delta.decode_chunk` (``csrc/param_apply.h``).

    ``codes``: the row (uint8, its codes first; the scale bytes after them are not read);
    ``scales``: that row's fp32 ``[blocks]`` from :func:`.param_delta.row_scales` (zero
    for a row that is not finite); ``layout``: a :class:`.param_delta.DeltaLayout` (bits,
    block, options: the rotation is undone); ``src``/``dst``: the shard ``[S]`` (fp32,
    bf16 or fp16; the same tensor for another rank's shard, updated in place). The own
    shard passes ``new`` (the optimizer's values, ``[S]``, may be ``dst``) and ``dst2``
    (may be ``src``), which receives ``new`` with ``swap`` and the result without, and
    gets back ``(sum (result - new)^2, sum new^2)`` in float64 (else zeros)."""
    b0, b1 = blocks if blocks is not None else (0, layout.blocks)
    signs = _signs(layout.block_size, layout.options)
    empty = torch.empty(0)
    return tuple(extension().param_apply(codes, scales, b0, b1, layout.bits, layout.block_size, src, dst,
                                         empty if new is None else new, empty if dst2 is None else dst2,
                                         bool(swap), isa, empty if signs is None else signs,
                                         _rot_scale(layout.block_size)))


if __name__ == "__main__":  # the background build (start_background_build)
    import os
    import time

    # The training ranks beside it come first (the compilers inherit this); a process that
    # needs the kernels now raises it to its own priority while it waits (.build_lock).
    os.nice(10)
    t0 = time.monotonic()
    print(f"building LoCo's C++ CPU kernels in {build_directory()} with {pinned_ninja()[0]} "
          f"({built_mark().strip()})", flush=True)
    try:
        _build_with_torch(verbose=True, background=True)
    except Exception as e:  # recorded, so that later runs neither wait for nor retry it
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        (build_directory() / FAILED_MARK).write_text(f"{reason} (log: {build_directory() / 'build.log'})\n")
        raise
    print(f"built in {time.monotonic() - t0:.0f} s", flush=True)
