"""Parallel layout settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from loco_megatron.config.base import require

FSDP_SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-FSDP's --data-parallel-sharding-strategy values."""


@dataclasses.dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks per model replica."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages per model replica."""
    expert_model_parallel_size: int = 1
    """Expert-parallel ranks (MoE experts are split across them)."""
    expert_tensor_parallel_size: Optional[int] = None
    """Tensor-parallel ranks of each expert (None = --tensor-model-parallel-size). MoE parallel
    folding: the expert layers get their own TP x EP x DP grid over the same ranks, so
    e.g. ETP 1 lets the dense TP ranks hold different experts instead of expert slices."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state and main params across data-parallel ranks (ZeRO-1)."""
    overlap_grad_reduce: bool = True
    """Launch each gradient bucket's reduce-scatter as soon as its grads are ready."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather updated params bucket by bucket during
    the next forward pass instead of synchronously after the optimizer step."""
    grad_reduce_in_bf16: bool = False
    """Keep gradient buffers and their reduce-scatter in bf16."""
    ddp_bucket_size: Optional[int] = None
    """Elements per gradient bucket (None = megatron-core's default)."""
    sequence_parallel: bool = False
    """Split layer norms, dropout and residuals along the sequence across the TP ranks
    (Megatron's sequence parallelism; needs --tensor-model-parallel-size > 1)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank (interleaved 1F1B schedule; needs PP > 1)."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per model chunk; sets --virtual-pipeline-model-parallel-size to
    num_layers / PP / this."""
    use_megatron_fsdp: bool = False
    """Fully sharded data parallelism with megatron-core's Megatron-FSDP
    (``FullyShardedDataParallel``) instead of its DDP; needs the distributed optimizer."""
    data_parallel_sharding_strategy: str = "optim_grads_params"
    """With --use-megatron-fsdp, what is sharded over the data-parallel (within a node, under
    HSDP) ranks: optim (ZeRO-1), optim_grads (ZeRO-2) or optim_grads_params (ZeRO-3; the default
    here, Megatron-LM's is no_shard, which megatron-core 0.16.1's Megatron-FSDP cannot train:
    refused)."""
    num_distributed_optimizer_instances: int = 1
    """With --use-megatron-fsdp: > 1 is HSDP, the model sharded inside each of this many
    groups of data-parallel ranks and replicated across them; it must be the number of nodes
    (--loco-ranks-per-node ranks each), so only the replica reduction crosses nodes."""
    context_parallel_size: int = 1
    """Context-parallel ranks (split each sequence across ranks). Only 1: megatron-core 0.16
    implements it in TransformerEngine's attention only."""

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect (megatron's default: the dense TP size)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size"):
            require(getattr(self, name) >= 1, name, "must be >= 1")
        if self.expert_tensor_parallel_size is not None:
            require(self.expert_tensor_parallel_size >= 1, "expert_tensor_parallel_size", "must be >= 1")
        if self.ddp_bucket_size is not None:
            require(self.ddp_bucket_size > 0, "ddp_bucket_size", "must be positive")
        if self.overlap_param_gather:
            require(self.use_distributed_optimizer, "overlap_param_gather", "needs the distributed optimizer")
        require(not self.sequence_parallel or self.tensor_model_parallel_size > 1, "sequence_parallel",
                 "needs --tensor-model-parallel-size > 1")
        require(self.data_parallel_sharding_strategy in FSDP_SHARDING, "data_parallel_sharding_strategy",
                 f"{self.data_parallel_sharding_strategy!r} is not one of {', '.join(FSDP_SHARDING)}")
        require(self.num_distributed_optimizer_instances >= 1, "num_distributed_optimizer_instances", "must be >= 1")
        if self.num_distributed_optimizer_instances > 1:
            require(self.use_megatron_fsdp, "num_distributed_optimizer_instances", "needs --use-megatron-fsdp")
        if self.use_megatron_fsdp:
            require(self.use_distributed_optimizer, "use_megatron_fsdp", "needs --use-distributed-optimizer")
            for name, why in (("pipeline_model_parallel_size", "pipeline parallelism"),
                              ("tensor_model_parallel_size", "tensor parallelism"),
                              ("expert_model_parallel_size", "expert parallelism")):
                require(getattr(self, name) == 1, "use_megatron_fsdp",
                         f"{why} (--{name.replace('_', '-')} > 1) is not supported with it in loco-megatron")
            require(not self.overlap_param_gather, "use_megatron_fsdp",
                     "--overlap-param-gather is the DDP path's; Megatron-FSDP gathers layer by layer itself")
            # megatron-core 0.16.1 (docs/fsdp.md): no_shard fails at its first optimizer step
            # (start_param_sync gathers a weight buffer no_shard does not build; under HSDP the
            # optimizer's DTensors carry one placement for a 2-D mesh).
            require(self.data_parallel_sharding_strategy != "no_shard", "data_parallel_sharding_strategy",
                     "no_shard does not train under megatron-core 0.16.1's Megatron-FSDP (its first optimizer "
                     "step fails); use optim (unsharded weights and gradients) or leave out --use-megatron-fsdp")
            require(self.overlap_grad_reduce, "overlap_grad_reduce",
                     "is needed with --use-megatron-fsdp: Megatron-FSDP reduces gradients in its backward hooks "
                     "(megatron-core 0.16.1 ignores --no-overlap-grad-reduce for optim_grads(_params) and with "
                     "optim reduces the gradients a second time after the backward)")
        require(self.context_parallel_size == 1, "context_parallel_size",
                 "is not supported: megatron-core 0.16 implements context parallelism only in TransformerEngine's "
                 "attention, and loco-megatron does not split the batches' sequences across CP ranks")
        require(self.virtual_pipeline_model_parallel_size is None
                 or self.num_layers_per_virtual_pipeline_stage is None, "num_layers_per_virtual_pipeline_stage",
                 "give either it or --virtual-pipeline-model-parallel-size, not both")
        for name in ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"):
            if getattr(self, name) is not None:
                require(getattr(self, name) >= 1, name, "must be >= 1")
                require(self.pipeline_model_parallel_size > 1, name, "needs --pipeline-model-parallel-size > 1")
