"""Model FLOPs and parameter counts from the config (pure functions, no processes)."""

import pytest

from loco_megatron.config import ModelConfig
from loco_megatron.training.flops import Throughput, parameter_count, peak_tflops_for, training_flops_per_token


def test_flops_per_token_matches_hand_count():
    """Guards against a wrong FLOPs formula (a missing factor, attention counted once,
    SwiGLU's third matrix or the logits left out), which would misreport MFU."""
    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64)
    assert m.ffn_hidden_size == 192  # SwiGLU: 8/3 x 64 rounded up to a multiple of 64
    qkv = 2 * 64 * (64 + 2 * 64)     # 24,576
    scores = 2 * 2 * 64 * 64         # 16,384: QK^T and attention x V over 64 positions
    proj = 2 * 64 * 64               # 8,192
    mlp = 2 * 64 * 192 * 3           # 73,728: gate, up, down
    logits = 2 * 64 * 4096           # 524,288
    assert training_flops_per_token(m, 4096) == 3 * (2 * (qkv + scores + proj + mlp) + logits) == 2_310_144


def test_flops_reduce_to_megatron_paper_formula_for_gpt():
    """Guards against the general formula (GQA, SwiGLU, MoE) drifting from the published
    GPT one: 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) per batch of B*s tokens."""
    h, L, s, V = 1024, 24, 2048, 51200
    m = ModelConfig(num_layers=L, hidden_size=h, num_attention_heads=16, seq_length=s, swiglu=False,
                    normalization="LayerNorm", position_embedding_type="learned_absolute")
    paper = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert training_flops_per_token(m, V) == pytest.approx(paper, rel=1e-12)
    # per layer 12h^2 weights + 13h biases and norms; final norm; embeddings, positions, output
    assert parameter_count(m, V) == 12 * L * h * h + 13 * L * h + 2 * h + 2 * V * h + s * h


def test_mfu_and_peak_lookup():
    """Guards against MFU computed per world instead of per device, or a wrong peak match
    (H100 PCIe must not get the SXM figure)."""
    t = Throughput(1e9, world_size=4, peak_tflops=2.0)
    assert t.metrics(8000.0) == {"train/tflops_per_device": 2.0, "train/mfu": 1.0}
    assert "train/mfu" not in Throughput(1e9, 4, None).metrics(8000.0)
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.0 and peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_for("cpu") is None
