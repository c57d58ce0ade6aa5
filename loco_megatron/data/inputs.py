"""The run's local inputs exist: checked before torch is imported (a few seconds on a busy
machine), so a typo'd path is one line at once. The full checks (a readable tokenizer, a
dataset made with it; a checkpoint's files) follow in
:func:`loco_megatron.data.dataset.resolve_data` and :mod:`loco_megatron.checkpoint`."""

from __future__ import annotations

import pathlib
from typing import Optional

from loco_megatron.config import Config, ConfigError
from loco_megatron.data.blend import parse_blend
from loco_megatron.data.indexed import check_dataset_files
from loco_megatron.data.tokenizer import check_tokenizer_path


def check_inputs_here(config: Config) -> None:
    """ConfigError / InputNotHere (one line, no network) when a dataset's .bin/.idx is
    missing (:func:`check_data_files`), ``--tokenizer-model`` is a local path that does not
    exist (:mod:`.hub`'s rule), or ``--load`` is not a folder (:func:`check_load_folder`)."""
    d = config.data
    check_data_files(d.data_path, d.train_data_path, d.valid_data_path)
    if d.data_path is not None or d.train_data_path is not None:  # the built-in corpus: its own tokenizer
        check_tokenizer_path(d.tokenizer_model, d.tokenizer_type)
    check_load_folder(config.checkpoint.load)


def check_data_files(data_path: Optional[str], train_data_path: Optional[str],
                     valid_data_path: Optional[str]) -> None:
    """ConfigError naming the flag and the file when a dataset prefix's .bin or .idx does
    not exist (nothing to check for the built-in corpus). Checked before the tokenizer: a
    missing dataset is the first thing to fix, and it decides which tokenizer is needed."""
    for flag, spec in (("data-path", data_path), ("train-data-path", train_data_path),
                       ("valid-data-path", valid_data_path)):
        if isinstance(spec, str):  # (a config file's non-string value is the dataclass's one line)
            for prefix in parse_blend(spec, flag)[0]:
                check_dataset_files(prefix, "--" + flag)


def check_load_folder(load: Optional[str]) -> None:
    """ConfigError when ``--load`` names something that exists but is not a folder (a
    checkpoint file, a typo'd path onto a file): no checkpoint could be in it, and starting
    fresh would train from scratch where the user asked to resume. A path that does not
    exist yet is a fresh start (the first job of a series that always passes --load)."""
    if load is not None and pathlib.Path(load).exists() and not pathlib.Path(load).is_dir():
        raise ConfigError(f"--load: {load} is a file, not a checkpoint folder (give the folder that --save "
                          f"wrote: it holds iter_N/ and latest_checkpointed_iteration.txt)")
