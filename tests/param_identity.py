"""pretrain_gpt.py that, before every step after the first, checks that the model
parameters are bit-identical across the ranks of each data-parallel group (expert
parameters across the expert-data-parallel group) and prints one line per check.

The trainer sets the grad hook's ``iteration`` at the start of every step; that is
where the check runs (with the parameter all-gather of the previous step complete:
use it without --overlap-param-gather)."""

import os
import sys
import warnings

import torch
import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.loco.hooks import GradSyncHook
from loco_megatron.training.trainer import train


def identical_across(params: list, group) -> bool:
    if not params:
        return True
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, flat, group=group)
    return all(torch.equal(e, flat) and torch.isfinite(e).all() for e in everyone)


class OnIteration:
    """Mixin for a gradient hook: ``on_iteration(value)`` runs whenever the trainer sets
    ``iteration`` (at the start of every step; 0 at construction)."""

    _it = 0

    @property
    def iteration(self) -> int:
        return self._it

    @iteration.setter
    def iteration(self, value: int) -> None:
        self._it = value
        self.on_iteration(value)

    def on_iteration(self, value: int) -> None:
        pass


class CheckedHook(OnIteration, GradSyncHook):
    def __init__(self, chunks, loco, stats):
        self._chunks = chunks
        super().__init__(chunks, loco, stats)

    def on_iteration(self, value: int) -> None:
        if value > 0:
            from megatron.core import parallel_state as ps

            params = [p for c in self._chunks for p in c.parameters()]
            dense = identical_across([p for p in params if getattr(p, "allreduce", True)], ps.get_data_parallel_group())
            expert = identical_across([p for p in params if not getattr(p, "allreduce", True)],
                                ps.get_expert_data_parallel_group())
            # Parameters that tensor parallelism does not split are replicated on every TP rank.
            tp = identical_across([p for p in params if not getattr(p, "tensor_model_parallel", False)],
                                  ps.get_tensor_model_parallel_group())
            # One write() per line: lines of different ranks never interleave mid-line.
            sys.stdout.flush()
            os.write(1, f"IDENTICAL rank={dist.get_rank()} iter={value} dense={dense} expert={expert} tp={tp}\n"
                     .encode())


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    config, env = main_config(sys.argv[1:])
    train(config, env, grad_sync_factory=CheckedHook)
