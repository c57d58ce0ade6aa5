"""Checkpointable views of the model, the optimizer and the trainer's counters."""

from __future__ import annotations

import dataclasses

import torch

from loco_megatron.optimizer import sub_optimizers


class ModelState:
    def __init__(self, chunks: list):
        self.chunks = chunks

    def state_dict(self) -> list:
        return [c.state_dict() for c in self.chunks]

    def load_state_dict(self, sd: list) -> None:
        for chunk, chunk_sd in zip(self.chunks, sd):
            chunk.load_state_dict(chunk_sd, strict=True)

    def _keys(self) -> list[str]:
        return ["model"] if len(self.chunks) == 1 else [f"model{i}" for i in range(len(self.chunks))]

    def sharded_state_dict(self) -> dict:
        """torch_dist: ``{"model": gpt.sharded_state_dict()}`` (``model0``, ``model1``, ... per
        virtual stage) of the GPTModel inside each DDP wrapper (megatron-LM's keys, e.g.
        ``decoder.layers.0.mlp.linear_fc1.weight``): ShardedTensors in global (TP/PP-independent)
        coordinates."""
        return {key: chunk.module.sharded_state_dict() for key, chunk in zip(self._keys(), self.chunks)}

    def load_sharded_state_dict(self, loaded: dict) -> None:
        for key, chunk in zip(self._keys(), self.chunks):
            chunk.module.load_state_dict(loaded[key], strict=True)


class OptimizerState:
    """Per-rank optimizer state: for the distributed optimizer, this rank's shard of the
    fp32 main params and Adam moments (megatron's "dp_reshardable" representation); for
    --optimizer muon, each sub-optimizer's own (megatron's Float16/FP32 wrappers: the state
    of the parameters this rank owns, in their order)."""

    def __init__(self, optimizer):
        from loco_megatron.optimizer.layer_wise import owned

        self.optimizer = optimizer
        self._layer_wise = owned(optimizer) is not None

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

    def sharded_state_dict(self, model_sd: dict, is_loading: bool) -> dict:
        """torch_dist: per sub-optimizer, the distributed optimizer's state in model space
        (see :mod:`loco_megatron.checkpoint.dist_optimizer`), or megatron's own sharded
        state for the non-distributed optimizers; --optimizer muon's layer-wise optimizer
        in model space too (:mod:`loco_megatron.checkpoint.layer_wise`)."""
        from loco_megatron.checkpoint import dist_optimizer, layer_wise

        if self._layer_wise:
            return layer_wise.sharded_state_dict(self.optimizer, model_sd, is_loading)
        out = {}
        for i, opt in enumerate(sub_optimizers(self.optimizer)):
            if hasattr(opt, "get_parameter_state_dp_zero"):
                out[i] = dist_optimizer.sharded_state_dict(opt, model_sd, is_loading)
            else:
                out[i] = opt.sharded_state_dict(model_sd, is_loading)
        return out

    @torch.no_grad()  # megatron copies into views of leaf params
    def load_state_dict(self, sd) -> None:
        """``sd``: this class's per-rank list (torch format), or the loaded sharded state (torch_dist)."""
        from loco_megatron.checkpoint import dist_optimizer, layer_wise

        if self._layer_wise and not isinstance(sd, list):
            return layer_wise.load_state_dict(self.optimizer, sd)
        for i, opt in enumerate(sub_optimizers(self.optimizer)):
            if isinstance(sd, list):
                opt.load_state_dict(sd[i]["optimizer"])
                if sd[i]["params"] is not None:
                    opt.load_parameter_state_from_dp_reshardable(sd[i]["params"])
            elif hasattr(opt, "get_parameter_state_dp_zero"):
                dist_optimizer.load_state_dict(opt, sd[i])
            else:
                opt.load_state_dict(sd[i])
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


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (Megatron-FSDP) DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class FsdpModelState:
    """Megatron-FSDP's model for --ckpt-format torch: nothing of its own. Its weights are
    the distributed optimizer's main parameters (saved by :class:`FsdpOptimizerState`,
    which copies them into the model's weight buffer on load)."""

    def __init__(self, chunks: list):
        self.chunks = chunks

    def state_dict(self) -> list:
        return []

    def load_state_dict(self, sd: list) -> None:
        pass


class FsdpOptimizerState:
    """Megatron-FSDP's distributed optimizer for --ckpt-format torch: per sub-optimizer, the
    param groups' hyper-parameters and, per parameter (in param-group order), the local
    parts of its fp32 main weight and Adam state.

    :meth:`state_dict` hands out detached views of the live tensors, never a copy on the
    device: the torch format serialises them at once (``torch.save`` copies one storage at a
    time to the host), before training goes on."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> list:
        out = []
        for opt in sub_optimizers(self.optimizer):
            inner = opt.optimizer
            params = [p for g in inner.param_groups for p in g["params"]]
            state = [{k: _local(v).detach() if torch.is_tensor(v) else v
                      for k, v in inner.state.get(p, {}).items()} for p in params]
            groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
            out.append({"groups": groups, "params": [_local(p).detach() for p in params], "state": state})
        return out

    @torch.no_grad()
    def load_state_dict(self, sd) -> None:
        """``sd``: this class's per-rank list (torch format), or, --ckpt-format fsdp_dtensor,
        ``{"0": megatron's fsdp_dtensor optimizer state}`` per sub-optimizer, whose DTensors
        DCP already filled in place (:mod:`loco_megatron.checkpoint.fsdp_dtensor`)."""
        if isinstance(sd, dict):
            for i, opt in enumerate(sub_optimizers(self.optimizer)):
                opt.load_state_dict(sd[str(i)])  # param groups by parameter name, the Adam state
                for chunk in opt.model_chunks:  # the loaded main weights -> the weights the forward gathers
                    chunk.module.install_optimized_model_weights()
            return
        for opt, saved in zip(sub_optimizers(self.optimizer), sd):
            inner = opt.optimizer
            for group, hyper in zip(inner.param_groups, saved["groups"]):
                group.update(hyper)
            params = [p for g in inner.param_groups for p in g["params"]]
            assert len(params) == len(saved["params"]), "Megatron-FSDP checkpoint of another optimizer"
            for p, value, state in zip(params, saved["params"], saved["state"]):
                _local(p).copy_(value)
                restored = {}
                for k, v in state.items():
                    if torch.is_tensor(v) and k != "step":
                        restored[k] = torch.zeros_like(p)  # a DTensor laid out as the param
                        _local(restored[k]).copy_(v)
                    else:
                        restored[k] = v.clone() if torch.is_tensor(v) else v
                if restored:
                    inner.state[p] = restored
            for chunk in opt.model_chunks:  # main weights -> the weights the forward gathers
                chunk.module.install_optimized_model_weights()
