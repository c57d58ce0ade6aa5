"""Data round trip: text -> sentencepiece ids -> .bin/.idx -> megatron GPTDataset sample."""

import torch

from loco_megatron.config import Config, DataConfig, ModelConfig, OptimizerConfig, TrainConfig
from loco_megatron.data.dataset import DataSources, MicroBatchIterator, build_datasets
from loco_megatron.data.indexed import check_indexed_dataset, write_indexed_dataset
from loco_megatron.data.tokenizer import load_tokenizer, train_sentencepiece


def test_text_to_gpt_dataset_round_trip(tmp_path):
    """Guards against tokens being reordered, truncated or re-typed between the text
    and the samples megatron's GPTDataset serves."""
    docs = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 8 for i in range(40)]
    model = train_sentencepiece(docs, str(tmp_path / "tok"), 300)
    tok = load_tokenizer(model)
    prefix = str(tmp_path / "ds")
    n = write_indexed_dataset(docs, tok, prefix, model)
    check_indexed_dataset(prefix, tok, model)
    expected = []
    for d in docs:
        expected += list(tok.tokenize(d)) + [tok.eod]
    assert n == len(expected)
    assert tok.detokenize(list(tok.tokenize(docs[3]))) == docs[3]

    cfg = Config(model=ModelConfig(seq_length=32, num_layers=1, hidden_size=32, num_attention_heads=2),
                 data=DataConfig(split="100,0,0", global_batch_size=4, micro_batch_size=2),
                 train=TrainConfig(train_iters=2, eval_interval=0),
                 optimizer=OptimizerConfig(lr_warmup_iters=0))
    train, _ = build_datasets(cfg, DataSources(prefix, model, tok), str(tmp_path / "cache"))
    # Unshuffled view of the first epoch: sample k's tokens are a window of the stream.
    stream = torch.tensor(expected)
    for k in range(4):
        s = train[k]
        assert s["tokens"].numel() == 32
        window = torch.cat([s["tokens"], s["labels"][-1:]])
        hits = [i for i in range(len(expected) - 32) if torch.equal(stream[i:i + 33], window)]
        assert hits, "sample is not a contiguous window of the tokenised documents"
        assert torch.equal(s["labels"][:-1], s["tokens"][1:])

    it = MicroBatchIterator(train, 4, 2, dp_rank=1, dp_size=2)
    batches = list(it.step())
    assert len(batches) == 1 and torch.equal(batches[0]["tokens"][0], train[2]["tokens"])
    assert it.state_dict() == {"consumed_samples": 4}
