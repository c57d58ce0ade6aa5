"""GPT datasets (megatron-core's ``GPTDataset`` via ``BlendedMegatronDatasetBuilder``)
and the resumable micro-batch iterator that feeds the pipeline schedules."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import pathlib
from typing import Callable, Iterator, Optional

import torch

from loco_megatron.config import Config, ConfigError
from loco_megatron.data.blend import Blends, blends_from
from loco_megatron.data.corpus import ensure_default_corpus
from loco_megatron.data.indexed import check_indexed_dataset
from loco_megatron.data.tokenizer import load_tokenizer


@dataclasses.dataclass
class DataSources:
    """Resolved, validated inputs: the dataset prefix(es) and their tokenizer."""

    data_prefix: str
    """The (first) dataset prefix."""
    tokenizer_model: str
    tokenizer: object
    blends: Optional[Blends] = None
    """Blends of several prefixes (None: ``data_prefix`` alone)."""


def resolve_data(config: Config, cache_dir: str, log: Optional[Callable[[str], None]] = None,
                 offline: bool = False) -> DataSources:
    """The user's dataset and tokenizer (checked), or the built-in corpus (``log``: see
    :func:`ensure_default_corpus`; ``offline``: HF_HUB_OFFLINE, a hub tokenizer is read from
    the hub cache only). Raises ConfigError."""
    d = config.data
    if d.data_path is None and d.train_data_path is None:
        prefix, model = ensure_default_corpus(cache_dir, d.vocab_size, log)
    else:
        prefix, model = None, d.tokenizer_model
    blends = blends_from(d.data_path, d.train_data_path, d.valid_data_path, prefix)
    tokenizer = load_tokenizer(model, d.tokenizer_type, offline)
    for p in blends.prefixes:
        check_indexed_dataset(p, tokenizer, model, tokenizer_type=d.tokenizer_type)
    return DataSources(blends.prefixes[0], model, tokenizer, blends)


def build_datasets(config: Config, sources: DataSources, cache_dir: str):
    """(train, valid) GPTDatasets sized for the whole run (epochs repeat as needed)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    t, g = config.train, config.data.global_batch_size
    blends = sources.blends or Blends(blend=([sources.data_prefix], None))
    evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 1
    sizes = [t.train_iters * g, max(evals * t.eval_iters * g, 1), 0]
    ds_config = GPTDatasetConfig(
        random_seed=t.seed,
        sequence_length=config.model.seq_length,
        blend=blends.blend,
        blend_per_split=blends.per_split,
        split=config.data.split if blends.blend else None,
        path_to_cache=cache_dir,
        tokenizer=sources.tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    if blends.blend:
        for prefix in blends.prefixes:
            _check_split_nonempty(config.data.split, prefix)
    # Every rank reads its own samples; megatron's builder lets global rank 0 write the
    # shuffle/sample index caches first (numpy.save straight to their names) while the
    # others wait at its barrier, then read them.
    with cache_lock(cache_dir):
        train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, ds_config).build()
    return train, valid


@contextlib.contextmanager
def cache_lock(cache_dir: str) -> Iterator[None]:
    """On global rank 0 (or without torch.distributed), an flock on ``cache_dir`` while
    megatron's builder writes or reads its index caches: jobs that share the folder (elastic
    DiLoCo's replica jobs, each with a rank 0 of its own) otherwise read a file another
    job's rank 0 is still writing ("mmap length is greater than file size"). Under the lock
    a rank 0 finds each cache file whole or absent (then writes it whole); its job's other
    ranks read only after its barrier. The other ranks take no lock: the builder's barriers
    need them while their rank 0 holds it."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        yield
        return
    pathlib.Path(cache_dir).mkdir(parents=True, exist_ok=True)
    with open(pathlib.Path(cache_dir) / ".megatron_index.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (dropped by the kernel if this process dies)
        yield


def _check_split_nonempty(split: str, prefix: str) -> None:
    """Each split with a positive weight must get at least one document (megatron's
    dataset builder loops forever on an empty split)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    n_docs = len(IndexedDataset(prefix, mmap=True).document_indices) - 1
    weights = [float(w) for w in split.split(",")]
    total, start = sum(weights), 0.0
    for name, w in zip(("train", "validation", "test"), weights):
        end = start + w / total
        if w > 0 and int(round(end * n_docs)) - int(round(start * n_docs)) == 0:
            raise ConfigError(f"--split: '{split}' leaves the {name} split of {prefix} "
                              f"({n_docs} documents) empty")
        start = end


class MicroBatchIterator:
    """Yields this data-parallel rank's micro batches, step after step, resumably.

    Step ``t`` owns global samples ``c ... c + G - 1`` (``c = t*G`` samples consumed before
    it, ``G`` the global batch). This replica trains its share of them, samples
    ``o ... o + S - 1`` of the step (``share = (o, S)``; the whole batch without DiLoCo's
    batch split): global sample ``c + o + r*S/DP + k*mbs + i`` (``r`` the DP rank, ``k``
    the micro batch, ``i`` its row) is row ``i`` of micro batch ``k`` on rank ``r``.
    ``consumed_samples`` is the whole saved state: the share is agreed anew by the replicas
    at start-up (:mod:`loco_megatron.diloco.batch_split`), and restoring the position
    resumes the exact sample sequence.
    """

    def __init__(self, dataset, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, consumed_samples: int = 0, share: Optional[tuple[int, int]] = None):
        self.dataset, self.gbs, self.mbs = dataset, global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.set_share(*(share or (0, global_batch_size)))

    def set_share(self, offset: int, samples: int) -> None:
        """From the next step on, train samples ``offset ... offset + samples - 1`` of each
        step's global batch (``samples``: a multiple of micro batch x DP)."""
        if samples % (self.mbs * self.dp_size) or not 0 <= offset <= self.gbs - samples or samples <= 0:
            raise ValueError(f"share ({offset}, {samples}) of a global batch of {self.gbs} is not whole micro "
                             f"batches of {self.mbs} on {self.dp_size} data-parallel rank(s)")
        self.offset, self.samples = offset, samples
        self.num_microbatches = samples // (self.mbs * self.dp_size)

    def step(self) -> Iterator[dict]:
        """An iterator over this step's micro batches; advances the position by one global batch."""
        start = self.consumed_samples + self.offset + self.dp_rank * (self.samples // self.dp_size)
        self.consumed_samples += self.gbs
        return self._micro_batches(start)

    def _micro_batches(self, start: int) -> Iterator[dict]:
        n = len(self.dataset)
        for k in range(self.num_microbatches):
            rows = [self.dataset[(start + k * self.mbs + i) % n] for i in range(self.mbs)]
            yield {key: torch.stack([torch.as_tensor(r[key]) for r in rows]) for key in rows[0]}

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, sd: dict) -> None:
        self.consumed_samples = int(sd["consumed_samples"])
