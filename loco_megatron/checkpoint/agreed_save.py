"""The torch_dist save, step by step, with every rank's agreement between the steps.

megatron-core's ``dist_checkpointing.save`` runs local work and collectives in turn:
building the state, applying factories, the sharding check (an all-gather; the verdict
on rank 0 only), ``common.pt`` (rank 0 only), DCP's plan (collectives), staging to host
memory and the shard writes (local), DCP's finalize (a gather; ``.metadata`` written by
rank 0 alone; a broadcast) and ``metadata.json`` (rank 0, then a barrier). A failure in
any local part raised on that rank only: it went to the caller's error agreement while
the others waited in megatron's next collective, a hang until the distributed timeout
(on NCCL a collective mismatch). Here each local part is caught, and before each
megatron/DCP collective that follows it every rank contributes an ok flag to one
all-reduce (:func:`agree`): on a failure anywhere all ranks raise :class:`SaveFailed`
together, at the same point, and the caller ends the save with one line. Failures inside
DCP's own collectives (a shard write, the plan) are already raised on every rank by DCP
(``CheckpointException``).
"""

from __future__ import annotations

import pathlib
from typing import Callable

import torch
import torch.distributed as dist

from loco_megatron.checkpoint import files
from loco_megatron.loco.hooks.version import check_megatron_core_version


class SaveFailed(Exception):
    """A save step failed on some rank and every rank knows it. The message is this rank's
    line ("" where this rank's step succeeded): the caller gathers them and prints the first."""


def agree(error: str, flag_device: torch.device) -> None:
    """Collective: raise :class:`SaveFailed` on every rank when any rank's ``error`` is set."""
    flag = torch.tensor([1.0 if error else 0.0], device=flag_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise SaveFailed(error)


def _line(what: str, e: BaseException, folder: pathlib.Path) -> str:
    return f"{what} failed on rank {dist.get_rank()} ({files.cause(e, folder)})"


def save(folder: pathlib.Path, build: Callable[[], dict], async_save: bool, flag_device: torch.device,
         start_writer: Callable[[], None], common_filter: Callable[[dict], dict]):
    """Build the state dict (``build()``) and write it into ``folder``; with ``async_save``
    return megatron's AsyncRequest (the write runs once scheduled; its finalize functions
    complete the metadata). ``start_writer``: starts megatron's writer machinery (local);
    ``common_filter``: the common state as compared across ranks. Raises
    :class:`SaveFailed` on every rank together (see the module docstring)."""
    # megatron's save split into its steps, and a private strategy callback (_strategy):
    # refuse versions whose internals were not checked.
    check_megatron_core_version()
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

    error = ""
    try:  # local: no collective before the agreement below
        sd = build()
        start_writer()
        strategy = _strategy(folder)
        sharded_sd, common_sd = save_preprocess(sd, validate_access_integrity=False)
    except Exception as e:  # noqa: BLE001 - MemoryError, a device OOM, a bug: all the same one line
        error = _line(f"building the state to save into {folder}", e, folder)
    agree(error, flag_device)  # 1: every rank can take part in the save

    try:  # megatron's sharding check (collective; raises on rank 0 only), then common.pt (rank 0)
        validate_sharding_integrity(determine_global_metadata(sharded_sd)[1],
                                    common_state_dict=common_filter(common_sd))
        error = common_error(folder, common_sd)
    except Exception as e:  # noqa: BLE001
        error = _line(f"checking the sharding of {folder}", e, folder)
    agree(error, flag_device)  # 2

    try:  # DCP's plan: its collectives raise a failure in the planning on every rank
        request = strategy.async_save(sharded_sd, str(folder))
    except (Exception, _checkpoint_exception()) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        error = _line(f"planning the write of {folder}", e, folder)
    agree(error, flag_device)  # 3: every rank holds its write request
    request.finalize_fns.append(metadata_finalizer(folder, strategy.backend, strategy.version, flag_device,
                                                   lambda: strategy.finish_error))
    if async_save:
        return request
    try:  # megatron's AsyncRequest.execute_sync with an agreement for its barrier
        args = list(request.async_fn_args)
        if request.preload_fn:
            args[1] = request.preload_fn()  # staging to host memory
        if request.async_fn is not None:
            request.async_fn(*args, **request.async_fn_kwargs)  # the shard writes (their failures: DCP's finalize)
    except Exception as e:  # noqa: BLE001
        error = _line(f"staging or writing {folder}", e, folder)
    agree(error, flag_device)  # 4
    for finalize in request.finalize_fns:
        finalize()
    return None


def _checkpoint_exception() -> type:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _strategy(folder: pathlib.Path):
    """megatron's torch_dist save strategy (a fresh one: its plan cache is off by default),
    except that DCP's finalize cannot fail on the coordinator alone: rank 0 writes
    ``.metadata`` between a gather and a broadcast, so its write failing left the others
    in the broadcast. The failure is recorded instead (``finish_error``) and agreed on in
    the metadata finalizer that follows."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class AgreedFinishStrategy(TorchDistSaveShardedStrategy):
        finish_error = ""

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            finish = writer.finish

            def recorded_finish(*args, **kwargs):
                try:
                    finish(*args, **kwargs)
                except Exception as e:  # noqa: BLE001
                    self.finish_error = _line(f"writing {folder / '.metadata'}", e, folder)

            writer.finish = recorded_finish
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)

    return AgreedFinishStrategy("torch_dist", 1)


def common_error(folder: pathlib.Path, common_sd: dict) -> str:
    """Rank 0 writes ``common.pt`` (megatron's common strategy: one torch.save) and fsyncs
    it; this rank's line when that failed, else ""."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_common_strategy

    try:
        get_default_save_common_strategy().save_common(common_sd, str(folder))  # writes on rank 0 only
        if dist.get_rank() == 0:
            files.fsync(folder / "common.pt")
    except Exception as e:  # noqa: BLE001 - any failure of this rank-0 write is reported the same way
        return f"writing {folder / 'common.pt'} failed on rank 0 ({files.cause(e, folder)})"
    return ""


def write_common(folder: pathlib.Path, common_sd: dict, flag_device: torch.device) -> None:
    """Collective: :func:`common_error`, agreed (:class:`SaveFailed` on every rank together)."""
    agree(common_error(folder, common_sd), flag_device)


def metadata_finalizer(folder: pathlib.Path, backend: str, version: int, flag_device: torch.device,
                       earlier_error: Callable[[], str] = lambda: "") -> Callable[[], None]:
    """The save's last step (after every shard is written): rank 0 writes ``metadata.json``
    naming ``backend``, which is what makes ``folder`` a sharded checkpoint; the ranks then
    agree (``earlier_error()``: a failure recorded in an earlier finalize step)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    def finalize() -> None:
        error = earlier_error()
        if dist.get_rank() == 0 and not error:
            try:
                save_config(CheckpointingConfig(backend, version), str(folder))
            except Exception as e:  # noqa: BLE001
                error = _line(f"writing {folder / 'metadata.json'}", e, folder)
        agree(error, flag_device)

    return finalize

