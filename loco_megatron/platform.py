"""Device/backend selection and the CPU compatibility layer for megatron-core.

One code path for CPU and GPU: on a CUDA host this module only picks NCCL and the
current CUDA device. On a host without CUDA, :func:`cpu_compat` is a context manager
that redirects the few places where megatron-core 0.16 hard-codes CUDA, so that the
*unmodified* library (its DDP buckets, distributed optimizer, schedules, TP/PP/EP
layers) trains over gloo:

* ``torch.cuda.current_device()`` -> the CPU device (megatron allocates the grad /
  param buffers on it);
* ``device='cuda'`` tensor factories and ``Tensor.cuda()`` / ``.to('cuda')`` -> CPU,
  through a :class:`torch.overrides.TorchFunctionMode`;
* ``Tensor.type()`` -> the ``torch.cuda.*Tensor`` names that the distributed optimizer
  compares against;
* ``torch.cuda`` Stream / Event / stream() / current_stream / default_stream /
  synchronize / nvtx -> torch.cpu stand-ins or no-ops;
* the CUDA RNG get/set used by megatron's RNG tracker -> the CPU generator (same
  semantics: fork/restore one global generator).

Two fixes apply on every host (:func:`megatron_fixes`):

* ``moe_utils.te_general_gemm`` is left undefined by megatron-core 0.16.1 when
  TransformerEngine is absent; it is defined as ``None`` (the library's own fallback).
* the MoE all-to-all token dispatcher passes numpy arrays as split sizes to
  ``torch.distributed.all_to_all_single``, which torch 2.13 rejects; they are turned
  into lists.

Everything patched is restored when the context exits.

Several ranks on one GPU (``benchmarks/gpu_check.sh``: a one-GPU check of multi-rank
training): :func:`gloo_on_one_gpu` puts every rank on ``cuda:0`` over gloo, which has no
CUDA implementation of some collectives that megatron-core and LoCo issue; under
:func:`platform_context` those run on host copies (:func:`gloo_cuda_staging`).

Over gloo (CPU, or ranks sharing a GPU), :func:`gloo_ragged_all_gather`: an all-gather of
outputs of different sizes, which megatron-core's layer-wise optimizer (--optimizer muon)
issues and gloo implements for equal sizes only.

Megatron-FSDP on CPU: :func:`megatron_fsdp_compat` while it is built, and
:func:`megatron_fsdp_staged_param_gather` on the built instance (its overlapped parameter
all-gathers, as on a GPU, each gloo gather working on memory only it holds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Platform", "detect_platform", "cpu_compat", "gloo_cuda_staging", "gloo_on_one_gpu", "gloo_ragged_all_gather",
           "megatron_fixes",
           "megatron_fsdp_compat", "megatron_fsdp_staged_param_gather", "platform_context"]


@dataclasses.dataclass(frozen=True)
class Platform:
    """Where this process computes and how it communicates."""

    device: torch.device
    """``cuda:<local_rank>`` on GPU hosts, ``cpu`` otherwise."""
    backend: str
    """torch.distributed backend: ``nccl`` on CUDA, ``gloo`` on CPU."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def detect_platform(local_rank: int, force_cpu: bool = False) -> Platform:
    """Pick the device and the backend for this rank."""
    if torch.cuda.is_available() and not force_cpu:
        return Platform(torch.device("cuda", local_rank), "nccl")
    return Platform(torch.device("cpu"), "gloo")


def gloo_on_one_gpu() -> Platform:
    """Every rank on ``cuda:0``, communicating over gloo (NCCL refuses two ranks on one
    device): the GPU's compute path - kernels, megatron-core on CUDA - with ranks that
    really exchange data, on a machine with one GPU."""
    return Platform(torch.device("cuda", 0), "gloo")


STAGED_COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather")
"""The ``torch.distributed`` collectives :func:`gloo_cuda_staging` runs on host copies: the
ones megatron-core and LoCo issue that gloo implements for CPU tensors only."""


class _Done:
    """The work handle of a collective that already completed (it ran synchronously)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _copy(x: Any) -> Any:
    """A host copy of a tensor (a copy even of a CPU one: the output is written back)."""
    return x.to("cpu", copy=True) if torch.is_tensor(x) else x


def _host_staged(collective: Callable, stage: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda) -> Callable:
    """``collective`` run on host copies when ``stage`` holds for any of its tensors (see
    :func:`gloo_cuda_staging`)."""
    def staged(*args, group=None, async_op=False, **kwargs):
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if torch.is_tensor(t)]
        if not any(stage(t) for t in tensors):
            return collective(*args, group=group, async_op=async_op, **kwargs)
        # Synchronous on host copies, then the outputs (the first argument) copied back;
        # an async caller gets a completed handle: program order is kept on every rank.
        host = [[_copy(x) for x in a] if isinstance(a, (list, tuple)) else _copy(a) for a in args]
        collective(*host, group=group, **kwargs)
        out, out_host = args[0], host[0]
        for dst, src in (zip(out, out_host) if isinstance(out, (list, tuple)) else [(out, out_host)]):
            dst.copy_(src)
        return _Done() if async_op else None

    return staged


@contextlib.contextmanager
def gloo_cuda_staging() -> Iterator[None]:
    """While active, :data:`STAGED_COLLECTIVES` given CUDA tensors run synchronously on
    host copies (the call's first argument is its output, copied back to the device);
    CPU tensors pass straight through. Patches ``torch.distributed`` and megatron-core's
    bucket collectives (module-level aliases of the same functions)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    with contextlib.ExitStack() as stack:
        for name in STAGED_COLLECTIVES:
            _patch(stack, torch.distributed, name, _host_staged(getattr(torch.distributed, name)))
        _patch(stack, pgb, "dist_reduce_scatter_func", torch.distributed.reduce_scatter_tensor)
        _patch(stack, pgb, "dist_all_gather_func", torch.distributed.all_gather_into_tensor)
        yield


def _ragged(all_gather: Callable) -> Callable:
    """``torch.distributed.all_gather`` that also takes outputs of different sizes (NCCL's
    all-gather-v, which megatron-core's layer-wise optimizer issues; gloo refuses it): each
    rank's input padded to the largest, gathered, and cut back. Every rank knows the sizes
    from its output list, so all pad alike; equal sizes pass straight through."""
    def gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.numel() for t in tensor_list]
        if len(set(sizes)) <= 1:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        n = max(sizes)
        padded = torch.zeros(n, dtype=tensor.dtype, device=tensor.device)
        padded[:tensor.numel()].copy_(tensor.reshape(-1))
        out = [torch.empty_like(padded) for _ in sizes]
        all_gather(out, padded, group=group)
        for dst, src, k in zip(tensor_list, out, sizes):
            dst.view(-1).copy_(src[:k])
        return _Done() if async_op else None

    return gather


@contextlib.contextmanager
def gloo_ragged_all_gather() -> Iterator[None]:
    """While active, ``torch.distributed.all_gather`` takes outputs of different sizes
    (:func:`_ragged`): gloo's lacks NCCL's all-gather-v."""
    with contextlib.ExitStack() as stack:
        _patch(stack, torch.distributed, "all_gather", _ragged(torch.distributed.all_gather))
        yield


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # megatron passes torch.cuda.current_device() (an int on GPU) as device.
    return isinstance(dev, int) and not isinstance(dev, bool)


_CPU_TYPE_TO_CUDA = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placement requests to CPU for every torch function call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's distributed optimizer dispatches on these strings.
            name = func(*args)
            return _CPU_TYPE_TO_CUDA.get(name, name)
        return func(*args, **kwargs)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


class _NoOpRange:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _patch(stack: contextlib.ExitStack, obj: Any, name: str, value: Any) -> None:
    """Set ``obj.name = value`` until ``stack`` closes."""
    missing = object()
    old = getattr(obj, name, missing)
    setattr(obj, name, value)
    if old is missing:
        stack.callback(delattr, obj, name)
    else:
        stack.callback(setattr, obj, name, old)


def _cpu_rng_get(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_rng_set(state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Let unmodified megatron-core run on a host without CUDA (see module doc)."""
    import megatron.core.fusions.fused_softmax as mcore_softmax
    import megatron.core.tensor_parallel.random as mcore_random

    cpu = torch.device("cpu")
    with contextlib.ExitStack() as stack:
        cuda = torch.cuda
        _patch(stack, cuda, "current_device", lambda: cpu)
        _patch(stack, cuda, "Stream", _CpuStream)
        _patch(stack, cuda, "Event", _WallClockEvent)
        _patch(stack, cuda, "stream", torch.cpu.stream)
        _patch(stack, cuda, "current_stream", _CpuStream.current)
        _patch(stack, cuda, "default_stream", _CpuStream.current)
        _patch(stack, cuda, "synchronize", lambda *a, **k: None)
        _patch(stack, cuda, "get_rng_state", _cpu_rng_get)
        _patch(stack, cuda, "set_rng_state", _cpu_rng_set)
        _patch(stack, cuda, "manual_seed", _cpu_manual_seed)
        _patch(stack, cuda.nvtx, "range_push", lambda *a, **k: None)
        _patch(stack, cuda.nvtx, "range_pop", lambda *a, **k: None)
        _patch(stack, cuda.nvtx, "range", lambda *a, **k: _NoOpRange())
        _patch(stack, mcore_random, "_get_cuda_rng_state", _cpu_rng_get)
        _patch(stack, mcore_random, "_set_cuda_rng_state", _cpu_rng_set)
        # A torch-function mode is off while it handles a call, and backward is one call:
        # activation recomputation re-runs attention (its device='cuda' causal mask) there.
        _patch(stack, mcore_softmax, "get_default_causal_mask", _cpu_causal_mask)
        stack.enter_context(_CudaToCpuMode())
        yield


class _CpuStream(torch.cpu.Stream):
    """``torch.cuda.Stream`` stand-in: CPU work is ordered, so waits are no-ops and
    ``record_event`` returns an event (torch.cpu.Stream's returns None)."""

    _CURRENT = None

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or _WallClockEvent()
        event.record()
        return event

    def synchronize(self) -> None:
        pass

    @classmethod
    def current(cls, device=None) -> "_CpuStream":
        # One shared instance so megatron's ``current_stream() != side_stream`` tests work.
        if cls._CURRENT is None:
            cls._CURRENT = cls()
        return cls._CURRENT


class _WallClockEvent:
    """Stand-in for ``torch.cuda.Event`` on CPU: records wall-clock time."""

    def __init__(self, enable_timing: bool = False, **kwargs):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end: "_WallClockEvent") -> float:
        return (end._t - self._t) * 1000.0


def _splits_as_lists(all_to_all: Callable) -> Callable:
    def all_to_all_with_list_splits(group, input_, output_split_sizes_=None, input_split_sizes=None):
        def as_list(s):
            return s.tolist() if hasattr(s, "tolist") else s

        return all_to_all(group, input_, as_list(output_split_sizes_), as_list(input_split_sizes))

    return all_to_all_with_list_splits


@contextlib.contextmanager
def megatron_fixes() -> Iterator[None]:
    """Fixes for megatron-core 0.16.1 bugs that hit every host (see module doc)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    with contextlib.ExitStack() as stack:
        if not hasattr(moe_utils, "te_general_gemm"):
            _patch(stack, moe_utils, "te_general_gemm", None)
        _patch(stack, token_dispatcher, "all_to_all", _splits_as_lists(token_dispatcher.all_to_all))
        yield


@contextlib.contextmanager
def megatron_fsdp_compat(device: torch.device) -> Iterator[None]:
    """While Megatron-FSDP is built on CPU: ``torch.cuda.current_device()`` answers 0, as on
    a GPU host, because its constructor formats ``f"cuda:{torch.cuda.current_device()}"``
    (the CPU device there is no valid device string). Nothing else changes; on CUDA a no-op."""
    with contextlib.ExitStack() as stack:
        if device.type != "cuda":
            _patch(stack, torch.cuda, "current_device", lambda: 0)
        yield


def megatron_fsdp_staged_param_gather(fsdp: Any, device: torch.device) -> None:
    """On CPU, this Megatron-FSDP model's (``fsdp``: megatron's ``FullyShardedDataParallel``)
    parameter all-gathers stay overlapped as on a GPU - issued asynchronously (coalesced per
    bucket group, prefetched), waited for in its forward / backward pre-hooks - with each gloo
    gather staged: it reads a copy of the shard and writes a tensor only it holds, copied into
    megatron's bucket when megatron waits for that bucket. On CUDA a no-op.

    Why: under gloo a collective runs on the process group's worker threads while the host
    goes on. Unstaged, the gather writes megatron's bucket (storage megatron resizes to 0 when
    it releases the bucket, whose views are the layer's parameters) and reads its live
    weight shard from another thread; staged, no worker thread touches memory megatron
    owns, and megatron sees the gathered values after its own wait, as on a GPU. The cost
    on CPU: one copy of each gathered bucket and of each shard in flight (docs/fsdp.md)."""
    if device.type == "cuda":
        return
    from loco_megatron.loco.hooks.version import check_megatron_core_version

    check_megatron_core_version()  # megatron's all-gather pipeline internals, as the hooks' checks
    pipeline = fsdp.module.all_gather_pipeline
    issue, wait = pipeline.async_bucket_gather, pipeline.wait_bucket_ready
    all_gather = torch.distributed.all_gather_into_tensor
    staged: dict = {}  # bucket key -> (megatron's bucket, the tensor its gather writes)

    def async_bucket_gather(bucket_id, bwd):
        key = pipeline.get_bucket_key(bucket_id, bwd)

        def gather_staged(output_tensor, input_tensor, group=None, async_op=False):
            stage = torch.empty_like(output_tensor)
            staged[key] = (output_tensor, stage)
            return all_gather(stage, input_tensor.clone(), group=group, async_op=async_op)

        with contextlib.ExitStack() as stack:  # megatron's one all-gather call in this method
            _patch(stack, torch.distributed, "all_gather_into_tensor", gather_staged)
            return issue(bucket_id, bwd)

    def wait_bucket_ready(bucket_id, bwd, empty_ok=False):
        ready = wait(bucket_id, bwd, empty_ok)
        pair = staged.pop(pipeline.get_bucket_key(bucket_id, bwd), None)
        if pair is not None:  # the gather has completed: megatron's wait returned
            pair[0].copy_(pair[1])
        return ready

    pipeline.async_bucket_gather = async_bucket_gather
    pipeline.wait_bucket_ready = wait_bucket_ready


@contextlib.contextmanager
def platform_context(platform: Platform) -> Iterator[None]:
    """Everything megatron-core needs on this platform, for the duration of a run."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(megatron_fixes())
        if platform.is_cuda:
            torch.cuda.set_device(platform.device)
            if platform.backend == "gloo":
                stack.enter_context(gloo_cuda_staging())
        else:
            stack.enter_context(cpu_compat())
        if platform.backend == "gloo":
            stack.enter_context(gloo_ragged_all_gather())
        yield
