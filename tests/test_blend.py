"""Data blending through megatron-core's BlendedDataset: proportions, resume, flag forms."""

import numpy as np
import pytest
import torch

from loco_megatron.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from loco_megatron.data.blend import parse_blend
from loco_megatron.data.dataset import MicroBatchIterator, build_datasets, resolve_data
from loco_megatron.data.indexed import write_indexed_dataset
from loco_megatron.data.tokenizer import load_tokenizer, train_sentencepiece


@pytest.fixture(autouse=True)
def one_process_group(tmp_path):
    """megatron-core's BlendedDataset asks torch.distributed for the rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _two_datasets(tmp_path):
    a = [f"alpha {i} " * 40 + "\n" for i in range(60)]
    b = [f"beta gamma {i} " * 40 + "\n" for i in range(60)]
    model = train_sentencepiece(a + b, str(tmp_path / "tok"), 300)
    tok = load_tokenizer(model)
    for name, docs in (("a", a), ("b", b)):
        write_indexed_dataset(docs, tok, str(tmp_path / name), model)
    return model, tok


def test_blend_proportion_and_resume_position(tmp_path):
    """Guards against blend weights being ignored or swapped (samples must come from
    prefix A and B as 0.7/0.3), and against a resumed run drawing different blended
    samples than an uninterrupted one (position = consumed samples)."""
    model, tok = _two_datasets(tmp_path)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = Config(model=ModelConfig(seq_length=32, num_layers=1, hidden_size=32, num_attention_heads=2),
                 data=DataConfig(data_path=f"0.7 {a} 0.3 {b}", tokenizer_model=model, split="90,10,0",
                                 global_batch_size=8, micro_batch_size=2),
                 train=TrainConfig(train_iters=100, eval_interval=0))
    sources = resolve_data(cfg, str(tmp_path / "cache"))
    train, _ = build_datasets(cfg, sources, str(tmp_path / "cache"))
    share_a = float(np.mean(np.asarray(train.dataset_index[:800]) == 0))
    assert share_a == pytest.approx(0.7, abs=0.02)
    beta = set(tok.tokenize("beta"))
    from_b = [bool(beta & set(train[i]["tokens"].tolist())) for i in range(200)]
    assert from_b == [int(d) == 1 for d in train.dataset_index[:200]]  # index 1 really is prefix B

    full = MicroBatchIterator(train, 8, 2, dp_rank=1, dp_size=2)
    for _ in range(3):
        list(full.step())
    state = full.state_dict()
    train2, _ = build_datasets(cfg, sources, str(tmp_path / "cache"))  # a fresh process's view
    resumed = MicroBatchIterator(train2, 8, 2, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    for x, y in zip(full.step(), resumed.step()):
        assert torch.equal(x["tokens"], y["tokens"])


def test_per_split_paths_and_flag_forms(tmp_path):
    """Guards against --train-data-path/--valid-data-path mixing their data (validation
    must draw only from its own prefix) and against malformed blends passing silently."""
    model, tok = _two_datasets(tmp_path)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = Config(model=ModelConfig(seq_length=32, num_layers=1, hidden_size=32, num_attention_heads=2),
                 data=DataConfig(train_data_path=a, valid_data_path=b, tokenizer_model=model,
                                 global_batch_size=8, micro_batch_size=2),
                 train=TrainConfig(train_iters=4, eval_interval=2, eval_iters=1))
    train, valid = build_datasets(cfg, resolve_data(cfg, str(tmp_path / "cache")), str(tmp_path / "cache"))
    beta = set(tok.tokenize("beta"))
    assert all(beta & set(valid[i]["tokens"].tolist()) for i in range(8))
    assert not any(beta & set(train[i]["tokens"].tolist()) for i in range(8))
    assert parse_blend("x y", "data-path") == (["x", "y"], None)
    for bad in ("0.7 x 0.3", "x 0.3", "-1 x 2 y"):
        with pytest.raises(ConfigError, match="--data-path"):
            parse_blend(bad, "data-path")
    with pytest.raises(ConfigError, match="--train-data-path"):
        DataConfig(train_data_path=a, tokenizer_model=model)
