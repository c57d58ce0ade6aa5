"""Checkpointable views of the model, the optimizer and the trainer's counters."""

from __future__ import annotations

import dataclasses

import torch


def sub_optimizers(optimizer) -> list:
    """megatron returns a ChainedOptimizer (dense + expert) or a single optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


class ModelState:
    def __init__(self, chunks: list):
        self.chunks = chunks

    def state_dict(self) -> list:
        return [c.state_dict() for c in self.chunks]

    def load_state_dict(self, sd: list) -> None:
        for chunk, chunk_sd in zip(self.chunks, sd):
            chunk.load_state_dict(chunk_sd, strict=True)


class OptimizerState:
    """Per-rank optimizer state: for the distributed optimizer, this rank's shard of the
    fp32 main params and Adam moments (megatron's "dp_reshardable" representation)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> list:
        out = []
        for opt in sub_optimizers(self.optimizer):
            params = None
            if hasattr(opt, "get_parameter_state_dp_reshardable"):
                params = opt.get_parameter_state_dp_reshardable()
                for key, per_dtype in params.items():
                    if isinstance(key, int):
                        for buckets in per_dtype.values():
                            for bucket in buckets:
                                for elem in bucket:
                                    elem["padding"] = False
            out.append({"optimizer": opt.state_dict(), "params": params})
        return out

    @torch.no_grad()  # megatron copies into views of leaf params
    def load_state_dict(self, sd: list) -> None:
        for opt, opt_sd in zip(sub_optimizers(self.optimizer), sd):
            opt.load_state_dict(opt_sd["optimizer"])
            if opt_sd["params"] is not None:
                opt.load_parameter_state_from_dp_reshardable(opt_sd["params"])
            # megatron-core 0.16's DistributedOptimizer.load_state_dict gives every param
            # the *same* 'step' tensor; torch's foreach Adam then increments it once per
            # param per step, corrupting bias correction after a resume. Un-alias it.
            inner = getattr(opt, "optimizer", None)
            for param_state in (inner.state.values() if inner is not None else ()):
                if torch.is_tensor(param_state.get("step")):
                    param_state["step"] = param_state["step"].clone()


@dataclasses.dataclass
class TrainerState:
    iteration: int = 0
    """Optimizer steps completed (skipped ones included)."""
    skipped_iters: int = 0
    """Steps skipped because a gradient was NaN/Inf."""
    tokens_seen: int = 0
    """Training tokens consumed so far (all ranks)."""
    train_time_s: float = 0.0
    """Wall-clock seconds spent in training steps so far."""

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            setattr(self, k, v)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak on GPU, peak process RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
