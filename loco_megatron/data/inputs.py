"""The run's local inputs exist: checked before torch is imported (a few seconds on a busy
machine), so a typo'd path is one line at once. The full checks (a readable tokenizer, a
dataset made with it) follow in :func:`loco_megatron.data.dataset.resolve_data`."""

from __future__ import annotations

from loco_megatron.config import DataConfig
from loco_megatron.data.blend import blends_from
from loco_megatron.data.indexed import check_dataset_files
from loco_megatron.data.tokenizer import check_tokenizer_path


def check_inputs_here(d: DataConfig) -> None:
    """ConfigError / InputNotHere (one line, no network) when ``--tokenizer-model`` is a local
    path that does not exist (:mod:`.hub`'s rule) or a dataset's .bin/.idx is missing; nothing
    to check for the built-in corpus."""
    if d.data_path is None and d.train_data_path is None:
        return
    check_tokenizer_path(d.tokenizer_model, d.tokenizer_type)
    for prefix in blends_from(d.data_path, d.train_data_path, d.valid_data_path, "").prefixes:
        check_dataset_files(prefix)
