"""Which LoCo kernels a run uses: chosen before the process group exists (a first C++
build goes to the background), then agreed by every rank."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from loco_megatron.cli import LaunchEnv
from loco_megatron.config import Config, ConfigError
from loco_megatron.loco.kernel_choice import BUILDING, choose_kernels
from loco_megatron.loco.quantize import QuantOptions
from loco_megatron.platform import Platform


def kernels_used(config: Config) -> bool:
    """Whether anything runs LoCo's kernels: the gradient compression (--loco-bits), the
    parameter gather (--param-gather-bits) or DiLoCo's quantised outer exchange
    (--diloco-outer-bits with --diloco-replicas, :mod:`loco_megatron.diloco.setup`; not
    SparseLoCo's, :mod:`loco_megatron.diloco.sparse`)."""
    lc, d = config.loco, config.diloco
    return lc.loco_bits > 0 or lc.param_gather_bits > 0 or (d.enabled and d.diloco_outer_bits > 0
                                                             and not d.sparse_outer)


class BackgroundBuild:
    """The first build of the C++ CPU kernels, in a process of its own
    (:func:`.cpu_kernels.start_background_build`, started by each node's local rank 0) while
    this run trains on the torch reference. ``say`` (rank 0's printer) gets one line now
    and one when the build has finished (:meth:`poll`)."""

    def __init__(self, start: bool, say: Callable[[str], None]):
        from loco_megatron.loco import cpu_kernels

        self._say, self._t0, self._done = say, time.monotonic(), False
        # The folder is named by a hash of every source: found once, not at every poll.
        self._built = cpu_kernels.build_directory() / cpu_kernels.BUILT_MARK
        # A stale mark (sources rewritten since, another ninja's build) is why this build
        # runs: only a mark written after now says it has finished.
        self._stale = self._stamp()
        log = cpu_kernels.start_background_build() if start else None
        where = f"log: {log}" if log is not None else f"under way in {cpu_kernels.build_directory()}"
        # "first use only": one-time lines, as the corpus's (a run's other lines repeat exactly)
        say(f"LoCo: building the C++ CPU kernels in the background (first use only; {where}); this run "
            f"trains on the torch reference, which computes the same bits, and runs after the build use the kernels")

    def _stamp(self) -> Optional[int]:
        """The build mark's modification time (ns), None while there is none."""
        try:
            return self._built.stat().st_mtime_ns
        except OSError:
            return None

    def poll(self) -> None:
        """One line, once, when the build has finished (a file test; no collective)."""
        if not self._done and self._stamp() not in (None, self._stale):
            self._done = True
            self._say(f"LoCo: the C++ CPU kernels are built (first use only; {time.monotonic() - self._t0:.0f} s "
                      f"after the start); the next run uses them")


def resolve_loco_kernels(config: Config, platform: Platform, env: LaunchEnv, say: Callable[[str], None]
                         ) -> tuple[Config, Optional[str], Optional[BackgroundBuild]]:
    """``(config, why, build)``: ``--loco-kernels auto`` turned into torch, cpu or triton
    for this device (one-line error when a fused path is demanded and cannot run) and the
    ranks per node filled in; ``why`` torch runs where a fused path might have (None
    otherwise), for the start-up summary; ``build``: the background build ``auto`` started
    on a CPU device whose kernels are not built yet (None otherwise). Nothing is built or
    loaded when nothing uses the kernels (:func:`kernels_used`). ``say``: rank 0's printer."""
    lc, d = config.loco, config.diloco
    kernels, why, build = "torch", None, None
    if kernels_used(config):
        try:
            kernels, why = choose_kernels(
                lc.loco_kernels, platform.device.type, env.triton_interpret,
                lc.loco_bits or lc.param_gather_bits or d.diloco_outer_bits, lc.loco_block_size,
                lc.loco_error_bits, lc.loco_error_feedback,
                options=QuantOptions(lc.loco_quantizer, lc.loco_scale, lc.loco_rotation,
                                     lc.loco_rounding).non_default() if lc.enabled else (),
                announce=say, param_gather_bits=lc.param_gather_bits, background=True)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if why == BUILDING:
            build = BackgroundBuild(env.local_rank == 0, say)
    per_node = lc.loco_ranks_per_node or env.local_world_size
    if env.world_size % per_node:
        raise ConfigError(f"--loco-ranks-per-node: {per_node} does not divide the world size {env.world_size}")
    instances = config.parallel.num_distributed_optimizer_instances
    if lc.enabled and instances > 1 and instances != env.world_size // per_node:
        # Each instance (a model shard group) must be one node, so only the compressed
        # replica reduction crosses nodes.
        raise ConfigError(f"--num-distributed-optimizer-instances: {instances} is not the number of nodes "
                          f"({env.world_size} ranks / --loco-ranks-per-node {per_node}); LoCo compresses the "
                          f"cross-node reduction of HSDP")
    return dataclasses.replace(config, loco=dataclasses.replace(lc, loco_kernels=kernels,
                                                                  loco_ranks_per_node=per_node)), why, build


def agree_kernels(config: Config, asked: str, why: Optional[str], device: torch.device
                  ) -> tuple[Config, Optional[str]]:
    """Every rank runs the C++ kernels only if every rank has them: a build may finish
    between two ranks' checks, or fail on one. One all-reduce (MIN of "I run cpu") on a
    CPU device with ``asked`` (the --loco-kernels given) auto or cpu and something using the
    kernels, the same test on every rank, so every rank issues it; none elsewhere.
    Collective. (The kernels compute what the reference does bit for bit and send the
    same bytes, so this keeps runs reproducible rather than the collectives matched.)"""
    if device.type != "cpu" or asked not in ("auto", "cpu") or not kernels_used(config):
        return config, why
    import torch.distributed as dist

    mine = config.loco.loco_kernels == "cpu"
    flag = torch.tensor([int(mine)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if mine and not flag.item():
        why = "the C++ CPU kernels are not loaded on every rank"
        config = dataclasses.replace(config, loco=dataclasses.replace(config.loco, loco_kernels="torch"))
    return config, why
