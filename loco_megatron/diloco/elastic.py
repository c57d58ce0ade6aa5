"""Elastic DiLoCo on torchft: replicas as jobs of their own that fail, leave and rejoin.

Each replica is one torchrun job with its own megatron world (TP x PP x inner DP), which
may differ from the other replicas'. The outer state lives in *lanes* (:mod:`.lanes`): a
partition of the model that depends on the model alone, lane ``j`` of --diloco-outer-ranks
hosted by one rank of each replica. Every lane host runs a torchft ``Manager`` on its
job's store; the host of lane j of each live replica meets the others' in a process group
torchft builds anew for each quorum, which a ``Lighthouse`` (``torchft_lighthouse``)
forms from the replicas asking at that moment. The outer exchange of :mod:`.exchange`
runs over that group through :func:`torchft_ops`; the other ranks of a replica learn what
each cycle decided from its rank 0 (lane 0's host).

One *cycle* per outer step, in program order on every live rank
(:meth:`ElasticCoordinator.open` ... :meth:`ElasticCoordinator.commit`):

1. ``start_quorum``: the replicas asking now form the quorum (a dead one is dropped once
   its heartbeat stops, a new one joins); torchft reconfigures the group and *heals* a
   replica that is behind, sending it, over its own transport, what
   :meth:`ElasticCoordinator.heal_state` names (per rank: the agreed parameters, the outer
   momentum, the iteration, the LR schedule's position). Who is behind is decided by
   torchft's step, which is set before each quorum to ``(iteration, outer steps applied)``
   (:func:`progress`): a replica that starts or restarts is behind in iterations, one that
   missed an outer update in outer steps.
2. one fixed-size all-gather of every participant's :class:`Fingerprint` (its replica id,
   a hash of everything that must match: model shape, layout, outer settings, channel
   sizes; its iteration; whether it joins or comes from a sync point; whether it healed;
   its share of the batch, measured speed and weight, from which every participant
   computes the same batch split, :mod:`.batch_split`):
   every rank of the cycle then knows the same participants, who contributes an outer
   gradient (a replica that just healed sends zeros and is left out of the mean), whether
   this cycle exchanges (some participant comes from a sync point) and at which
   iteration. A participant whose fingerprint differs from the established one (the most
   advanced participant's), or that shares another's replica id, is refused in one line;
   the others discard the cycle and go on.
3. the exchanges, then ``should_commit``: the AND over this replica's ranks of "nothing
   failed", so a failure anywhere in the cycle (a replica killed mid-exchange, a
   timeout) discards the cycle's outer step on every rank of the replica; torchft rebuilds
   the group at the next quorum and heals whoever committed less.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import urllib.error
import urllib.request
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.config import ConfigError
from loco_megatron.diloco.batch_split import Member
from loco_megatron.loco.collectives import CollectiveOps

ITERATION_SHIFT = 20
"""torchft's step is ``iteration << ITERATION_SHIFT | outer steps``: it heals whoever is
behind in either."""


def progress(iteration: int, outer_steps: int) -> int:
    return (iteration << ITERATION_SHIFT) | (outer_steps % (1 << ITERATION_SHIFT))


def check_lighthouse(address: str, timeout_s: float = 10.0) -> None:
    """ConfigError (one line) unless the Lighthouse answers at ``address`` (its status page)."""
    try:
        with urllib.request.urlopen(address, timeout=timeout_s):
            pass
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(f"--diloco-lighthouse: {address} cannot be reached ({reason}); start it with "
                          f"torchft_lighthouse --min_replicas 1 --bind [::]:PORT (docs/diloco.md)") from None


def config_hash(parts: list) -> int:
    """A signed 63-bit hash of ``parts``' text (every replica computes it alike)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 1


@dataclasses.dataclass
class Fingerprint:
    replica: int
    config: int
    """:func:`config_hash` of what every replica must share."""
    iteration: int
    joining: bool
    """True: this replica asked from its start-up (it trained nothing to exchange here)."""
    healed: bool = False
    """Set after the quorum: this replica took a live one's state (it sends zeros)."""
    cycles: int = 0
    """Cycles this job opened before this one: of two jobs with one replica id, both at
    the start of a run, the one that was there first stays."""
    samples: int = 0
    """Its share of each step's global batch over the interval that ends here (0: none
    agreed yet; :mod:`.batch_split`)."""
    speed: int = 0
    """Samples per second it trained over that interval, x 1000 (0: not measured)."""
    weight: int = 1000
    """--diloco-replica-weight x 1000."""
    lanes: int = 1
    """--diloco-outer-ranks (every replica must have the same)."""
    granule: int = 1
    """Its smallest batch share (micro batch x its data-parallel size)."""

    WIDTH = 11
    """int64 entries of :meth:`tensor`."""

    def tensor(self) -> torch.Tensor:
        return torch.tensor([self.replica, self.config, self.iteration, int(self.joining), int(self.healed),
                             self.cycles, self.samples, self.speed, self.weight, self.lanes, self.granule],
                            dtype=torch.int64)

    @classmethod
    def of(cls, row: torch.Tensor) -> "Fingerprint":
        r, c, it, j, h, n, s, v, w, lanes, g = (int(x) for x in row.tolist())
        return cls(r, c, it, bool(j), bool(h), n, s, v, w, lanes, g)

    def member(self) -> Member:
        """What the batch split needs of this participant."""
        return Member(self.replica, self.samples, self.speed / 1000, self.weight / 1000, self.granule)


@dataclasses.dataclass
class Cycle:
    """One outer step's quorum, as every live rank of it sees it."""

    world: int
    """Replicas taking part."""
    rank: int
    """This replica's place among them (torchft's participating rank)."""
    participants: list[Fingerprint]
    """In participating-rank order."""
    exchanging: bool
    """Some participant came from a sync point: the cycle exchanges the fragments that
    start at :attr:`iteration`."""
    iteration: int
    healed: Optional[dict] = None
    """The state this replica took from a live one (:meth:`ElasticCoordinator.heal_state`'s)."""
    refused: str = ""
    """Non-empty: a participant does not fit the run (the line that says why)."""
    refused_ranks: set = dataclasses.field(default_factory=set)
    """The participating ranks of the participants refused."""

    @property
    def contributors(self) -> int:
        """Participants whose outer gradient counts (not just healed: they send zeros)."""
        return sum(1 for p in self.participants if not p.healed)

    @property
    def replicas(self) -> list[int]:
        return sorted(p.replica for p in self.participants)


def torchft_ops(coordinator: "ElasticCoordinator") -> CollectiveOps:
    """LoCo's :class:`CollectiveOps` on ``coordinator``'s torchft process group (torch's
    signatures; the group and the Manager are looked up at each call: they exist from the
    first cycle on).

    torchft's reconfigurable groups sit outside torch.distributed's registry and forward
    only some collectives: the all-gather goes through the coalesced entry point, the rank
    and size come from the Manager. An error at launch or wait is reported to the Manager
    (the cycle will not commit) and the operation then reads as done; after an error every
    later one of the cycle is a no-op (as torchft's own allreduce does), so a failed cycle
    ends quickly on every rank instead of waiting out one timeout per collective."""
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
            return True

    def run(launch: Callable, async_op: bool):
        if manager.errored():
            return Done() if async_op else None
        try:
            work = Guarded(launch())
        except Exception as e:  # noqa: BLE001
            manager.report_error(e)
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


class ElasticCoordinator:
    """This rank's torchft Manager and the cycles of :mod:`this module <.elastic>`.

    ``replica``: --diloco-replica-id; ``rank``: this rank in its job; ``lane``/``lanes``:
    the lane it hosts (:mod:`.lanes`; None: none) of --diloco-outer-ranks; ``control``: a
    gloo group over the job; ``store``: (address, port) of the job's TCPStore (torchrun's
    MASTER_ADDR/PORT: the address other replicas reach it by); ``device``: where the group's
    collectives run; ``heal_state()``: what a live replica sends one that heals (tensors
    served by reference until the cycle commits, so they must not change before
    :meth:`commit`); ``log``: one line (rank 0 of the job prints); ``torchft_log``: the log
    filter of torchft's Rust side (RUST_LOG syntax,
    :attr:`loco_megatron.cli.LaunchEnv.torchft_log`)."""

    def __init__(self, lighthouse: str, replica: int, expected: int, min_replicas: int, rank: int,
                 lane: Optional[int], lanes: int, store: tuple[str, int], control, device: torch.device,
                 quorum_timeout_s: float, exchange_timeout_s: float, log: Callable[[str], None],
                 torchft_log: str = "error"):
        self.lighthouse, self.replica, self.min_replicas = lighthouse, replica, min_replicas
        self.expected = expected
        """--diloco-replicas: the replicas the run expects (the channels' first layout)."""
        self.rank, self.store, self.device = rank, store, device
        self.lane, self.lanes = lane, lanes
        """The lane this rank hosts (None: none; it then runs no Manager) and --diloco-outer-ranks."""
        self.control = control
        """A gloo group over this job's ranks: rank 0 (lane 0's host) tells the others what
        each cycle decided (they take part in no quorum themselves)."""
        self.quorum_timeout = datetime.timedelta(seconds=quorum_timeout_s)
        self.exchange_timeout = datetime.timedelta(seconds=exchange_timeout_s)
        self.log, self.torchft_log = log, torchft_log
        self.manager = self.pg = None
        self.ops = torchft_ops(self)
        """The collectives of the outer exchange, on the torchft group of the open cycle."""
        self.heal_state: Callable[[], dict] = dict
        self._healed: Optional[dict] = None
        self.cycle: Optional[Cycle] = None
        """The cycle open now (between :meth:`open` and :meth:`commit`), else None."""
        self.live: list[int] = []
        """Replica ids of the last cycle's participants."""
        self.took_part = 0
        """Outer steps this replica's gradient went into (committed cycles it contributed to)."""
        self.committed = 0
        """Committed cycles that exchanged, while this replica was live."""
        self.opened = 0
        """Cycles this job opened (its seniority: :attr:`Fingerprint.cycles`)."""

    def start(self) -> None:
        """Create the Manager (and its group): heartbeats start, so call it right before the
        first quorum, when this replica is ready to ask (a healthy replica that is not asking
        holds the others' quorum back)."""
        import logging
        import os
        import sys

        # torchft's Rust side reads RUST_LOG once, when its extension is first imported: set
        # before that import, or every quorum prints its INFO lines on every rank.
        if "torchft._torchft" not in sys.modules:
            os.environ["RUST_LOG"] = self.torchft_log
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        # torchft logs every reconfiguration and flight-recorder note; its errors still show.
        logging.getLogger("torchft").setLevel(logging.ERROR)
        if self.device.type == "cuda":
            from torchft import ProcessGroupNCCL

            self.pg = ProcessGroupNCCL(timeout=self.exchange_timeout)
        else:
            self.pg = ProcessGroupGloo(timeout=self.exchange_timeout)
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._take, state_dict=lambda: self.heal_state(),
            min_replica_size=self.min_replicas, use_async_quorum=False, init_sync=False,
            replica_id=f"replica{self.replica}", lighthouse_addr=self.lighthouse,
            store_addr=self.store[0], store_port=self.store[1], rank=self.lane, world_size=self.lanes,
            timeout=self.exchange_timeout, quorum_timeout=self.quorum_timeout,
            connect_timeout=datetime.timedelta(seconds=30),
            # The heal travels over the quorum's own group: no port of its own to open between sites.
            checkpoint_transport=PGTransport(self.pg, self.exchange_timeout, self.device))

    def _take(self, state: dict) -> None:  # torchft's load_state_dict: applied after the quorum
        self._healed = state

    # -- one cycle -------------------------------------------------------------------------
    def open(self, mine: Fingerprint, outer_steps: int) -> Cycle:
        """Collective over the quorum (lane hosts) and this job (every rank): ``start_quorum``
        (healing this replica if it is behind), the fingerprint all-gather, then rank 0's
        view of the cycle to every rank of the job (see the module docstring)."""
        cycle = self._open_lane(mine, outer_steps) if self.lane is not None else None
        # (every lane's quorum is the replica's: torchft forms one per replica group)
        shared = [None if cycle is None else
                  (dataclasses.replace(cycle, healed=None), None if cycle.healed is None else
                   {k: v for k, v in cycle.healed.items() if not isinstance(v, dict)})]
        dist.broadcast_object_list(shared, src=0, group=self.control)
        head, progress = shared[0]
        if progress is not None and self.lane is not None and (cycle is None or cycle.healed is None):
            raise RuntimeError("DiLoCo: lane 0 healed and this lane did not (torchft healed the replica's ranks apart)")
        healed = None if progress is None else (cycle.healed if self.lane is not None else dict(progress))
        cycle = dataclasses.replace(head, healed=healed)
        if not cycle.refused:
            self._say_membership(cycle)
        self.cycle = cycle
        return cycle

    def _open_lane(self, mine: Fingerprint, outer_steps: int) -> Cycle:
        if self.manager is None:
            self.start()
        m = self.manager
        m.load_state_dict({"step": progress(mine.iteration, outer_steps), "batches_committed": 0})
        self._healed = None
        m.start_quorum()
        mine.healed, mine.cycles = self._healed is not None, self.opened
        self.opened += 1
        world, rank = max(m.num_participants(), 1), m.participating_rank() or 0
        rows = torch.zeros(world * Fingerprint.WIDTH, dtype=torch.int64)
        work = self.ops.all_gather_into_tensor(rows, mine.tensor())
        if work is not None:
            work.wait()
        if m.errored():  # the group could not be built or a participant died: nothing to agree on
            participants = [mine]
        else:
            participants = [Fingerprint.of(r) for r in rows.view(world, Fingerprint.WIDTH)]
        exchanging = any(not p.joining for p in participants)
        live = [p for p in participants if not p.joining] or participants
        iteration = max(p.iteration for p in live)
        cycle = Cycle(world, rank, participants, exchanging, iteration, self._healed)
        cycle.refused, cycle.refused_ranks = self._refusal(cycle)
        return cycle

    @staticmethod
    def _refusal(cycle: Cycle) -> tuple[str, set[int]]:
        """(the line, the participating ranks refused) for participants that do not fit:
        another fingerprint than the established one (the most advanced participant's:
        furthest in iterations, then trained, then longest in the run, then the lowest
        replica id), or a replica id another participant, more advanced,
        already has. ('', empty) when all fit. Every rank computes the same from the same
        fingerprints."""
        ps = cycle.participants

        def advanced(i: int) -> tuple:
            return ps[i].iteration, not ps[i].joining, ps[i].cycles, -ps[i].replica, -i

        ref = max(range(len(ps)), key=advanced)
        refused = {i for i, p in enumerate(ps) if p.config != ps[ref].config or p.lanes != ps[ref].lanes}
        if refused:
            bad = ps[min(refused)]
            if bad.lanes != ps[ref].lanes:
                return (f"--diloco-replica-id {bad.replica}: --diloco-outer-ranks {bad.lanes} differs from the run's "
                        f"{ps[ref].lanes} (replica {ps[ref].replica}'s; every replica must exchange over as many "
                        f"ranks)", refused)
            return (f"--diloco-replica-id {bad.replica}: its model shape or outer settings differ from the run's "
                    f"(replica {ps[ref].replica}'s)", refused)
        ids: dict[int, list[int]] = {}
        for i, p in enumerate(ps):
            ids.setdefault(p.replica, []).append(i)
        for replica, ranks in sorted(ids.items()):
            if len(ranks) > 1:
                keep = max(ranks, key=advanced)
                return (f"--diloco-replica-id {replica}: another live job already runs as replica {replica} (each "
                        f"replica id once)", set(ranks) - {keep})
        return "", set()

    @staticmethod
    def refused_here(cycle: Cycle) -> bool:
        """Whether the refusal is of this replica (it then ends with the line)."""
        return cycle.rank in cycle.refused_ranks

    def _say_membership(self, cycle: Cycle) -> None:
        now = cycle.replicas
        if now != self.live:
            joined = sorted(set(now) - set(self.live))
            left = sorted(set(self.live) - set(now))
            what = "; ".join([*(f"replica {r} joined" for r in joined), *(f"replica {r} left" for r in left)])
            self.log(f"DiLoCo: {what} ({len(now)} live: {', '.join(map(str, now))})")
        self.live = now

    def discard(self, reason: Exception) -> None:
        """This cycle must not commit (reported to torchft: its should_commit is False)."""
        if self.manager is not None:
            self.manager.report_error(reason)

    def errored(self):
        """What failed in the open cycle (torchft's), None when nothing or off the hosts."""
        return self.manager.errored() if self.manager is not None else None

    def commit(self) -> bool:
        """Close the open cycle: True when it commits (every lane of this replica saw no
        failure and enough replicas took part); the same on every rank of the replica
        (torchft's should_commit agrees over the lanes; rank 0 tells the others)."""
        cycle, self.cycle = self.cycle, None
        flag = [bool(self.manager.should_commit()) if self.manager is not None else None]
        dist.broadcast_object_list(flag, src=0, group=self.control)
        ok = bool(flag[0])
        if ok and cycle is not None and cycle.exchanging:
            self.committed += 1
            mine = next((p for p in cycle.participants if p.replica == self.replica), None)
            self.took_part += int(mine is not None and not mine.healed)
        return ok

    @property
    def live_replicas(self) -> int:
        return len(self.live)

    # -- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"took_part": self.took_part, "committed": self.committed}

    def load_state_dict(self, sd: Optional[dict]) -> None:
        if sd:
            self.took_part, self.committed = int(sd["took_part"]), int(sd["committed"])

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
