"""Read a torch_dist checkpoint of any parallel layout into one TP=PP=EP=1 model's tensors.

Checkpoint contract (written by the trainer's saver): ``SAVE/iter_N/`` is a
``megatron.core.dist_checkpointing`` folder whose state dict has ``"model"`` = model
chunk 0's ``sharded_state_dict()`` (``"model0"``, ``"model1"``... with virtual pipeline
stages; the sharded keys use global layer numbers, so they are the same in every
layout) and the common (non-sharded) key ``"config"`` = ``dataclasses.asdict`` of the
run Config; ``SAVE/latest_checkpointed_iteration.txt`` names N. Only the model tensors
are read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import tempfile
from typing import Optional

import torch

from loco_megatron.checkpoint import files, torch_dist
from loco_megatron.config import Config, ConfigError, brief

_EMBEDDING = "embedding.word_embeddings.weight"


def resolve_iteration_dir(load: str) -> pathlib.Path:
    """``--load`` (a SAVE root, whose latest iteration is used, or an ``iter_N`` folder) ->
    the iteration folder. Raises ConfigError naming the file when it is not a complete
    torch_dist checkpoint."""
    root = pathlib.Path(load)
    if not root.exists():
        raise ConfigError(f"--load: {load} does not exist")
    if not root.is_dir():
        raise ConfigError(f"--load: {load} is not a checkpoint folder")
    latest = root / files.LATEST
    if latest.is_file():
        text = latest.read_text().strip()
        if not text.isdigit():
            raise ConfigError(f"--load: {latest} does not hold an iteration number ({text[:40]!r})")
        path = files.iter_dir(root, int(text))
        if not path.is_dir():
            raise ConfigError(f"--load: {latest} names iteration {int(text)}, but {path} does not exist")
    elif any(p.name.startswith("iter_") for p in root.iterdir()):
        raise ConfigError(f"--load: {load} has iteration folders but no {files.LATEST} (no complete save); "
                          "pass an iter_N folder")
    else:
        path = root
    if any(path.glob("rank_*.pt")):
        raise ConfigError(f"--load: {path} was saved with --ckpt-format torch (one file per rank, which cannot "
                          "be resharded); save it with --ckpt-format torch_dist to export it")
    if files.sharded_backend(path) == "fsdp_dtensor":
        raise ConfigError(f"--load: {path} was saved with --ckpt-format fsdp_dtensor (Megatron-FSDP's DTensors), "
                          "which the export does not read (it reads torch_dist, which Megatron-FSDP runs do not write)")
    for name in ("metadata.json", "common.pt", ".metadata"):
        if not (path / name).is_file():
            raise ConfigError(f"--load: {path / name} is missing: not a complete torch_dist checkpoint")
    verify_checksums(path)
    return path


def verify_checksums(path: pathlib.Path) -> None:
    """Compare every file against the SHA-256 the saving ranks recorded (``sha256.rank_R.json``,
    written by the torch_dist saver of ``loco_megatron.checkpoint``): a corrupt shard that
    still unpickles would otherwise export wrong weights silently."""
    entries = files.sidecar_entries(path)
    if not entries:
        raise ConfigError(f"--load: {path} has no sha256.rank_*.json (an incomplete copy?)")
    for name, want in entries:
        if not (path / name).is_file():
            raise ConfigError(f"--load: {path / name} is missing (listed in the checkpoint's checksums)")
        if files.sha256(path / name) != want:
            raise ConfigError(f"--load: {path / name} does not match its recorded SHA-256 (corrupt file)")


def read_run_config(path: pathlib.Path) -> Config:
    """The run Config stored in the checkpoint's common state (key ``config``)."""
    from megatron.core import dist_checkpointing

    from loco_megatron.cli import make_config

    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:
        raise ConfigError(f"--load: {path / 'common.pt'} cannot be read ({brief(e)})") from None
    saved = common.get("config") if isinstance(common, dict) else None
    if not isinstance(saved, dict):
        raise ConfigError(f"--load: {path / 'common.pt'} has no 'config' entry: not written by loco-megatron")
    flat = {k: v for section in saved.values() if isinstance(section, dict) for k, v in section.items()}
    if flat.get("data_path") is None and flat.get("train_data_path") is None:
        # A run on the built-in corpus used that corpus's tokenizer whatever --tokenizer-model
        # said: a config saved by a version that accepted (and ignored) one still loads.
        flat.pop("tokenizer_model", None)
    try:
        return make_config(flat)
    except ConfigError as e:
        raise ConfigError(f"--load: the run config stored in {path} is not valid here ({e})") from None


def single_rank_config(config: Config) -> Config:
    """The same model shape on one rank: TP = PP = EP = ETP = 1, no virtual stages, no sequence
    parallelism or recomputation (neither changes a weight), no DiLoCo replicas, megatron-core's local layers (a
    TransformerEngine run's dense checkpoint loads into them through the local spec's
    ``sharded_state_dict_keys_map``; the export needs no TransformerEngine)."""
    parallel = dataclasses.replace(
        config.parallel, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        expert_model_parallel_size=1, expert_tensor_parallel_size=None, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, sequence_parallel=False,
        use_distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False)
    model = dataclasses.replace(config.model, recompute_granularity=None, recompute_method=None,
                                recompute_num_layers=None, use_cpu_initialization=True, transformer_impl="local")
    loco = dataclasses.replace(config.loco, param_gather_bits=0)
    # One model on one rank: no DiLoCo replicas (which model of a DiLoCo checkpoint is read: model_source).
    diloco = dataclasses.replace(config.diloco, diloco_replicas=0, diloco_lighthouse=None, diloco_replica_id=None)
    return dataclasses.replace(config, parallel=parallel, model=model, loco=loco, diloco=diloco)


def embedding_rows(path: pathlib.Path) -> tuple[int, bool]:
    """(rows of the saved word embedding, whether the sharded keys carry megatron DDP's
    ``module.`` prefix) from the checkpoint's tensor metadata."""
    from megatron.core import dist_checkpointing

    try:
        meta = dist_checkpointing.load_tensors_metadata(str(path))
    except Exception as e:
        raise ConfigError(f"--load: {path / 'metadata.json'} cannot be read ({brief(e)})") from None
    for key, tensor in meta.items():
        if key.endswith(_EMBEDDING):
            return tensor.global_shape[0], key.startswith("module.")
    raise ConfigError(f"--load: {path} has no {_EMBEDDING}: not a GPT model checkpoint")


def model_source(path: pathlib.Path, replica: Optional[int] = None) -> tuple[str, str]:
    """Which model of ``path`` to read: ``(key prefix, what it is)``.

    A DiLoCo checkpoint holds every replica's own (local) model and the agreed one
    (:mod:`loco_megatron.checkpoint.diloco`): by default the agreed model, the one every
    replica ended on after the run's final outer step (``diloco.final.``) when the
    checkpoint is of a run's last step, else the agreed parameters of its last outer step
    (``diloco.agreed.``); ``replica`` r: that replica's local model (plain keys for
    replica 0, ``diloco.replica{r}.`` else). A checkpoint without DiLoCo: its one model.
    ConfigError for a replica the checkpoint does not hold."""
    from megatron.core import dist_checkpointing

    try:
        keys = dist_checkpointing.load_tensors_metadata(str(path)).keys()
    except Exception as e:
        raise ConfigError(f"--load: {path / 'metadata.json'} cannot be read ({brief(e)})") from None
    prefixes = {k.split(".", 2)[1] for k in keys if k.startswith("diloco.")}
    if replica is not None:
        held = 1 + max((int(p[len("replica"):]) for p in prefixes if re.fullmatch(r"replica\d+", p)), default=0)
        if not 0 <= replica < held or (replica and "agreed" not in prefixes):
            raise ConfigError(f"--replica: {replica} is not a replica of {path} (it holds "
                              + (f"replicas 0-{held - 1})" if "agreed" in prefixes else "one model, no DiLoCo replicas)"))
        return (f"diloco.replica{replica}." if replica else ""), f"replica {replica}'s local model"
    if "final" in prefixes:
        return "diloco.final.", "the agreed model (after the run's final outer step)"
    if "agreed" in prefixes:
        outer = dist_checkpointing.load_common_state_dict(str(path)).get("diloco") or {}
        ended = (outer.get("elastic") or {}).get("ended")
        if ended:  # (a replica cut off while the run ended: its agreed parameters may not be the run's)
            raise ConfigError(f"--load: {path} is one replica's own training, not the run's model ({ended}); export "
                              f"the checkpoint of a replica that took part in the run's final outer step, or --replica "
                              f"R for this replica's own model")
        if int(outer.get("outer_steps", 1)) == 0:  # (the agreed parameters are still the initial weights)
            raise ConfigError(f"--load: {path} holds no trained agreed model: its run committed no outer step yet "
                              f"(the agreed parameters are the initial weights); --replica R reads replica R's own model")
        return "diloco.agreed.", "the agreed parameters of the last outer step"
    return "", ""


def load_model_tensors(path: pathlib.Path, config: Config, rows: int, ddp_prefix: bool, source: str = "") -> dict:
    """The model's global tensors (GPTModel ``state_dict`` names, TP=1) from ``path``
    (see :func:`loaded_model`)."""
    with loaded_model(path, config, rows, ddp_prefix, source) as (_, loaded):
        return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}


@contextlib.contextmanager
def loaded_model(path: pathlib.Path, config: Config, rows: int, ddp_prefix: bool, source: str = ""):
    """Yields ``(model, loaded)``: one TP=PP=EP=1 GPTModel on the CPU in eval mode holding the
    weights of ``path`` (``source``: the key prefix of the model to read, see
    :func:`model_source`), and its loaded state dict (``state_dict`` names, TP=1 tensors).

    Runs in this process: a one-rank gloo group and megatron's parallel state, which exist
    only inside the ``with`` block; the model built by :func:`loco_megatron.model.build_model`
    with ``rows`` vocabulary rows (without DDP's gradient buffers), and
    ``dist_checkpointing.load`` of its sharded state dict, which reassembles every tensor from
    whatever layout saved it (TP slices, PP stages, EP experts, the gate/up interleave of
    SwiGLU under TP).
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    # torch.distributed.checkpoint's read errors (e.g. a truncated shard) derive from BaseException.
    from torch.distributed.checkpoint.api import CheckpointException

    from loco_megatron.distributed import init_distributed
    from loco_megatron.model import build_model
    from loco_megatron.platform import detect_platform, platform_context

    platform = detect_platform(0, force_cpu=True)
    with tempfile.TemporaryDirectory() as store, platform_context(platform):
        init_distributed(config, platform, 0, 1, init_method=f"file://{store}/rendezvous")
        try:
            model = build_model(config, rows, platform.device, wrap=False)[0]
            sharded = model.sharded_state_dict(prefix="module." if ddp_prefix else "")
            if source:  # DiLoCo's agreed model or another replica's: the same tensors under a prefix
                _read_from(sharded, source)
            try:
                with torch_dist.sharded_tensor_warning_ignored():
                    loaded = dist_checkpointing.load({"model": sharded}, str(path))["model"]
            except CheckpointException as e:
                inner = next(iter(e.failures.values()), e)  # (exception, traceback) per rank
                inner = inner[0] if isinstance(inner, tuple) else inner
                raise ConfigError(f"--load: a shard file (__*.distcp) in {path} is damaged or truncated "
                                  f"({brief(inner)})") from None
            except Exception as e:
                raise ConfigError(f"--load: {path} cannot be read ({brief(e)})") from None
            prefix = "module." if ddp_prefix else ""
            loaded = {k[len(prefix):]: v for k, v in loaded.items()}
            model.load_state_dict(loaded, strict=True)
            model.eval()
            yield model, loaded
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def _read_from(sharded: dict, prefix: str) -> None:
    """Point every sharded tensor (and tensor factory: SwiGLU's fused fc1) of ``sharded`` at
    ``prefix + key``, in place; objects (no tensor data) keep their keys."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def rename(sh):
        if isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
            sh.key = prefix + sh.key
        return sh

    dict_list_map_inplace(rename, sharded)

