"""The ``fsdp_dtensor`` format (``--use-megatron-fsdp`` only): Megatron-FSDP's parameters
and the distributed optimizer's state as DTensors, through ``torch.distributed.checkpoint``
(DCP), which reshards them to whatever world / instances / sharding strategy loads them.
--async-save works as for torch_dist (megatron's asynchronous DCP writer).

``SAVE/iter_N/`` holds what a torch_dist checkpoint holds (:mod:`loco_megatron.checkpoint.torch_dist`)
with the same names: DCP's ``__R_0.distcp`` shards and ``.metadata``, ``common.pt`` (rank 0,
megatron's common strategy: the LR scheduler, the data position, the trainer counters,
``"layout"``, ``"iteration"``, ``"config"``), ``metadata.json`` (``sharded_backend``
``fsdp_dtensor``: what tells the two formats apart) and ``sha256.rank_R.json``. The DCP state:

- ``"model"``: the Megatron-FSDP model's ``state_dict()`` - its pre-hook swaps in the
  optimizer's DTensor parameters, so these are the fp32 main weights themselves
  (keys ``module.decoder.layers.0...``; global shapes, each rank its uneven shard);
- ``"optimizer"``: ``{"0": DistributedOptimizer.sharded_state_dict(..., metadata=
  {"distrib_optim_sharding_type": "fsdp_dtensor"})}`` - megatron-core's own: Adam's
  ``exp_avg``/``exp_avg_sq`` DTensors and ``step`` per parameter name, and each name's
  param-group hyper-parameters;
- per rank, under a key naming the layout (``loco.<tag>/shard_R_W``, ``rng.<tag>/shard_R_W``):
  the RNG and LoCo's error buffers, pickled whole (one object; read only at the same layout,
  else ``load_state_dict(None)`` and one line, as torch_dist).

megatron-core's ``preprocess_state_dict_for_uneven_dtensor`` is applied to both the saved and
the requested state (Megatron-FSDP's shards are uneven: DCP's default planner would assume
even chunks). Loading first runs megatron's zero-gradient step that creates the Adam state
(``sharded_param_state_fsdp_dtensor(is_loading=True)``); DCP then overwrites the weights
and the state in place, and the main weights are copied into the weights the forward gathers.
SwiGLU's fused fc1 is not split (megatron-LM splits it for TP resharding; no TP here).
"""

from __future__ import annotations

import io
import pathlib
from typing import Callable

import torch
import torch.distributed as dist

from loco_megatron.checkpoint import agreed_save, files, torch_dist
from loco_megatron.checkpoint.rng import rng_state
from loco_megatron.config import ConfigError, brief
from loco_megatron.loco.hooks.version import check_megatron_core_version
from loco_megatron.optimizer import sub_optimizers

FORMAT = "fsdp_dtensor"
_SHARDING = {"distrib_optim_sharding_type": FORMAT}


def is_fsdp_dtensor(path: pathlib.Path) -> bool:
    """Whether ``path`` is a checkpoint of this format (its ``metadata.json`` says so)."""
    return files.sharded_backend(path) == FORMAT


def _per_rank_key(name: str, layout_key: dict) -> str:
    return f"{name}.{torch_dist.layout_tag(layout_key)}/shard_{dist.get_rank()}_{dist.get_world_size()}"


def _packed(obj) -> io.BytesIO:
    """One object, pickled, so DCP stores it whole (it would flatten a dict and save its
    tensors as replicated entries): see :func:`_unpacked`."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _unpacked(value):
    """The object :func:`_packed` wrapped: DCP pickles the BytesIO itself and hands it back."""
    if isinstance(value, io.BytesIO):
        value.seek(0)
        return torch.load(value, weights_only=False)
    return value


def _every_param(opt, osd: dict) -> dict:
    """megatron's fsdp_dtensor optimizer state with an entry for every parameter, in
    param-group order. megatron-core 0.16.1 leaves a parameter whose shard on this rank is
    empty without Adam state (no gradient; its zero-gradient step on load skips it too), so
    ranks held different sets of DTensors and ``preprocess_state_dict_for_uneven_dtensor``
    (one all-gather per DTensor over its mesh) hung: those get empty DTensors laid out as
    the parameter and this rank's step count (Adam steps every parameter alike)."""
    check_megatron_core_version()  # megatron's private _param_name and state layout below
    state = osd["state"]
    steps = [s["step"] for s in state.values() if "step" in s]
    out = {}
    for group in opt.optimizer.param_groups:
        for param in group["params"]:
            name = opt._param_name(param)
            if name not in state:
                state[name] = {"step": steps[0].clone() if steps else torch.zeros(()),
                               "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
            out[name] = state[name]
    return {**osd, "state": out}


def sharded_state(stateful: dict, layout_key: dict, is_loading: bool, per_rank: bool) -> dict:
    """The DCP state dict to save, or to load into (``is_loading``: megatron allocates the
    Adam state first); ``per_rank``: include this rank's layout-keyed objects (RNG, LoCo)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor)

    chunks = stateful["model"].chunks
    assert len(chunks) == 1, "Megatron-FSDP runs one model chunk (no pipeline stages)"
    sd = {"model": chunks[0].module.state_dict(),
          "optimizer": {str(i): _every_param(opt, opt.sharded_state_dict(None, is_loading, metadata=dict(_SHARDING)))
                        for i, opt in enumerate(sub_optimizers(stateful["optimizer"].optimizer))}}
    if per_rank:
        for name, obj in stateful.items():
            if name in torch_dist.PER_RANK:
                sd[_per_rank_key(name, layout_key)] = _packed(None if is_loading else obj.state_dict())
        sd[_per_rank_key("rng", layout_key)] = _packed(None if is_loading else rng_state())
    preprocess_state_dict_for_uneven_dtensor(sd)  # collective: gathers every DTensor's chunk offsets
    return sd


def save(folder: pathlib.Path, stateful: dict, layout_key: dict, run_config, iteration: int, async_save: bool,
         flag_device: torch.device):
    """Collective: write the checkpoint into ``folder``; with ``async_save`` returns megatron's
    AsyncRequest (as :func:`.agreed_save.save`: the write runs in a process forked when it is
    scheduled, the finalize functions write DCP's ``.metadata`` and ``metadata.json``).
    Raises :class:`.agreed_save.SaveFailed` on every rank when rank 0's ``common.pt`` failed,
    DCP's CheckpointException (on every rank) when a shard write failed."""
    from torch.distributed import checkpoint as dcp

    agreed_save.write_common(folder, torch_dist.common_state(stateful, layout_key, run_config, iteration), flag_device)
    sd = sharded_state(stateful, layout_key, is_loading=False, per_rank=True)
    metadata_finalize_fn = agreed_save.metadata_finalizer(folder, FORMAT, 1, flag_device)

    if not async_save:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(folder), thread_count=1))
        metadata_finalize_fn()
        return None
    return _async_request(folder, sd, metadata_finalize_fn)


def _async_request(folder: pathlib.Path, sd: dict, metadata_finalize_fn: Callable[[], None]):
    """megatron's asynchronous DCP save of ``sd`` (the one its torch_dist strategy makes,
    with DCP's default planner, as megatron-LM does for fsdp_dtensor)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_finalize, save_state_dict_async_plan)
    from torch.distributed.checkpoint import DefaultSavePlanner

    torch_dist.start_writer_manager_detached()
    writer = FileSystemWriterAsync(str(folder), thread_count=1)
    planned = save_state_dict_async_plan(sd, writer, None, 0, planner=DefaultSavePlanner())[0]
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()

    def write_finalize_fn():
        save_state_dict_async_finalize(*planned)  # DCP's .metadata, on the coordinator

    return AsyncRequest(save_fn, save_args, [write_finalize_fn, metadata_finalize_fn], preload_fn=preload_fn)


@torch.no_grad()
def load(folder: pathlib.Path, stateful: dict, layout_key: dict, log: Callable[[str], None]) -> int:
    """Restore ``stateful`` from ``folder`` under the current layout (resharded); returns
    the iteration. Per-rank state only at the same layout (see the module docstring)."""
    from torch.distributed import checkpoint as dcp

    torch_dist.verify(folder, dist.get_rank(), dist.get_world_size())
    common = torch_dist.saved_common(folder)
    saved_layout = common.get("layout", {})
    same = torch_dist.layout_tag(saved_layout) == torch_dist.layout_tag(layout_key)
    request = sharded_state(stateful, layout_key, is_loading=True, per_rank=same)
    try:
        dcp.load(request, storage_reader=dcp.FileSystemReader(str(folder)))
    except (Exception, torch_dist.checkpoint_exception()) as e:  # noqa: BLE001 - one line, whatever DCP raised
        raise ConfigError(f"--load: {folder} could not be loaded ({brief(e)})") from None
    loaded = {**common, "optimizer": request["optimizer"]}
    if same:
        for name in (*(n for n in stateful if n in torch_dist.PER_RANK), "rng"):
            loaded[name] = _unpacked(request[_per_rank_key(name, layout_key)])
    torch_dist.restore(folder, stateful, loaded, saved_layout, layout_key, log)
    return int(common["iteration"])
