"""Checkpoint -> Hugging Face folder, written atomically (temp folder renamed at the end)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import sys

import torch

from loco_megatron.config import ConfigError
from loco_megatron.data.hf_tokenizer import hf_special_token_ids, save_hf_tokenizer
from loco_megatron.data.tokenizer import HUGGINGFACE, load_tokenizer
from loco_megatron.export.hf_config import check_exportable, hf_config
from loco_megatron.export.reader import (embedding_rows, load_model_tensors, model_source, read_run_config,
                                         resolve_iteration_dir, single_rank_config)
from loco_megatron.export.tokenizer import read_pieces, special_token_ids, write_tokenizer
from loco_megatron.export.weights import to_hf

INSTALL_HINT = "pip install safetensors==0.8.0 transformers==5.24.0 (or pip install -r requirements-test.txt)"


@dataclasses.dataclass(frozen=True)
class ExportSummary:
    out: pathlib.Path
    iteration_dir: pathlib.Path
    architecture: str
    parameters: int
    vocab_size: int
    dtype: str
    saved_layout: str
    source: str = ""
    """Which model of a DiLoCo checkpoint was exported ('' without DiLoCo)."""


def default_tokenizer_path(config, cache_home: pathlib.Path) -> pathlib.Path:
    """The tokenizer the run trained with: ``--tokenizer-model``, else the built-in corpus's
    (under ``--data-cache-path``, default ``cache_home/loco_megatron``)."""
    from loco_megatron.data.corpus import default_corpus_dir

    if config.data.tokenizer_model is not None:
        return pathlib.Path(config.data.tokenizer_model)
    cache = config.data.data_cache_path or str(cache_home / "loco_megatron")
    return default_corpus_dir(cache, config.data.vocab_size) / "tokenizer.model"


def check_out_dir(out: pathlib.Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: {out} already exists and is not an empty folder (nothing was written)")


def export_to_hf(load: str, out: str, tokenizer_model: str | None, cache_home: pathlib.Path,
                 tokenizer_type: str | None = None, offline: bool = False,
                 replica: int | None = None) -> ExportSummary:
    """Export ``load`` (SAVE root or iter_N folder) to the new folder ``out``: of a DiLoCo
    checkpoint the agreed model, or ``replica``'s local one (:func:`~.reader.model_source`).

    ``tokenizer_model``/``tokenizer_type``: the run's tokenizer (None: the one its saved config
    names; ``offline``: HF_HUB_OFFLINE, a hub name is read from the hub cache only); a Hugging Face one is written as its own files (same ids as in training), a
    sentencepiece one converted (see :mod:`loco_megatron.export.tokenizer`).

    Writes ``model.safetensors``, ``config.json``, ``generation_config.json`` and the
    tokenizer files. Every check (options, files, tokenizer size) runs before anything is
    written; the folder appears only complete. Raises ConfigError.
    """
    try:
        import safetensors.torch  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"the Hugging Face export needs {e.name}: {INSTALL_HINT}") from None
    out_path = pathlib.Path(out)
    check_out_dir(out_path)
    path = resolve_iteration_dir(load)
    saved = read_run_config(path)
    check_exportable(saved)
    tok_type = tokenizer_type or saved.data.tokenizer_type
    tok_path = pathlib.Path(tokenizer_model) if tokenizer_model else default_tokenizer_path(saved, cache_home)
    if tok_type == HUGGINGFACE:
        hf_tok = load_tokenizer(tokenizer_model or saved.data.tokenizer_model, HUGGINGFACE, offline)
        pieces, special_ids = hf_tok.vocab_size, hf_special_token_ids(hf_tok)
    else:
        if not tok_path.is_file():
            raise ConfigError(f"--tokenizer-model: {tok_path} (the run's tokenizer) does not exist; pass the "
                              "sentencepiece model the run trained with")
        pieces, special_ids = len(read_pieces(str(tok_path))[0]), special_token_ids(str(tok_path))
    rows, ddp_prefix = embedding_rows(path)
    prefix, source = model_source(path, replica)
    from loco_megatron.model import padded_vocab_size, transformer_config

    tp = saved.parallel.tensor_model_parallel_size
    if padded_vocab_size(pieces, tp) != rows:
        raise ConfigError(f"--tokenizer-model: {tok_path} has {pieces} pieces, but the checkpoint's embedding "
                          f"has {rows} rows (padded for TP {tp}): not the run's tokenizer")
    config = single_rank_config(saved)
    check_exportable(config, transformer_config(config))
    tensors = load_model_tensors(path, config, rows, ddp_prefix, prefix)
    dtype = "bfloat16" if config.model.bf16 else "float32"
    # --bf16 checkpoints written before the torch norms were built in bf16 hold them in fp32: one dtype in the file.
    weights = {k: v.to(getattr(torch, dtype)) for k, v in to_hf(tensors, config, pieces).items()}
    hf = hf_config(config, pieces, dtype, special_ids)

    tmp = out_path.parent / f".{out_path.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        from safetensors.torch import save_file

        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        generation = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if tok_type == HUGGINGFACE:
            save_hf_tokenizer(hf_tok, tmp, config.model.max_position_embeddings)
        else:
            write_tokenizer(str(tok_path), tmp, config.model.max_position_embeddings)
        check_out_dir(out_path)  # nobody created it meanwhile
        if out_path.is_dir():
            out_path.rmdir()
        tmp.rename(out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    p = saved.parallel
    layout = (f"TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} "
              f"x EP {p.expert_model_parallel_size}")
    if p.virtual_pipeline_model_parallel_size:
        layout += f" (VPP {p.virtual_pipeline_model_parallel_size})"
    return ExportSummary(out_path, path, hf["architectures"][0], sum(t.numel() for t in weights.values()),
                         pieces, dtype, layout, source)


def print_summary(summary: ExportSummary, file=sys.stdout) -> None:
    of = f" (DiLoCo: {summary.source})" if summary.source else ""
    print(f"exported {summary.iteration_dir}{of} (saved as {summary.saved_layout}) -> {summary.out}: "
          f"{summary.architecture}, {summary.parameters:,} parameters ({summary.dtype}), "
          f"vocabulary {summary.vocab_size}", file=file)
