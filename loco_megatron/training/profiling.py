"""``--profile``: a torch.profiler trace (Chrome/Perfetto JSON) of a window of steps on
chosen ranks, with named ranges for the phases of a step.

Ranges (also NVTX ranges on CUDA, for Nsight Systems):

* ``forward`` / ``backward`` / ``forward-backward`` and megatron's pipeline send/recv:
  megatron-core's schedules report these phases to ``TransformerConfig.timers``; the
  profiler installs a timers object that opens a range per phase;
* ``loco/compress``, ``loco/decompress``: around LoCo's compressors and the decompress
  of every received shard;
* ``grad_sync/launch``, ``grad_sync/wait``: each bucket group's gradient collective
  launch and the wait for it (the collectives themselves appear as ``gloo:``/``nccl:``
  events inside);
* ``param_gather``: the distributed (or layer-wise) optimizer's parameter all-gather;
* ``muon/newton_schulz``: each orthogonalisation of --optimizer muon (with its TP gather);
* ``optimizer_step``: the optimizer step.

Nothing is wrapped on ranks that are not profiled.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib

import torch

from loco_megatron.config import LoggingConfig

MEGATRON_PHASES = {"forward-compute": "forward", "backward-compute": "backward",
                   "all-grads-sync": "grad_sync/finalize"}
"""megatron-core timer names -> range names (others keep megatron's name)."""


class _Range:
    def __init__(self, name: str, nvtx: bool):
        self.name, self.nvtx, self._rf = name, nvtx, None

    def __enter__(self):
        self._rf = torch.autograd.profiler.record_function(self.name)
        self._rf.__enter__()
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc):
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self._rf.__exit__(None, None, None)


class _PhaseTimer:
    """What megatron's schedules call ``.start()`` / ``.stop()`` on."""

    def __init__(self, name: str, nvtx: bool):
        self._range, self._open = _Range(MEGATRON_PHASES.get(name, name), nvtx), False

    def start(self, barrier: bool = False):
        self._range.__enter__()
        self._open = True

    def stop(self, barrier: bool = False):
        if self._open:
            self._range.__exit__(None, None, None)
            self._open = False


class _PhaseTimers:
    """Stands in for megatron's ``Timers``: ``timers(name, log_level=...)``."""

    def __init__(self, nvtx: bool):
        self.nvtx, self._timers = nvtx, {}

    def __call__(self, name: str, log_level=None) -> _PhaseTimer:
        if name not in self._timers:
            self._timers[name] = _PhaseTimer(name, self.nvtx)
        return self._timers[name]


def _wrap(obj, attr: str, name: str, nvtx: bool) -> None:
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _Range(name, nvtx):
            return fn(*args, **kwargs)

    setattr(obj, attr, wrapped)


class Profiler:
    """Profiles iterations [start, end] (1-based) on the chosen ranks."""

    def __init__(self, cfg: LoggingConfig, rank: int, device: torch.device):
        self.active = cfg.profile and rank in cfg.profiled_ranks()
        self.start, self.end = cfg.profile_step_start, cfg.profile_step_end
        self.path = pathlib.Path(cfg.profile_dir) / f"trace_rank{rank}.json"
        self.nvtx = device.type == "cuda"
        self._cuda = device.type == "cuda"
        self._prof = None

    def ranges(self, name: str):
        """A named range (no-op when this rank is not profiled)."""
        return _Range(name, self.nvtx) if self.active else contextlib.nullcontext()

    def instrument(self, chunks: list, grad_sync, optimizer=None) -> None:
        """Install the ranges around megatron's phases, LoCo, the collectives and (Muon) the
        Newton-Schulz iterations."""
        if not self.active:
            return
        chunks[0].config.timers = _PhaseTimers(self.nvtx)  # megatron's phase timers (public config)
        for part in (grad_sync, optimizer):  # LoCo and the bucket groups' sync via the hook; Muon's
            if hasattr(part, "instrument"):
                part.instrument(lambda obj, attr, name: _wrap(obj, attr, name, self.nvtx))

    def before_step(self, iteration: int) -> None:
        """``iteration``: the 1-based number of the step about to run."""
        if self.active and iteration == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()

    def after_step(self, iteration: int) -> None:
        if self._prof is not None and iteration >= self.end:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the run ends inside the window)."""
        if self._prof is None:
            return
        self._prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.path))
        self._prof = None
        print(f"profile: wrote {self.path}", flush=True)
