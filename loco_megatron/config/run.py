"""The whole run settings (see :mod:`loco_megatron.config`)."""

from __future__ import annotations

import dataclasses

from loco_megatron.config.base import ConfigError, require
from loco_megatron.config.model import ModelConfig
from loco_megatron.config.parallel import ParallelConfig
from loco_megatron.config.data import DataConfig
from loco_megatron.config.optimizer import OptimizerConfig, default_lr
from loco_megatron.config.train import TrainConfig
from loco_megatron.config.loco import LoCoConfig
from loco_megatron.config.diloco import DiLoCoConfig
from loco_megatron.config.checkpoint import CheckpointConfig
from loco_megatron.config.logger import LoggingConfig


@dataclasses.dataclass
class Config:
    """The whole run. Cross-field checks that do not need the world size live here."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    loco: LoCoConfig = dataclasses.field(default_factory=LoCoConfig)
    diloco: DiLoCoConfig = dataclasses.field(default_factory=DiLoCoConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    command_line: tuple[str, ...] = ()
    """Names of the options given on the command line (not from the --config file or the
    defaults); not a flag. On a resume they decide whose LR-schedule value wins (see
    :mod:`loco_megatron.training.schedule`)."""

    def __post_init__(self):
        m, p = self.model, self.parallel
        # --lr's and Muon's factor's defaults depend on the optimizer and on DiLoCo (the sweeps of
        # docs/benchmarks.md, section 13), so the whole Config resolves them.
        o = self.optimizer
        lr, factor = default_lr(o.optimizer, self.diloco.enabled)
        if o.muon_extra_scale_factor is None:
            o.muon_extra_scale_factor = factor
        if o.lr is None:
            o.lr = lr
            require(o.min_lr <= o.lr, "min_lr", f"must be in [0, --lr] (--lr's default here: {o.lr:g})")
        heads = m.num_attention_heads
        require(heads % p.tensor_model_parallel_size == 0, "num_attention_heads",
                 f"{heads} is not divisible by --tensor-model-parallel-size {p.tensor_model_parallel_size}")
        groups = m.num_query_groups or heads
        require(groups % p.tensor_model_parallel_size == 0, "num_query_groups",
                 f"{groups} is not divisible by --tensor-model-parallel-size {p.tensor_model_parallel_size}")
        require(m.num_layers % p.pipeline_model_parallel_size == 0, "num_layers",
                 f"{m.num_layers} is not divisible by --pipeline-model-parallel-size "
                 f"{p.pipeline_model_parallel_size}")
        if p.expert_model_parallel_size > 1:
            require(m.num_experts is not None, "expert_model_parallel_size", "needs --num-experts")
        if p.expert_tensor_parallel_size is not None:
            require(m.num_experts is not None, "expert_tensor_parallel_size", "needs --num-experts")
        if m.num_experts is not None:
            require(m.num_experts % p.expert_model_parallel_size == 0, "num_experts",
                     f"{m.num_experts} is not divisible by --expert-model-parallel-size "
                     f"{p.expert_model_parallel_size}")
            expert_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
            require(expert_ffn % p.expert_tp == 0, "moe_ffn_hidden_size",
                     f"{expert_ffn} is not divisible by the expert tensor-parallel size {p.expert_tp}")
            # megatron-core asserts this in TransformerConfig (no-SwiGLU MLPs have biases).
            require(m.swiglu or p.expert_tp == 1, "expert_tensor_parallel_size",
                     f"is {p.expert_tp}: megatron-core supports biased (--no-swiglu) experts only with 1")
            # megatron-core 0.16.1 marks expert parameters as such (allreduce=False, reduced over
            # the expert data-parallel group) only when EP > 1; with EP 1 they join the dense
            # buckets and are reduced over the dense DP group, so with ETP < TP the TP ranks'
            # copies of each expert (fed different tokens) drift apart (tested: they differ
            # after 3 steps at TP 2, ETP 1, EP 1, with and without LoCo).
            require(p.expert_model_parallel_size > 1 or p.expert_tp == p.tensor_model_parallel_size,
                     "expert_tensor_parallel_size",
                     f"{p.expert_tp} differs from --tensor-model-parallel-size {p.tensor_model_parallel_size} with "
                     "--expert-model-parallel-size 1: megatron-core then syncs expert gradients over the dense "
                     "data-parallel group only; use EP > 1 or ETP = TP")
            # Megatron-LM's rule: the all-to-all dispatcher splits each TP rank's tokens, which
            # are the TP group's common tokens unless the sequence is split over TP.
            require(p.expert_model_parallel_size == 1 or p.tensor_model_parallel_size == 1 or p.sequence_parallel,
                     "sequence_parallel", "is required with expert parallelism and tensor parallelism together")
        if p.grad_reduce_in_bf16:
            require(m.bf16, "grad_reduce_in_bf16", "needs --bf16")
        if self.optimizer.optimizer == "muon":
            self._check_muon()
        if self.loco.param_gather_bits:
            require(p.use_distributed_optimizer, "param_gather_bits", "needs --use-distributed-optimizer")
        if p.use_megatron_fsdp:
            self._check_fsdp()
        if self.diloco.enabled:
            self._check_diloco()
        require(self.checkpoint.ckpt_format != "fsdp_dtensor" or p.use_megatron_fsdp, "ckpt_format",
                 "fsdp_dtensor is Megatron-FSDP's format and needs --use-megatron-fsdp (use torch_dist)")
        decay = self.optimizer.lr_decay_iters or self.train.train_iters
        require(self.optimizer.warmup_iters(decay) < decay, "lr_warmup_iters",
                 f"{self.optimizer.lr_warmup_iters} must be less than the decay iterations ({decay}); "
                 "--lr-warmup-fraction scales with the run")
        if p.num_layers_per_virtual_pipeline_stage is not None:
            per_stage = m.num_layers // p.pipeline_model_parallel_size
            require(per_stage % p.num_layers_per_virtual_pipeline_stage == 0,
                     "num_layers_per_virtual_pipeline_stage",
                     f"{p.num_layers_per_virtual_pipeline_stage} does not divide the {per_stage} layers per stage")
            p.virtual_pipeline_model_parallel_size = per_stage // p.num_layers_per_virtual_pipeline_stage
            p.num_layers_per_virtual_pipeline_stage = None
        if p.virtual_pipeline_model_parallel_size is not None:
            vp = p.virtual_pipeline_model_parallel_size
            require(m.num_layers % (p.pipeline_model_parallel_size * vp) == 0,
                     "virtual_pipeline_model_parallel_size",
                     f"--num-layers {m.num_layers} is not divisible by PP x VP = "
                     f"{p.pipeline_model_parallel_size} x {vp}")
        if m.recompute_num_layers is not None:
            per_chunk = m.num_layers // p.pipeline_model_parallel_size // (p.virtual_pipeline_model_parallel_size or 1)
            require(m.recompute_num_layers <= per_chunk, "recompute_num_layers",
                     f"{m.recompute_num_layers} exceeds the {per_chunk} layers per model chunk")

    def _check_fsdp(self) -> None:
        """What --use-megatron-fsdp does not combine with (see docs/fsdp.md)."""
        lc = self.loco
        require(self.model.num_experts is None, "use_megatron_fsdp", "MoE (--num-experts) is not supported with it")
        require(not lc.param_gather_bits, "param_gather_bits",
                 "is the distributed optimizer's all-gather; with --use-megatron-fsdp parameters are "
                 "gathered layer by layer at their dtype")
        require(not lc.loco_hierarchical, "loco_hierarchical",
                 "two-hop LoCo is the DDP path's; with --use-megatron-fsdp the two hops are HSDP's "
                 "(--num-distributed-optimizer-instances = nodes)")
        c = self.checkpoint
        require(c.ckpt_format != "torch_dist" or not (c.save or c.load), "ckpt_format",
                 "torch_dist is not supported with --use-megatron-fsdp (megatron-core 0.16.1's Megatron-FSDP model "
                 "has no sharded_state_dict for dist_checkpointing): use --ckpt-format fsdp_dtensor (reshardable) "
                 "or torch")
        require("loco_intra_node_bits" not in self.command_line, "loco_intra_node_bits",
                 "with --use-megatron-fsdp the intra-node reduce-scatter is Megatron-FSDP's own, at full precision")
        if lc.enabled:
            require(self.parallel.num_distributed_optimizer_instances > 1, "loco_bits",
                     "with --use-megatron-fsdp LoCo compresses HSDP's cross-node replica reduction: give "
                     "--num-distributed-optimizer-instances = number of nodes")

    @property
    def megatron_distributed_optimizer(self) -> bool:
        """Whether megatron-core's distributed optimizer (ZeRO-1 over flat buffer shards) runs:
        --use-distributed-optimizer with --optimizer adam. With --optimizer muon the flag
        shards by whole parameters instead (megatron-core's layer-wise optimizer), and DDP
        all-reduces whole gradients."""
        return self.parallel.use_distributed_optimizer and self.optimizer.optimizer == "adam"

    def _check_muon(self) -> None:
        """What --optimizer muon does not combine with (see docs/training.md, Muon)."""
        p = self.parallel
        require(not p.use_megatron_fsdp, "optimizer",
                "muon is not supported with --use-megatron-fsdp: Megatron-FSDP shards every matrix across the "
                "data-parallel ranks and Muon's Newton-Schulz needs whole matrices (megatron-core's Muon refuses "
                "its distributed optimizers too); leave out --use-megatron-fsdp (Muon shards by whole parameters)")
        require(p.use_distributed_optimizer, "optimizer",
                "muon runs in megatron-core's layer-wise distributed optimizer (Megatron-LM's --optimizer dist_muon: "
                "each data-parallel rank steps whole parameters and gathers them); leave out "
                "--no-use-distributed-optimizer")
        require(not self.loco.param_gather_bits, "param_gather_bits",
                "compresses the distributed optimizer's all-gather of flat parameter shards; --optimizer muon's "
                "layer-wise optimizer all-gathers whole updated parameters at their dtype: give 0")
        require(not p.overlap_param_gather, "overlap_param_gather",
                "is the distributed optimizer's; --optimizer muon's layer-wise optimizer all-gathers the updated "
                "parameters right after its step")

    def _check_diloco(self) -> None:
        """What --diloco-replicas does not combine with (see docs/diloco.md)."""
        p, d = self.parallel, self.diloco
        require(not p.use_megatron_fsdp, "diloco_replicas",
                "is not supported with --use-megatron-fsdp (its HSDP already uses megatron-core's "
                "distributed-optimizer instances, which are DiLoCo's replicas here): use the distributed optimizer")
        require(p.use_distributed_optimizer, "diloco_replicas",
                "needs --use-distributed-optimizer (the outer step works on its fp32 main-parameter shards; "
                "with --optimizer muon on the layer-wise optimizer's whole parameters)")
        require(p.num_distributed_optimizer_instances == 1, "num_distributed_optimizer_instances",
                "must be 1 with --diloco-replicas (the replicas are the distributed-optimizer instances)")
        require(d.diloco_fragments <= self.model.num_layers, "diloco_fragments",
                f"{d.diloco_fragments} is more than the model's {self.model.num_layers} transformer layers (each "
                "fragment is one or more whole layers)")
        bs = self.loco.loco_block_size
        require(not d.diloco_outer_bits or d.sparse_outer
                or self.loco.options_for(d.diloco_outer_bits)["rotation"] == "none"
                or bs & (bs - 1) == 0, "diloco_outer_bits",
                f"{d.diloco_outer_bits} quantises with the hadamard rotation, which needs a power-of-two "
                f"--loco-block-size, got {bs}")

    def data_parallel_size(self, world_size: int) -> int:
        """DP size of the dense layers for ``world_size`` ranks; raises ConfigError when the
        layout does not fit. megatron-core's rules (``initialize_model_parallel``): the dense
        layers need TP x PP x CP to divide the world, the expert layers (their own grid over
        the same ranks: MoE parallel folding) ETP x EP x PP."""
        p = self.parallel
        mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        if world_size % mp != 0:
            raise ConfigError(
                f"--tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size = "
                f"{p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size} x {p.context_parallel_size} "
                f"= {mp} does not divide the world size {world_size}")
        dp = world_size // mp
        self.expert_data_parallel_size(world_size)
        d = self.data
        # Elastic DiLoCo: the global batch is all replicas' (each job trains its share, as
        # its replica of a one-world run would).
        split = self.diloco.elastic and self.diloco.diloco_batch_split != "fixed"
        batch_dp = dp * (self.diloco.diloco_replicas if self.diloco.elastic and not split else 1)
        require(d.global_batch_size % (d.micro_batch_size * batch_dp) == 0, "global_batch_size",
                 f"{d.global_batch_size} is not divisible by --micro-batch-size x data-parallel size "
                 f"= {d.micro_batch_size} x {batch_dp}"
                 + (f" ({dp} in this job x {self.diloco.diloco_replicas} elastic replicas)" if batch_dp != dp else ""))
        if split:  # the shares are whole granules (see :func:`batch_granule`), one at least per replica
            granule = batch_granule(d.micro_batch_size, dp, p.pipeline_model_parallel_size,
                                    p.virtual_pipeline_model_parallel_size)
            require(d.global_batch_size % granule == 0 and d.global_batch_size // granule >= self.diloco.diloco_replicas,
                    "global_batch_size", f"{d.global_batch_size} is not a multiple of {granule} samples (a replica's "
                    f"smallest share: micro batch x data-parallel size"
                    + (" x pipeline stages" if granule != d.micro_batch_size * dp else "")
                    + f") with one share at least for each of the {self.diloco.diloco_replicas} replicas")
        elif p.virtual_pipeline_model_parallel_size is not None:
            micro = d.global_batch_size // (d.micro_batch_size * batch_dp)
            # megatron's interleaved schedule runs micro batches in groups of PP per chunk.
            require(micro % p.pipeline_model_parallel_size == 0, "global_batch_size",
                     f"{micro} micro batches per step is not a multiple of --pipeline-model-parallel-size "
                     f"{p.pipeline_model_parallel_size} (needed by the interleaved schedule)")
        return dp

    def expert_data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size of the expert layers (the group their gradients are reduced
        over) for ``world_size`` ranks; 0 for a dense model. Raises ConfigError when
        ETP x EP x PP does not divide the world."""
        p = self.parallel
        if self.model.num_experts is None:
            return 0
        ep_grid = p.expert_tp * p.expert_model_parallel_size * p.pipeline_model_parallel_size
        if world_size % ep_grid != 0:
            raise ConfigError(
                f"--expert-tensor-parallel-size x --expert-model-parallel-size x --pipeline-model-parallel-size = "
                f"{p.expert_tp} x {p.expert_model_parallel_size} x {p.pipeline_model_parallel_size} = {ep_grid} "
                f"does not divide the world size {world_size}")
        return world_size // ep_grid

    def to_flat_dict(self) -> dict:
        """Every option as {flag_name: value}, e.g. for wandb.config and checkpoints."""
        out = {}
        for f in dataclasses.fields(self):
            if dataclasses.is_dataclass(getattr(self, f.name)):
                out.update(dataclasses.asdict(getattr(self, f.name)))
        return out


def batch_granule(micro_batch_size: int, dp: int, pp: int, vpp) -> int:
    """The smallest share of a global batch a replica's step can take (--diloco-batch-split):
    one micro batch per data-parallel rank, times the pipeline stages under the interleaved
    schedule (which runs micro batches in groups of PP)."""
    return micro_batch_size * dp * (pp if vpp is not None else 1)
