"""Model size and model FLOPs from the config: parameter count, training FLOPs per token,
throughput in TFLOP/s per device and model FLOPs utilisation (MFU).

FLOPs count matrix multiplies only (2 FLOPs per multiply-add), forward x 3 for a
training step (forward, backward w.r.t. activations, backward w.r.t. weights), as in
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21, arXiv 2104.04473, appendix "Floating-point operations"), extended
to grouped-query attention, SwiGLU and top-k MoE. Per token and layer, forward:

* Q, K, V projections ``2*h*(h_q + 2*h_kv)``; output projection ``2*h_q*h``
  (``h_q`` = heads x head dim, ``h_kv`` = query groups x head dim);
* attention scores and weighted sum ``2 * 2*s*h_q`` (the full s x s matrix, as the paper
  counts it, not the causal half);
* MLP ``2*h*f*(3 if SwiGLU else 2)`` per expert a token visits (top-k; the router's
  ``2*h*E`` is left out, as in the paper);

plus the logits ``2*h*V`` per token. For GPT (MHA, 4h GeLU MLP) this is the paper's
``72*B*s*L*h^2 * (1 + s/(6h) + V/(12*h*L))`` per batch of ``B*s`` tokens. Model FLOPs:
recomputed forwards are *not* counted (MFU, not hardware FLOPs utilisation).
"""

from __future__ import annotations

from typing import Optional

from loco_megatron.config import ModelConfig

PEAK_BF16_TFLOPS = {"H200": 989.0, "GH200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "H800": 989.0,
                    "B200": 2250.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L4": 121.0}
"""Dense (no sparsity) bf16 tensor-core peak per GPU from NVIDIA's data sheets, matched
as a substring of ``torch.cuda.get_device_name()`` in this order (PCIe before SXM)."""


def peak_tflops_for(device_name: str) -> Optional[float]:
    """Known GPU -> its dense bf16 peak; None for anything else (CPU, unknown GPUs)."""
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def _dims(m: ModelConfig) -> tuple[int, int, int]:
    head_dim = m.hidden_size // m.num_attention_heads
    h_q = m.num_attention_heads * head_dim
    h_kv = (m.num_query_groups or m.num_attention_heads) * head_dim
    return h_q, h_kv, m.moe_ffn_hidden_size or m.ffn_hidden_size


def parameter_count(m: ModelConfig, vocab_size: int) -> int:
    """Parameters of the whole model (all stages, TP shards and experts), for megatron-core's
    local layer spec; ``vocab_size`` is the padded vocabulary."""
    h = m.hidden_size
    h_q, h_kv, f_moe = _dims(m)
    bias = not m.swiglu  # the configs use biases exactly for the GeLU (GPT-2) shape
    norm = 2 * h if m.normalization == "LayerNorm" else h
    attn = h * (h_q + 2 * h_kv) + h_q * h + (h_q + 2 * h_kv + h if bias else 0)
    up = 2 if m.swiglu else 1

    def mlp(f: int) -> int:
        return h * f * up + f * h + ((f * up + h) if bias else 0)

    ffn = mlp(m.ffn_hidden_size) if m.num_experts is None else m.num_experts * mlp(f_moe) + h * m.num_experts
    layer = 2 * norm + attn + ffn
    embed = vocab_size * h + (m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0)
    output = vocab_size * h if m.untie_embeddings_and_output_weights else 0
    return m.num_layers * layer + norm + embed + output


def training_flops_per_token(m: ModelConfig, vocab_size: int) -> float:
    """Model FLOPs of one training token (forward + backward), see the module docstring."""
    h, s = m.hidden_size, m.seq_length
    h_q, h_kv, f_moe = _dims(m)
    experts = 1 if m.num_experts is None else m.moe_router_topk
    f = m.ffn_hidden_size if m.num_experts is None else f_moe
    per_layer = 2 * h * (h_q + 2 * h_kv) + 2 * h_q * h + 4 * s * h_q + 2 * h * f * (3 if m.swiglu else 2) * experts
    return 3.0 * (m.num_layers * per_layer + 2 * h * vocab_size)


class Throughput:
    """``train/tflops_per_device`` and ``train/mfu`` from the logged tokens per second."""

    def __init__(self, flops_per_token: float, world_size: int, peak_tflops: Optional[float]):
        self.flops_per_token, self.world_size, self.peak = flops_per_token, world_size, peak_tflops

    def metrics(self, tokens_per_s: float) -> dict:
        tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
        out = {"train/tflops_per_device": tflops}
        if self.peak:
            out["train/mfu"] = tflops / self.peak
        return out


def throughput_for(model: ModelConfig, vocab_size: int, world_size: int, device, peak_tflops: Optional[float]):
    """The run's :class:`Throughput`: --peak-tflops, else the device's known peak (None on CPU)."""
    if peak_tflops is None and device.type == "cuda":
        import torch

        peak_tflops = peak_tflops_for(torch.cuda.get_device_name(device))
    return Throughput(training_flops_per_token(model, vocab_size), world_size, peak_tflops)
