"""Analytic memory per GPU of a run (used by ``pretrain_gpt.py --dry-run`` and
``benchmarks/memory.py``).

Bytes per GPU on the first pipeline stage (the fullest), for the run's own layout:

* weights: 2 bytes per parameter with --bf16, else 4;
* gradients: megatron's DDP buffer, 4 bytes per parameter (2 with --grad-reduce-in-bf16);
* optimizer: fp32 main params + Adam moments, 12 bytes per parameter with --bf16 (8 in
  fp32, where the weights are the main params), divided by the data-parallel size that
  shards it with --use-distributed-optimizer: the dense DP for dense parameters, the
  expert DP (world / (ETP x EP x PP)) for expert ones. --optimizer muon: Muon's matrices
  (:func:`muon_parameter_count`) keep one momentum (4 bytes, 8 with --bf16's main param)
  instead of Adam's two; the layer-wise optimizer deals whole parameters, so the rank dealt
  the word embedding (the first stage's largest parameter) holds all of its state and 1 / DP
  of the rest (the figure given: the fullest rank);
* LoCo (--loco-bits > 0): the error (int8 + one fp32 scale per block: 1 + 4/block bytes per
  gradient element) and the workspace (two fp32 copies of the largest bucket, at most the
  rank's compressed parameters, plus its send/receive payloads), for the gradients LoCo
  compresses only (:func:`compressed_groups`): those whose data-parallel group has more than
  one rank (the dense DP, or the expert DP for expert parameters; under DiLoCo, inside a
  replica: DP / R). A group of one rank sends nothing, so a real run keeps no error there;
* DiLoCo (--diloco-replicas): the optimizer is sharded over a replica's data-parallel ranks
  only (DP / R), and the outer step keeps per element of that shard the agreed parameters
  and momentum (4 + 4 bytes), the outer error buffers and one fragment's outer gradient in
  flight (:func:`loco_megatron.diloco.memory.outer_memory_bytes`);
* activations of the micro batches in flight (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", arXiv 2205.05198: per layer and micro batch
  ``s*b*h*(34 + 5*a*s/h)`` bytes at 16 bits with no parallelism; with TP t and sequence
  parallelism ``s*b*h*(34/t + 5*a*s/(h*t))``, selective recomputation drops the ``5as/h``
  term, full recomputation keeps ``2*s*b*h/t`` per layer plus one whole layer being
  recomputed; 1F1B keeps PP micro batches in flight on the first stage, interleaving adds
  ``(PP-1)/(PP*VP)``). The formula is the paper's GPT layer (4h MLP); for SwiGLU/GQA/MoE it is
  an estimate.

Dense parameters are split by TP x PP, expert parameters by ETP x EP x PP. Not counted: the
CUDA context and allocator fragmentation (add ~5-10%).

With --use-megatron-fsdp (data parallelism only) the sharding group is DP /
--num-distributed-optimizer-instances ranks, and --data-parallel-sharding-strategy says what
it shards: ``optim`` the optimizer state, ``optim_grads`` also the gradients,
``optim_grads_params`` also the weights (``no_shard`` is refused). A sharded part costs its
full size / group size, plus, for weights and gradients, the unsharded units in flight:
two FSDP units (a transformer layer or the embedding, whichever is larger: the one computed
and the one prefetched) of weights, one of gradients. The LoCo error is per shard under
every strategy (HSDP's cross-node reduction compresses the rank's shard only, also where
the gradient buffer holds whole buckets, docs/fsdp.md).
"""

from __future__ import annotations

from loco_megatron.config import Config
from loco_megatron.diloco.memory import outer_memory_bytes
from loco_megatron.training.flops import parameter_count

GIB = 2**30
DDP_BUCKET = 40_000_000
"""megatron-core's default DDP bucket size (elements), when --ddp-bucket-size is not given."""
PARTS = ("weights", "grads", "optimizer", "loco_error", "loco_workspace", "diloco", "activations")
"""The keys of :func:`estimate` that add up to its ``total``."""


def expert_parameter_count(config: Config) -> int:
    """Parameters inside the MoE experts (0 for a dense model); the router is dense."""
    m = config.model
    if m.num_experts is None:
        return 0
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    up = 2 if m.swiglu else 1
    bias = 0 if m.swiglu else f * up + m.hidden_size
    return m.num_layers * m.num_experts * (m.hidden_size * f * up + f * m.hidden_size + bias)


def muon_parameter_count(config: Config) -> tuple[int, int]:
    """(dense, expert) parameters of the whole model that --optimizer muon gives Muon: the
    2-D matrices of the transformer layers (QKV, output projection, the MLP's or each
    expert's, the router), see :func:`loco_megatron.optimizer.muon_split`."""
    from loco_megatron.training.flops import _dims

    m = config.model
    h = m.hidden_size
    h_q, h_kv, f_moe = _dims(m)
    attn = h * (h_q + 2 * h_kv) + h_q * h
    up = 2 if m.swiglu else 1
    if m.num_experts is None:
        return m.num_layers * (attn + h * m.ffn_hidden_size * (up + 1)), 0
    return m.num_layers * (attn + h * m.num_experts), m.num_layers * m.num_experts * h * f_moe * (up + 1)


def optimizer_line(config: Config, est: dict) -> str:
    """One line: the optimizer, what it keeps per parameter and its memory per GPU
    (``est``: :func:`estimate`'s)."""
    p, bf16 = config.parallel, config.model.bf16
    main = " + an fp32 main weight 4 B" if bf16 else ""
    mib = est["optimizer"] / 2**20
    where = f"{mib:.1f} MiB per GPU (estimate)" if mib < 1024 else f"{mib / 1024:.1f} GiB per GPU (estimate)"
    if config.optimizer.optimizer == "adam":
        how = ("megatron-core's distributed optimizer (flat shards over the data-parallel ranks)"
               if p.use_distributed_optimizer else "every data-parallel rank holding all of it")
        return f"optimizer: AdamW on {est['params']:,} parameters (2 moments: 8 B per parameter{main}), {how}: {where}"
    muon = sum(muon_parameter_count(config))
    how = "layer-wise over the data-parallel ranks (whole parameters: the rank with the word embedding)"
    return (f"optimizer: Muon on {muon:,} parameters (the transformer layers' matrices; momentum: 4 B per parameter"
            f"{main}) and AdamW on {est['params'] - muon:,} (embeddings, output layer, norms, biases; 8 B per "
            f"parameter{main}), {how}: {where}")


def _activations(config: Config) -> float:
    m, p = config.model, config.parallel
    s, b, h, a = m.seq_length, config.data.micro_batch_size, m.hidden_size, m.num_attention_heads
    t, pp, vp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    sp = p.sequence_parallel
    layers = m.num_layers / pp
    per_layer_no_attn = s * b * h * ((34 / t) if sp else (10 + 24 / t))
    attn = s * b * h * 5 * a * s / (h * t)
    in_flight = pp * (1 + ((pp - 1) / (pp * vp) if vp > 1 else 0))
    if m.recompute_granularity == "full":  # layer inputs only, plus the one layer being recomputed
        return 2 * s * b * h / (t if sp else 1) * layers * in_flight + per_layer_no_attn + attn
    stored = per_layer_no_attn + (0 if m.recompute_granularity == "selective" else attn)
    return stored * layers * in_flight


def compressed_groups(config: Config, dp: int, expert_dp: int) -> tuple[bool, bool]:
    """(dense, expert): whether LoCo compresses the dense and the expert parameters'
    gradients with ``dp`` dense and ``expert_dp`` expert data-parallel ranks (0: a dense
    model), as its gradient hook decides at a real start: only where the group the
    gradients are reduced over has more than one rank (inside a DiLoCo replica: a
    replica's ``DP / R`` ranks; the replicas exchange at outer steps, not through LoCo).
    Under Megatron-FSDP LoCo compresses the reduction across
    --num-distributed-optimizer-instances, which the config requires to be > 1 with LoCo."""
    if config.parallel.use_megatron_fsdp:
        return True, True
    replicas = config.diloco.replicas_in_world or 1  # (elastic: every replica is a world of its own)
    return dp // replicas > 1, (expert_dp or replicas) // replicas > 1


def _fsdp_parts(config: Config, here: float, dp: int, vocab: int, weight_bytes: int, grad_bytes: int,
                optimizer_bytes: int) -> dict:
    """Weights, gradients, optimizer and LoCo error under Megatron-FSDP (see the module doc)."""
    m, p, lc = config.model, config.parallel, config.loco
    group = dp // p.num_distributed_optimizer_instances
    strategy = p.data_parallel_sharding_strategy
    unit = max((here - vocab * m.hidden_size) / m.num_layers, vocab * m.hidden_size)  # largest FSDP unit
    shards_weights = strategy == "optim_grads_params"
    shards_grads = shards_weights or strategy == "optim_grads"
    shard_elements = here / group
    return {
        "weights": weight_bytes * (shard_elements + 2 * unit) if shards_weights else weight_bytes * here,
        "grads": grad_bytes * (shard_elements + unit) if shards_grads else grad_bytes * here,
        "optimizer": optimizer_bytes * shard_elements,
        "loco_error": shard_elements * (1 + 4 / lc.loco_block_size) if lc.loco_bits else 0,
    }


def estimate(config: Config, world_size: int, vocab_size: int) -> dict:
    """Bytes per GPU (see the module doc) for ``config`` on ``world_size`` ranks, with a
    ``vocab_size``-token tokenizer (padded here as the model pads it). Keys: :data:`PARTS`,
    ``total`` (their sum), ``params`` (the whole model's), ``dp``, ``expert_dp`` and
    ``outer_elements`` (DiLoCo's outer state on one rank: its shard, or an elastic lane).
    Raises ConfigError when the layout does not fit ``world_size``."""
    from loco_megatron.model import padded_vocab_size

    m, p, lc = config.model, config.parallel, config.loco
    dp = config.data_parallel_size(world_size)
    expert_dp = config.expert_data_parallel_size(world_size)
    tp, pp, ep, etp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                       p.expert_model_parallel_size, p.expert_tp)
    vocab = padded_vocab_size(vocab_size, tp)
    total = parameter_count(m, vocab)
    experts = expert_parameter_count(config)
    dense_here = (total - experts) / (tp * pp)
    experts_here = experts / (etp * ep * pp)
    here = dense_here + experts_here
    replicas = config.diloco.replicas_in_world or 1  # DiLoCo: the optimizer shards inside a replica
    shard = (dp // replicas, (expert_dp or replicas) // replicas) if p.use_distributed_optimizer else (1, 1)
    optimizer_bytes = 12 if m.bf16 else 8
    muon_dense, muon_experts = muon_parameter_count(config) if config.optimizer.optimizer == "muon" else (0, 0)
    # (Muon's matrices keep one 4-byte momentum where Adam keeps two moments)
    dense_state = optimizer_bytes * dense_here - 4 * muon_dense / (tp * pp)
    expert_state = optimizer_bytes * experts_here - 4 * muon_experts / (etp * ep * pp)
    dense_share = dense_state / shard[0]
    if config.optimizer.optimizer == "muon" and shard[0] > 1:
        # Whole parameters: the rank dealt the word embedding (AdamW; the first stage's largest
        # parameter) holds all of its state, the others share the rest.
        largest = optimizer_bytes * vocab * m.hidden_size / tp
        dense_share = (dense_state - largest) / shard[0] + largest
    weight_bytes, grad_bytes = (2 if m.bf16 else 4), (2 if p.grad_reduce_in_bf16 else 4)
    block = lc.loco_block_size
    dense_loco, expert_loco = compressed_groups(config, dp, expert_dp) if lc.loco_bits else (False, False)
    compressed = dense_here * dense_loco + experts_here * expert_loco  # elements with a LoCo error
    bucket = min(p.ddp_bucket_size or DDP_BUCKET, compressed)  # no bucket outgrows what the rank compresses
    out = {
        "weights": weight_bytes * here,
        "grads": grad_bytes * here,
        "optimizer": dense_share + expert_state / shard[1],
        "loco_error": compressed * (1 + 4 / block),
        "loco_workspace": 2 * 4 * bucket + 2 * bucket * (lc.loco_bits / 8 + 4 / block),
        "diloco": outer_memory_bytes(config, dense_here / shard[0] + experts_here / shard[1]),
        "activations": _activations(config),
    }
    if p.use_megatron_fsdp:
        out.update(_fsdp_parts(config, here, dp, vocab, weight_bytes, grad_bytes, optimizer_bytes))
    out["total"] = sum(out[k] for k in PARTS)
    out.update(params=total, dp=dp, expert_dp=expert_dp, outer_elements=(
        total / (config.diloco.diloco_outer_ranks or 1) if config.diloco.elastic  # (elastic: per lane)
        else dense_here / shard[0] + experts_here / shard[1]))
    return out


def estimate_line(est: dict) -> str:
    """One line: each part and the total, in GiB (MiB for a total under 1 GiB)."""
    unit, size = ("GiB", GIB) if est["total"] >= GIB else ("MiB", 2**20)
    g = {k: est[k] / size for k in PARTS + ("total",)}
    return (f"memory per GPU (estimate, first pipeline stage): weights {g['weights']:.1f} {unit}, gradients "
            f"{g['grads']:.1f}, optimizer {g['optimizer']:.1f}, LoCo error + workspace "
            f"{g['loco_error'] + g['loco_workspace']:.1f}, "
            + (f"DiLoCo outer state {g['diloco']:.1f}, " if est["diloco"] else "") +
            f"activations {g['activations']:.1f}; total "
            f"{g['total']:.1f} {unit} (+5-10% CUDA context and fragmentation)")
