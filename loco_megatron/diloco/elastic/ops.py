"""The collectives between replicas, on the torchft process group of the open cycle.

torchft's reconfigurable groups sit outside torch.distributed's registry and forward only
some collectives: :func:`torchft_ops` gives LoCo's :class:`CollectiveOps` over them (the
outer exchange, the agreement, the fingerprint gather), :func:`vote` the one all-reduce
every participant issues at each decision point of a cycle, whatever failed before it, and
:func:`fresh_groups` the groups themselves, each configured under a store prefix that its
members agree on and no earlier group used (a restarted lighthouse numbers its quorums from 1
again).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import TYPE_CHECKING, Callable, Optional

import torch

from loco_megatron.loco.collectives import CollectiveOps

if TYPE_CHECKING:
    from loco_megatron.diloco.elastic.coordinator import ElasticCoordinator


def torchft_ops(coordinator: "ElasticCoordinator") -> CollectiveOps:
    """LoCo's :class:`CollectiveOps` on ``coordinator``'s torchft process group (torch's
    signatures; the group and the Manager are looked up at each call: they exist from the
    first cycle on).

    torchft's reconfigurable groups sit outside torch.distributed's registry and forward
    only some collectives: the all-gather goes through the coalesced entry point, the rank
    and size come from the Manager. An error at launch or wait is reported to the Manager
    (the cycle will not commit) and the operation then reads as done; after a failed
    collective every later one of the cycle is a no-op (as torchft's own allreduce does), so
    a failed cycle ends quickly on every rank instead of waiting out one timeout per
    collective. A failure that left the group usable (an injected "lost" one, or a
    decision reported by the cycle) keeps the collectives going, so no peer waits on them."""
    from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOp

    class Lazy:
        def __getattr__(self, name):
            return getattr(coordinator.pg, name)

    pg = Lazy()

    class ManagerProxy:
        def __getattr__(self, name):
            return getattr(coordinator.manager, name)

    manager = ManagerProxy()

    class Done:
        def wait(self, timeout=None):
            return True

    class Guarded:
        def __init__(self, work):
            self._work = work

        def wait(self, timeout=None):
            try:
                self._work.wait()
            except Exception as e:  # noqa: BLE001 - any failure discards the cycle
                manager.report_error(e)
                coordinator.grouped = False
            return True

    def run(launch: Callable, async_op: bool):
        if manager.errored() and not coordinator.grouped:  # (the group may be broken: waiting on it would time out)
            return Done() if async_op else None
        # (an injected failure, coordinator.faults: "raise" before launching, "lost" after waiting)
        fault = coordinator.faults(coordinator.phase) if coordinator.faults is not None else None
        try:
            if fault == "raise":
                raise RuntimeError(f"injected failure of the {coordinator.phase} collective")
            work = Guarded(launch())
        except Exception as e:  # noqa: BLE001
            manager.report_error(e)
            coordinator.grouped = False  # (the peers wait on it until their timeout: no more votes on it)
            return Done() if async_op else None
        if fault == "lost":  # (it completed everywhere: the group stays usable)
            work.wait()
            manager.report_error(RuntimeError(f"injected loss of the {coordinator.phase} collective"))
            return Done() if async_op else None
        if async_op:
            return work
        work.wait()
        return None

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        return run(lambda: pg.alltoall_base(output, input, list(output_split_sizes or []),
                                            list(input_split_sizes or []), AllToAllOptions()), async_op)

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        return run(lambda: pg.allgather_into_tensor_coalesced([output], [input], AllgatherOptions()), async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        return run(lambda: pg.allgather([tensor_list], [tensor], AllgatherOptions()), async_op)

    def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
        def launch():
            opts = AllreduceOptions()
            opts.reduceOp = op
            return pg.allreduce([tensor], opts)

        return run(launch, async_op)

    def get_rank(group=None) -> int:
        return (coordinator.manager.participating_rank() or 0) if coordinator.manager is not None else 0

    def get_world_size(group=None) -> int:
        # before the first quorum: the replicas expected (what the channels are first laid for)
        m = coordinator.manager
        return max(m.num_participants(), 1) if m is not None and coordinator.live else coordinator.expected

    return CollectiveOps(all_to_all_single=all_to_all_single, all_gather=all_gather,
                         all_gather_into_tensor=all_gather_into_tensor, all_reduce=all_reduce,
                         get_rank=get_rank, get_world_size=get_world_size)


def vote(pg, yes: bool, device: torch.device) -> Optional[bool]:
    """The MIN over the cycle's participants of ``yes`` (one tiny all-reduce on torchft's
    group ``pg``), None when the all-reduce did not complete everywhere. Issued by every
    participant whose group is usable at the same program point, also after a failure that
    left it usable (unlike :func:`torchft_ops`' collectives, which turn into no-ops after any
    failure), so one participant's failure reaches the others at once instead of after a
    timeout. ``device``: the group's (NCCL's collectives take CUDA tensors only).

    A failed collective shows in one of three ways, each a failed vote: gloo raises at the
    launch or the wait; torchft's NCCL group, which aborts a collective that outlives its
    timeout from a timer thread, either returns False from the wait or returns normally (its
    wait only orders the streams) with the group's ``errored()`` set and the tensor holding
    whatever the aborted kernel left (the local value, or a partial MIN). The abort sets
    ``errored()`` before it releases the stream, so it is read after ``t.item()`` (the vote's
    one host sync): torchft's ``errored()`` then syncs a stream already drained, and no vote
    read before the abort landed passes for a completed one."""
    from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

    t = torch.tensor([int(yes)], dtype=torch.int64, device=device)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MIN
    try:  # (a failed vote is a no, on a group that may be broken now)
        if pg.allreduce([t], opts).wait() is False:
            return None
        value = bool(t.item())
        if pg.errored() is not None:
            return None
    except Exception:  # noqa: BLE001
        return None
    return value


def fresh_groups(base: type) -> type:
    """torchft's process group class ``base`` (gloo or NCCL), configured under a store prefix
    that every member of the quorum agrees on and no earlier configuration used.

    torchft names the prefix after the quorum id (``.../torchft/<quorum id>/<lane>``). Within
    one lighthouse that id is new at every reconfiguration (the lighthouse moves it on when
    the members change or any member failed its commit), but a lighthouse that restarts
    numbers its quorums from 1 again: the same prefix would then hold the previous
    incarnation's rendezvous keys on the primary's store, and the new group would connect to
    addresses long closed (one failed cycle per stale id). So the members of one
    configuration (a *visit* of torchft's prefix, per group size and member set) draw a
    token: each proposes a random one with one compare-and-set on the primary's store, all
    take the first arriver's, and it names the group's prefix. The token is retired (the key
    set back to empty) once every member holds it (a barrier: a count under the token, which
    no other visit touches) or once a member's configuration failed, so the next visit of the
    key (a restarted lighthouse's) draws a new one: no prefix is used twice.

    Nothing counts visits, because a count cannot tell a visit in progress from an earlier one
    that a member missed: a member whose configuration failed before it reached the store
    would put every later visit of that key on split prefixes. Here such a member leaves
    nothing behind; the others wait for it at the barrier until the group's timeout (as they
    would in the rendezvous), fail and retire the token, so the miss costs its quorum alone.
    Only a visit whose members all died between drawing the token and retiring it leaves the
    token behind (with the primary's job, whose store usually dies too); the next visit of
    that key may split on it, fails once, and retires it."""

    class Fresh(base):
        configured_at = ""
        """The store address of the last configuration (torchft's prefix and the token)."""

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id=None,
                      group_rank=None, group_world_size=None, global_ranks=None) -> None:
            from torchft.process_group import create_store_client

            store = create_store_client(store_addr, timeout=self._timeout)
            members = hashlib.sha256(repr(sorted(global_ranks or [])).encode()).hexdigest()[:12]
            key = f"group/{world_size}/{members}"
            token = store.compare_set(key, "", uuid.uuid4().hex).decode()
            try:
                # (past ``world_size`` only on a dead visit's token: the visit fails once and retires it)
                if store.add(f"{token}/arrived", 1) >= world_size:
                    store.set(f"{token}/all", "1")
                try:
                    store.wait([f"{token}/all"])
                except Exception as e:  # (the store's own line names only a key)
                    raise RuntimeError(f"the group of quorum {quorum_id} did not form: not every member reached "
                                       f"the primary's store within {self._timeout.total_seconds():.0f} s") from e
            finally:
                store.compare_set(key, token, "")
            self.configured_at = f"{store_addr}/{world_size}-{members}-{token}"
            super().configure(self.configured_at, replica_id, rank, world_size, quorum_id, group_rank,
                              group_world_size, global_ranks)

    Fresh.__name__ = Fresh.__qualname__ = f"Fresh{base.__name__}"
    return Fresh
