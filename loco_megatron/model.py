"""The GPT / MoE model: megatron-core's GPTModel wrapped in its DDP."""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F

from loco_megatron.config import Config, ConfigError


def transformer_config(config: Config):
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p = config.model, config.parallel
    dtype = torch.bfloat16 if m.bf16 else torch.float32
    moe = {}
    if m.num_experts is not None:
        moe = dict(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                   moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=m.moe_aux_loss_coeff,
                   moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
                   moe_router_load_balancing_type="aux_loss")
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std, normalization=m.normalization,
        gated_linear_unit=m.swiglu, activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=not m.swiglu, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        bf16=m.bf16, params_dtype=dtype, pipeline_dtype=dtype,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tp, layernorm_epsilon=m.norm_epsilon,
        use_cpu_initialization=m.use_cpu_initialization,
        variable_seq_lengths=m.num_experts is not None and p.pipeline_model_parallel_size > 1,
        recompute_granularity=m.recompute_granularity, recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers, sequence_parallel=p.sequence_parallel,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        # With PP=2 the previous and next stage are one rank, and the interleaved schedule's
        # batched p2p posts 'send to prev' before 'send to next' on both sides, so the
        # forward activation and the backward gradient of one exchange arrive swapped
        # (same shape: silently wrong losses). megatron's unbatched path orders size-2 groups.
        batch_p2p_comm=p.pipeline_model_parallel_size != 2,
        **moe,
    )


def layer_spec(config: Config, tconf=None, vp_stage=None):
    """The layer spec (or, with sequence parallelism on the local implementation, the block
    spec of chunk ``vp_stage`` under TransformerConfig ``tconf``)."""
    from megatron.core.models.gpt import gpt_layer_specs

    m = config.model
    if m.transformer_impl == "transformer_engine":
        check_transformer_engine(config)
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=m.num_experts)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=m.num_experts, normalization=m.normalization)
    spec.module = _seeded_layer_class(spec.module, config.train.seed)
    if not config.parallel.sequence_parallel or m.transformer_impl != "local":
        return spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    # megatron-core's torch-norm fallback (no Apex) refuses sequence parallelism; the same
    # torch norm with its params marked 'sequence_parallel' (finalize_model_grads then
    # sums their grads over the TP group) is what the Apex/TE norms do.
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, name) is WrappedTorchNorm:
            setattr(spec.submodules, name, SequenceParallelNorm)
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(tconf, vp_stage),
                                      layer_norm=SequenceParallelNorm)


def check_transformer_engine(config: Config) -> None:
    """One-line ConfigError when ``--transformer-impl transformer_engine`` is asked for and
    TransformerEngine cannot be imported (checked before any process group starts)."""
    if config.model.transformer_impl != "transformer_engine":
        return
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or a TE built for another torch/CUDA (OSError, RuntimeError)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("--transformer-impl transformer_engine: TransformerEngine cannot be imported "
                          f"({why}); install requirements-gpu.txt or use --transformer-impl local") from None


class SequenceParallelNorm:
    """torch LayerNorm / RMSNorm for sequence-parallel runs (constructor as megatron's
    WrappedTorchNorm): each TP rank normalises its own sequence slice, and the weights'
    gradients are partial sums that megatron all-reduces over the TP group."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _seeded_layer_class(layer_cls, seed: int):
    """``layer_cls`` whose CPU-initialised weights depend only on (seed, global layer
    number), not on which pipeline stage or virtual chunk builds the layer, so PP, VPP
    and PP=1 runs of one seed start from the same weights (layout twins compare)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    class SeededLayer(layer_cls):
        def __init__(self, config, submodules, layer_number: int = 1, *args, vp_stage=None, **kwargs):
            global_number = layer_number + get_transformer_layer_offset(
                config, vp_stage, ps.get_pipeline_model_parallel_rank())
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 100003 + global_number)
                super().__init__(config, submodules, layer_number, *args, vp_stage=vp_stage, **kwargs)

    SeededLayer.__name__ = SeededLayer.__qualname__ = layer_cls.__name__
    return SeededLayer


def _name_seed(seed: int, name: str) -> int:
    """A seed for one parameter from the run's seed and the parameter's name (stable
    across processes, unlike ``hash``)."""
    return (seed * 1000003 + zlib.crc32(name.encode())) % (2 ** 63)


@torch.no_grad()
def _seed_outside_layers(model, seed: int, std: float, tied: bool) -> None:
    """Re-draw the random weights that live outside the transformer layers (the word and
    position embeddings, the output layer) from ``(seed, name)``: megatron draws them from
    the stage's global RNG, so with PP > 1 the last stage's output layer started from
    other weights than with PP = 1 (its stage never drew the embedding first). The full
    tensor is drawn, then this rank's tensor-parallel slice taken, so TP is irrelevant too.
    A tied output layer (on a stage without the embedding) is drawn under the embedding's
    name, so it equals the embedding as megatron's own initial sync makes it."""
    from megatron.core import parallel_state as ps

    for name, param in model.named_parameters():
        if name.startswith("decoder.") or param.dim() < 2:  # layers: per global layer number; norms: ones
            continue
        key = "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name
        full = list(param.shape)
        dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
        tp = ps.get_tensor_model_parallel_world_size() if dim >= 0 else 1
        full[max(dim, 0)] *= tp
        g = torch.Generator().manual_seed(_name_seed(seed, key))
        values = torch.empty(full).normal_(0.0, std, generator=g)
        if dim >= 0:
            values = values.chunk(tp, dim=dim)[ps.get_tensor_model_parallel_rank()]
        param.copy_(values)


def _torch_modules_to_bf16(model) -> None:
    """Cast the plain torch modules megatron builds in fp32 whatever params_dtype says (the
    learned position table; the norms of the local layer spec, WrappedTorchNorm, and
    :class:`SequenceParallelNorm`) to bf16, as Megatron-LM's Float16Module does (its fp32
    copies are the distributed optimizer's main params). Left fp32: the embedding sum turns
    fp32 and the first bf16 linear layer refuses it; every norm gets bf16 inputs with fp32
    weights, which torch's fused rms_norm refuses (a warning per rank, the unfused path);
    and the norms' parameters fill a second DDP buffer, whose all-gathers under
    --overlap-param-gather run out of forward order (megatron warns that the next bucket's
    all-gather "has already been dispatched", and the overlap is lost)."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(torch.bfloat16)


def build_model(config: Config, vocab_size: int, device: torch.device, wrap: bool = True) -> list:
    """This rank's model chunks (one per virtual pipeline stage, else one), each a
    GPTModel inside megatron-core's DDP wrapper, in schedule order. ``wrap=False``: the bare
    GPTModels, without DDP's gradient buffers (4 bytes per parameter; for reading weights)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    m, p = config.model, config.parallel
    tconf = transformer_config(config)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not p.grad_reduce_in_bf16,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=config.megatron_distributed_optimizer,
        bucket_size=p.ddp_bucket_size,
    )
    vp = p.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vp or 1):
        vp_stage = stage if vp else None
        model = GPTModel(
            config=tconf, transformer_layer_spec=layer_spec(config, tconf, vp_stage), vocab_size=vocab_size,
            max_sequence_length=m.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type, vp_stage=vp_stage,
            rotary_base=m.rotary_base, rope_scaling=m.use_rope_scaling, rope_scaling_factor=m.rope_scaling_factor,
        )
        _seed_outside_layers(model, config.train.seed, m.init_method_std,
                             tied=not m.untie_embeddings_and_output_weights)
        if m.bf16:
            _torch_modules_to_bf16(model)
        model.to(device)
        if not wrap:
            chunks.append(model)
            continue
        if p.use_megatron_fsdp:
            chunks.append(_megatron_fsdp(config, tconf, model, device))
            continue
        # Every chunk keeps its own buckets (megatron-LM merges chunks > 0 into one bucket;
        # here each chunk's buckets overlap its backward and each gets LoCo compressors).
        chunks.append(DistributedDataParallel(config=tconf, ddp_config=ddp_config, module=model))
    return chunks


def _megatron_fsdp(config: Config, tconf, model, device: torch.device):
    """``model`` inside megatron-core's Megatron-FSDP (``FullyShardedDataParallel``):
    parameters, gradients and optimizer state sharded per --data-parallel-sharding-strategy
    over the data-parallel ranks (with --num-distributed-optimizer-instances > 1, over
    each instance, replicated across instances: HSDP)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from loco_megatron.platform import megatron_fsdp_compat, megatron_fsdp_staged_param_gather

    p = config.parallel
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not p.grad_reduce_in_bf16, overlap_grad_reduce=p.overlap_grad_reduce,
        use_distributed_optimizer=True, bucket_size=p.ddp_bucket_size, use_megatron_fsdp=True,
        data_parallel_sharding_strategy=p.data_parallel_sharding_strategy,
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        # gloo has no premultiplied sum: scale, then sum (the same numbers NCCL's fused op gives).
        gradient_reduce_div_fusion=device.type == "cuda",
    )
    with megatron_fsdp_compat(device):
        fsdp = FullyShardedDataParallel(config=tconf, ddp_config=ddp_config, module=model, device=device)
    megatron_fsdp_staged_param_gather(fsdp, device)
    return fsdp


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Vocabulary padded so each TP rank holds an equal, aligned slice of the embedding."""
    step = multiple * tp
    return -(-vocab_size // step) * step
