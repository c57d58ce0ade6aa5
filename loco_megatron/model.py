"""The GPT / MoE model: megatron-core's GPTModel wrapped in its DDP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loco_megatron.config import Config, ConfigError
from loco_megatron.distributed import ParallelLayout


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
        use_cpu_initialization=m.use_cpu_initialization,
        variable_seq_lengths=m.num_experts is not None and p.pipeline_model_parallel_size > 1,
        **moe,
    )


def layer_spec(config: Config):
    from megatron.core.models.gpt import gpt_layer_specs

    m = config.model
    if m.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise ConfigError("--transformer-impl transformer_engine: TransformerEngine is not installed") from None
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=m.num_experts)
    return gpt_layer_specs.get_gpt_layer_local_spec(num_experts=m.num_experts, normalization=m.normalization)


def build_model(config: Config, layout: ParallelLayout, vocab_size: int, device: torch.device):
    """This rank's pipeline stage of the GPT, inside megatron-core's DDP wrapper."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    m, p = config.model, config.parallel
    tconf = transformer_config(config)
    model = GPTModel(
        config=tconf, transformer_layer_spec=layer_spec(config), vocab_size=vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=layout.is_first_stage, post_process=layout.is_last_stage,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
    )
    model.to(device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not p.grad_reduce_in_bf16,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
        bucket_size=p.ddp_bucket_size,
    )
    return DistributedDataParallel(config=tconf, ddp_config=ddp_config, module=model)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Vocabulary padded so each TP rank holds an equal, aligned slice of the embedding."""
    step = multiple * tp
    return -(-vocab_size // step) * step
