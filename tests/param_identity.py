"""pretrain_gpt.py that, before every step after the first, checks that the model
parameters are bit-identical across the ranks of each data-parallel group (expert
parameters across the expert-data-parallel group) and prints one line per check.

The trainer sets the grad hook's ``iteration`` at the start of every step; that is
where the check runs (with the parameter all-gather of the previous step complete:
use it without --overlap-param-gather).

``LOCO_TEST_TP_GAP_AT=N``: the N-th optimizer step of this process on tensor-parallel
rank 1 sees the gradients of the parameters TP replicates moved by 1, so the copies of
those parameters differ between TP ranks from then on (a "TP gap", as a compressed
parameter gather can leave one) while every data-parallel group stays self-consistent."""

import os
import sys
import warnings

import torch
import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.loco.hooks import GradSyncHook, ParamGatherHook
from loco_megatron.training.trainer import train


def identical_across(params: list, group) -> bool:
    if not params:
        return True
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, flat, group=group)
    return all(torch.equal(e, flat) and torch.isfinite(e).all() for e in everyone)


def open_tp_gap(chunks) -> None:
    """Tensor-parallel rank 1 adds 1 to the reduced gradients of its TP-replicated
    parameters (the same on every data-parallel rank), so its optimizer step moves them
    differently from TP rank 0's."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_rank() == 1:
        for p in (p for c in chunks for p in c.parameters() if not getattr(p, "tensor_model_parallel", False)):
            p.main_grad.add_(1.0)


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


def param_sync_factory(chunks, optimizer, loco, stats):
    """megatron's parameter sync (or the compressed gather), with the optimizer step of
    step LOCO_TEST_TP_GAP_AT opening a TP gap first (after the gradients are reduced)."""
    gap_at, step, steps = int(os.environ.get("LOCO_TEST_TP_GAP_AT", "0")), optimizer.step, [0]

    def step_with_gap():
        steps[0] += 1
        if steps[0] == gap_at:
            open_tp_gap(chunks)
        return step()

    optimizer.step = step_with_gap
    return ParamGatherHook(chunks, optimizer, loco, stats)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    config, env = main_config(sys.argv[1:])
    train(config, env, grad_sync_factory=CheckedHook, param_sync_factory=param_sync_factory)
