#!/usr/bin/env python3
"""How long a first build of LoCo's C++ CPU kernels takes: from an empty extensions folder
(a fresh ``TORCH_EXTENSIONS_DIR`` in a temporary folder, removed afterwards), at normal
priority, with torch's ninja build as a run uses it (the pinned ninja, ``MAX_JOBS`` as set,
else ninja's default). Prints the wall seconds and the compilers' CPU seconds.

The figure the docs quote is a quiet machine's: the script refuses to measure (exit 2)
when the 1-minute load average is above ``--max-load-per-core`` (0.5) per core or when it
runs niced. ``--busy-ok`` measures anyway and labels the figure as not a quiet machine's.

    python benchmarks/first_build.py
    nice -n 5 python benchmarks/first_build.py --busy-ok   # checks the script, not a figure to quote
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def cores() -> int:
    """CPUs this process may run on (its affinity; all of them where that is unknown)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def why_busy(load: float, n_cores: int, nice: int, max_per_core: float) -> str | None:
    """Why this is not a quiet machine at normal priority (each reason, one line), or None."""
    why = []
    if nice > 0:
        why.append(f"this process runs at nice {nice}, the figure is for normal priority (nice 0)")
    if load > max_per_core * n_cores:
        why.append(f"the load average is {load:.2f} on {n_cores} cores, above {max_per_core} per core, "
                   f"the figure is for a quiet machine")
    return "; ".join(why) or None


def compilers_cpu_s() -> float:
    """User + system seconds of this process's finished children (ninja and every compiler
    it ran: each waited for by its parent)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-load-per-core", type=float, default=0.5,
                    help="refuse above this 1-minute load average per core (default 0.5)")
    ap.add_argument("--busy-ok", action="store_true",
                    help="measure on a busy machine or niced anyway (the figure is labelled as such)")
    args = ap.parse_args()
    load, n_cores, nice = os.getloadavg()[0], cores(), os.getpriority(os.PRIO_PROCESS, 0)
    busy = why_busy(load, n_cores, nice, args.max_load_per_core)
    if busy and not args.busy_ok:
        print(f"first_build.py: error: {busy}; run it on a quiet machine at normal priority, "
              f"or pass --busy-ok to measure anyway", file=sys.stderr)
        return 2
    if busy:
        print(f"WARNING: NOT A QUIET-MACHINE FIGURE: {busy}. Do not quote the seconds below.",
              file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="loco_first_build_") as root:
        # Read by torch at each build; set before cpu_kernels names its build folder.
        os.environ["TORCH_EXTENSIONS_DIR"] = root
        from loco_megatron.loco import cpu_kernels

        assert cpu_kernels.needs_build() and not any(cpu_kernels.build_directory().iterdir())
        jobs = os.environ.get("MAX_JOBS", "unset (ninja's default)")
        print(f"building LoCo's C++ CPU kernels in {cpu_kernels.build_directory()} (empty), MAX_JOBS {jobs}, "
              f"{cpu_kernels.built_mark().strip()} ({cpu_kernels.pinned_ninja()[0]})", flush=True)
        cpu0, t0 = compilers_cpu_s(), time.monotonic()
        built = cpu_kernels.extension()
        wall, cpu = time.monotonic() - t0, compilers_cpu_s() - cpu0
        if built is None:
            print("first_build.py: error: the build failed (see the line above)", file=sys.stderr)
            return 1
    label = f" (NOT A QUIET-MACHINE FIGURE: {busy})" if busy else ""
    print(f"first build of the C++ CPU kernels: {wall:.0f} s wall, {cpu:.0f} s CPU in the compilers, "
          f"on {n_cores} cores at nice {nice}, load average {load:.2f} before it{label}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
