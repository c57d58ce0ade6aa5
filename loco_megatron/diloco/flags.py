"""What the replicas must agree on besides the outer gradients (a stop, an abort), sent only
at their outer steps, with a work handle.

Every step's stop/health agreement runs inside each replica (its ranks only:
:meth:`loco_megatron.training.signals.StopRequest.agreed`, the skip guard), so no step
waits on the link between sites. Between the replicas these flags travel only at the
*sync points*, the iterations where the schedule starts an outer exchange: there every
rank starts one small all-reduce (MAX) of its replica's flags over its outer group, and
reads the answer ``lag = max(tau, 1)`` steps later, when every replica has issued it
(program order: the iteration number alone decides both, on every rank). The round trip
is hidden behind ``lag`` steps of training; at most one exchange is in flight, since
``tau`` never exceeds the gap between two sync points. The stop then happens on every
replica at that same later step; a replica's wish that arrives after a sync point waits
for the next one (:class:`~loco_megatron.training.signals.StopRequest` latches it).

The all-reduce runs on a gloo group of the same ranks as the outer group (host tensors:
no device synchronisation to read it, also when the outer exchanges run on NCCL).

Flags, one float each, combined with MAX: ``[signal number, stop file seen, torchrun
agent lost, replica + 1 that asks to stop, replica + 1 that aborts]``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from loco_megatron.diloco.schedule import FragmentSchedule

SIGNUM, STOP_FILE, AGENT_LOST, STOP_REPLICA, ABORT_REPLICA = range(5)


def cross_replica_gloo_group(replicas: int):
    """This rank's gloo group of the same ranks as its outer group (the rank at the same
    position in every replica; replicas are contiguous blocks, :mod:`.layout`). Collective:
    every rank creates every such group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = world // replicas
    mine = None
    for position in range(size):
        group = dist.new_group([position + r * size for r in range(replicas)], backend="gloo")
        if position == rank % size:
            mine = group
    return mine


class ReplicaFlags:
    """The flag exchange between replicas at the sync points of ``schedule``.

    ``group``: the cross-replica group (None with one replica, or without DiLoCo: nothing
    to exchange, every step decides alone); ``schedule``: DiLoCo's (None without);
    ``replica``: this rank's replica index."""

    def __init__(self, group, schedule: Optional[FragmentSchedule], replica: int = 0):
        if group is not None and schedule is None:
            raise ValueError("a flag exchange between replicas needs their outer schedule")
        self.group, self.schedule, self.replica = group, schedule, replica
        self.lag = max(schedule.delay, 1) if schedule is not None else 0
        self._in_flight: Optional[tuple[int, torch.Tensor, object]] = None
        """(read iteration, the flags tensor, the work) of the exchange started last."""

    def is_sync_point(self, t: int) -> bool:
        return bool(self.schedule.starts(t))

    def flags(self, wish: list[int], abort: bool) -> list[int]:
        """This replica's flags from its agreed stop wish and its skip guard's verdict."""
        signum, file_flag, lost = wish
        asks = bool(signum or file_flag or lost)
        return [signum, file_flag, lost, self.replica + 1 if asks else 0, self.replica + 1 if abort else 0]

    def after_step(self, t: int, mine: list[int]) -> Optional[list[int]]:
        """Every rank, after the step-``t`` agreement inside its replica: the flags all
        replicas agreed on, at a step where an exchange is read (None at any other step:
        no decision is possible there). One replica: ``mine`` at every step."""
        if self.group is None:
            return mine
        agreed = None
        if self._in_flight is not None and self._in_flight[0] == t:
            _, tensor, work = self._in_flight
            work.wait()  # started lag steps ago: its round trip is long over
            self._in_flight = None
            agreed = [int(v) for v in tensor.tolist()]
        if self.is_sync_point(t):
            tensor = torch.tensor(mine, dtype=torch.float64)  # host memory: a gloo group
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self._in_flight = (t + self.lag, tensor, work)
        return agreed

    def final(self, mine: list[int]) -> list[int]:
        """At the last step of a run (every replica there: --train-iters, or an agreed
        stop), collective: the exchange in flight, then one more over the latest flags, so a
        replica's abort or stop that no sync point carried is known to all."""
        agreed = [0] * len(mine)
        if self.group is None:
            return mine
        if self._in_flight is not None:
            _, tensor, work = self._in_flight
            work.wait()
            self._in_flight = None
            agreed = [int(v) for v in tensor.tolist()]
        tensor = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return [max(a, int(b)) for a, b in zip(agreed, tensor.tolist())]
