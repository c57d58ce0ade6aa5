"""Process groups: torch.distributed plus megatron-core's parallel state."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Optional

import torch
import torch.distributed as dist

from loco_megatron.config import Config, ConfigError
from loco_megatron.platform import Platform


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the TP x PP x DP (x EP) grid."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    tp_rank: int
    replicas: int = 1
    """DiLoCo replicas (contiguous blocks of data-parallel ranks; 1 without DiLoCo)."""

    @property
    def replica(self) -> int:
        """This rank's DiLoCo replica."""
        return self.dp_rank // self.inner_dp_size

    @property
    def inner_dp_size(self) -> int:
        """Data-parallel ranks inside one replica."""
        return self.dp_size // self.replicas

    @property
    def inner_dp_rank(self) -> int:
        return self.dp_rank % self.inner_dp_size

    def replica_group(self):
        """Every rank of this rank's replica (None: the world, without DiLoCo): the group of
        the per-step agreements and metrics, which must not cross between replicas."""
        from megatron.core import parallel_state as ps

        return ps.get_intra_distributed_optimizer_instance_group() if self.replicas > 1 else None

    def inner_dp_group(self):
        """The data-parallel ranks of this rank's replica (the whole data-parallel group
        without DiLoCo)."""
        from megatron.core import parallel_state as ps

        if self.replicas == 1:
            return ps.get_data_parallel_group()
        # (megatron keeps the partial groups with context parallelism only; CP is 1 here)
        return ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that prints and writes metrics (global rank 0)."""
        return self.rank == 0


def init_distributed(config: Config, platform: Platform, rank: int, world_size: int,
                     init_method: str = "env://", timeout_s: Optional[float] = None,
                     agent_store: Optional[tuple[str, int]] = None, attempt: int = 0,
                     agents: int = 1) -> ParallelLayout:
    """Start torch.distributed and megatron-core's parallel state; seed the RNGs.

    Every process group (the default one and each of megatron's) gets the same timeout,
    ``--distributed-timeout-minutes`` (``timeout_s`` overrides it, for tests): a collective
    that waits longer for a hung or stopped rank raises, so the job fails instead of
    hanging until the allocation ends. ``agent_store``, ``attempt``, ``agents``: the store
    the torchrun agent shares with its ranks (None: not shared), its restart count and the
    number of agents (:class:`~loco_megatron.cli.LaunchEnv`), see :func:`rendezvous`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loco_megatron.diloco.layout import RANK_ORDER

    p, replicas = config.parallel, config.diloco.replicas_in_world
    minutes = timeout_s / 60.0 if timeout_s else config.train.distributed_timeout_minutes
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=minutes)
        where = rendezvous(init_method, agent_store, attempt, agents, world_size, timeout)
        dist.init_process_group(backend=platform.backend, rank=rank, world_size=world_size, timeout=timeout, **where)
    ps.initialize_model_parallel(
        distributed_timeout_minutes=minutes,  # megatron turns it into a timedelta; its default is 30
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tp,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        # DiLoCo's replicas are megatron's distributed-optimizer instances, data parallelism
        # outermost so that each is a contiguous block of ranks (loco_megatron.diloco.layout).
        num_distributed_optimizer_instances=replicas or p.num_distributed_optimizer_instances,
        **({"order": RANK_ORDER} if replicas > 1 else {}),
    )
    # Same seed on every DP replica (identical init), per-TP-rank streams for TP regions.
    torch.manual_seed(config.train.seed)
    model_parallel_cuda_manual_seed(config.train.seed)
    return ParallelLayout(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), replicas=max(replicas, 1),
    )


def rendezvous(init_method: str, agent_store: Optional[tuple[str, int]], attempt: int, agents: int,
               world_size: int, timeout: datetime.timedelta) -> dict:
    """``init_process_group``'s rendezvous arguments: ``init_method``, or a store.

    torch 2.13's torchrun agent hosts one TCP store (at ``agent_store``, host and port) and
    shares it with its ranks for every restart of the worker group (--max-restarts), while
    its ``env://`` rendezvous adds no per-attempt prefix, so a restarted group read the
    failed group's gloo addresses from it and died ("Gloo connectFullMesh failed ...
    Connection refused"). With one agent its restart count ``attempt`` numbers the
    attempts exactly, and each attempt rendezvous under its own prefix (megatron's groups
    too: theirs prefix the default group's store). Several agents count differently (one
    whose ranks did not fail restarts them without counting), so a restart there is
    refused with one line: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every attempt a
    fresh store (rank 0 hosts it), as the launchers set.
    """
    if agent_store is None or init_method != "env://" or (agents > 1 and attempt == 0):
        return {"init_method": init_method}
    if agents > 1:
        raise ConfigError(f"torchrun restarted the worker group (restart {attempt}) of a {agents}-node job whose "
                          f"ranks share the agents' store, which still holds the failed group's keys (torch 2.13): "
                          f"start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment "
                          f"(tools/launch.py and the Slurm templates set it)")
    host, port = agent_store
    client = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"loco_megatron/attempt_{attempt}", client)}


def shutdown_distributed() -> None:
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        ps.destroy_model_parallel()
        dist.destroy_process_group()
