"""This rank's torchft Manager and the protocol of one cycle (:meth:`ElasticCoordinator.open`
... :meth:`ElasticCoordinator.close`), the same program order on every rank of every replica.

1. ``start_quorum`` on the lane hosts: the replicas asking now form the quorum (a dead one
   is dropped once its heartbeat stops, a new one joins); torchft reconfigures the group
   and *heals* a replica that is behind (:func:`~.cycle.progress`: iteration, outer steps),
   sending it, over its own transport, the live replica's :meth:`heal_state`. A lighthouse
   that dies and comes back while a quorum is asked for is asked again (torchft's quorum
   retries, about one per second) instead of being waited out.
2. one fixed-size all-gather of every participant's :class:`~.cycle.Fingerprint` on each
   lane; each lane host plans the cycle from its lane's rows (:func:`~.cycle.plan`).
3. one all-gather over this job's ranks (a gloo *control* group) of every lane's outcome:
   every rank then decides the same (a quorum timeout ends the run in one line, a failed
   lane discards the cycle, the lanes' plans combine into the replica's). No rank reads a
   clock, polls or catches an exception to choose a collective: exceptions become values
   before this gather, and the gather decides.
4. the *go* vote: a MIN over the participants (each lane's torchft group) and then over the
   job, so one participant's failure stops every participant before any exchange.
5. the cycle's exchanges (the step's), then :meth:`close`: torchft's ``should_commit``
   (the AND over this replica's lanes), the *commit* vote over the participants and the job.
   What the cycle changes is applied only when it commits; a participant whose commit
   differs (a vote that failed half-way) is behind at the next quorum and heals there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import re
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.config import brief
from loco_megatron.diloco.elastic.cycle import REFUSE, Cycle, Fingerprint, combine, progress
from loco_megatron.diloco.elastic.lighthouse import describe_outage, ended_without, read_status
from loco_megatron.diloco.elastic.ops import fresh_groups, torchft_ops, vote
from loco_megatron.diloco.elastic.waits import WaitNotice
from loco_megatron.failures import RunAborted

TIMEOUT, ERROR, OK, OFF = "timeout", "error", "ok", "off"
"""A lane's outcome in step 3 (OFF: this rank hosts no lane)."""


class ElasticCoordinator:
    """``replica``: --diloco-replica-id; ``rank``: this rank in its job; ``lane``/``lanes``:
    the lane it hosts (:mod:`.lanes`; None: none) of --diloco-outer-ranks; ``control``: a
    gloo group over the job; ``store``: (address, port) of the job's TCPStore (torchrun's
    MASTER_ADDR/PORT: the address other replicas reach it by); ``device``: where the group's
    collectives run; ``log``: one line (rank 0 of the job prints); ``torchft_log``: the log
    filter of torchft's Rust side (RUST_LOG syntax, :attr:`loco_megatron.cli.LaunchEnv.torchft_log`).
    ``heal_state()`` (set by the step): what a live replica sends one that heals, a
    ``{"meta": builtins, ...tensors}`` dict (:meth:`open`; tensors served by reference,
    unchanged until the cycle closes). ``faults(phase)`` (tests only):
    an injected failure of the collective of ``phase``, "raise" or "lost" (:mod:`.ops`)."""

    def __init__(self, lighthouse: str, replica: int, expected: int, rank: int, lane: Optional[int], lanes: int,
                 store: tuple[str, int], control, device: torch.device, quorum_timeout_s: float,
                 exchange_timeout_s: float, log: Callable[[str], None], torchft_log: str = "error"):
        self.lighthouse, self.replica, self.expected = lighthouse, replica, expected
        self.rank, self.store, self.device = rank, store, device
        self.lane, self.lanes = lane, lanes
        self.control = control
        self.quorum_timeout = datetime.timedelta(seconds=quorum_timeout_s)
        self.exchange_timeout = datetime.timedelta(seconds=exchange_timeout_s)
        self.log, self.torchft_log = log, torchft_log
        self.manager = self.pg = None
        self.phase = ""
        """What the cycle is at ("quorum", "fingerprint", "go", "agreement", "outer",
        "commit"): the collective :attr:`faults` inject into, what :attr:`waiting` names."""
        self.iteration = 0
        """The iteration of the cycle open (or being asked for)."""
        self.members: list[int] = []
        """The replicas of the cycle open (until its plan: those of the last cycle)."""
        self.waiting = WaitNotice(log, lambda: (self.phase, self.iteration, self.members),
                                  lambda: read_status(lighthouse, timeout_s=5.0, tries=1)) \
            if rank == 0 else contextlib.nullcontext()
        """``with`` around what waits on other replicas: said while it lasts (rank 0 of the job)."""
        self.faults: Optional[Callable[[str], Optional[str]]] = None
        self.ops = torchft_ops(self)
        """The collectives of the outer exchange, on the torchft group of the open cycle."""
        self.heal_state: Callable[[], dict] = dict
        self._healed: Optional[dict] = None
        self.grouped = False
        """Whether this lane's group is usable in this cycle: configured by its quorum, and no
        collective on it failed since (a failed one may leave it broken: the votes then
        answer no without waiting on it)."""
        self.reason = ""
        """Why the open cycle cannot go on ('' when it can)."""
        self.live: list[int] = []
        """Replica ids of the last committed cycle's participants."""
        self.took_part = 0
        """Outer steps this replica's gradient went into (committed cycles it contributed to)."""
        self.committed = 0
        """Committed cycles that exchanged an outer step, while this replica was live."""
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

        # torchft logs every reconfiguration and flight-recorder note, and the stack of each
        # failure it recovers from (a peer gone mid-collective): the cycle says what failed.
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        if self.device.type == "cuda":
            from torchft import ProcessGroupNCCL

            self.pg = fresh_groups(ProcessGroupNCCL)(timeout=self.exchange_timeout)
        else:
            self.pg = fresh_groups(ProcessGroupGloo)(timeout=self.exchange_timeout)
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._take, state_dict=lambda: self.heal_state(),
            # --diloco-min-replicas is the plan's (a withheld outer step still commits the
            # membership and the split); torchft's own check would discard the whole cycle.
            min_replica_size=1, use_async_quorum=False, init_sync=False,
            replica_id=f"replica{self.replica}", lighthouse_addr=self.lighthouse,
            store_addr=self.store[0], store_port=self.store[1], rank=self.lane, world_size=self.lanes,
            timeout=self.exchange_timeout, quorum_timeout=self.quorum_timeout,
            connect_timeout=datetime.timedelta(seconds=30),
            # A lighthouse that failed mid-quorum is asked again about once a second (torchft
            # sleeps timeout / (retries + 1) between tries), until the quorum timeout.
            quorum_retries=max(1, int(self.quorum_timeout.total_seconds())),
            # The heal travels over the quorum's own group: no port of its own to open between sites.
            checkpoint_transport=PGTransport(self.pg, self.exchange_timeout, self.device))

    def _take(self, state: dict) -> None:  # torchft's load_state_dict: applied after the quorum
        if self.faults is not None and self.faults("heal") == "raise":
            raise RuntimeError("injected failure of the heal")
        self._healed = state

    # -- one cycle -------------------------------------------------------------------------
    def open(self, iteration: int, outer_steps: int, fingerprint: Callable[[Optional[dict]], Fingerprint],
             plan: Callable[[list[Fingerprint], int, Optional[dict]], Cycle],
             accept: Callable[[Cycle], str] = lambda cycle: "") -> Optional[Cycle]:
        """Steps 1-4 of the module docstring, collective over the quorum and this job.
        ``fingerprint(healed)``: this lane's fingerprint (``healed``: the state it took in
        the quorum, or None); ``plan(participants, rank, healed)``: the lane's cycle;
        ``accept(cycle)``: '' when this rank can apply the cycle (its healed state), else
        why not (the go vote then fails on every rank). Returns the replica's cycle (the
        same on every rank), or None when it cannot go on (broken somewhere: :meth:`close`
        with False follows). RunAborted (every rank alike) when no quorum formed within
        --diloco-quorum-timeout-s.

        A heal's state (:attr:`heal_state`'s dict) is ``{"meta": builtins, ...tensors}``: its
        ``meta`` reaches every rank of the job (through the control group's gather, from
        lane 0's host, and only when every host took the same), its tensors stay on the
        lane host that received them; ``cycle.healed`` is the whole dict on a host and
        ``{"meta": meta}`` elsewhere, so every rank knows every field of it."""
        status, lane_cycle = (OFF, ""), None
        self.iteration, self.members, self.phase = iteration, list(self.live), "quorum"
        if self.lane is not None:
            status, lane_cycle = self._open_lane(iteration, outer_steps, fingerprint, plan)
        healed = lane_cycle.healed if lane_cycle is not None else None
        shared = (status, None if lane_cycle is None else dataclasses.replace(lane_cycle, healed=None),
                  None if healed is None else healed["meta"])
        table: list = [None] * dist.get_world_size(self.control)
        dist.all_gather_object(table, shared, group=self.control)
        self.opened += 1
        hosts = [row for row in table if row[0][0] != OFF]
        timeouts = [row[0][1] for row in hosts if row[0][0] == TIMEOUT]
        if timeouts:  # (every rank raises the same line; rank 0 reads the lighthouse to say why)
            why = [describe_outage(self.lighthouse) if self.rank == 0 else ""]
            dist.broadcast_object_list(why, src=0, group=self.control)
            raise RunAborted(f"DiLoCo: no quorum of replicas formed within --diloco-quorum-timeout-s "
                             f"({self.quorum_timeout.total_seconds():.0f} s) at iteration {iteration}: {why[0]}")
        broken = [row[0][1] for row in hosts if row[0][0] != OK]
        cycle = None if broken else combine([row[1] for row in hosts])
        if cycle is not None:
            meta = table[0][2]  # (lane 0's host is rank 0)
            if any(row[2] != meta for row in hosts):
                cycle = None  # some lanes healed and others did not, or from other states: nothing of it may be kept
            elif meta is not None:
                cycle.healed = healed if self.lane is not None else {"meta": meta}
        self.reason = broken[0] if broken else ("the lanes disagree" if cycle is None else "")
        if cycle is not None and cycle.action == REFUSE:
            return cycle  # (every participant knows: no vote; the refused one ends, the others discard)
        if cycle is not None:
            self.reason = accept(cycle)  # (the same healed state on every rank: mostly the same verdict)
            self.members = cycle.replicas
        self.phase = "go"
        go = self._agree(cycle is not None and not self.reason)  # the go vote
        if not go and cycle is not None and not self.reason:
            self.reason = "another replica could not go on"
        return cycle if go else None

    def _open_lane(self, iteration: int, outer_steps: int, fingerprint: Callable, plan: Callable):
        """Steps 1-2 on a lane host: ``(status, line)`` and the lane's cycle (None unless OK)."""
        if self.manager is None:
            self.start()
        m = self.manager
        self._healed, self.grouped = None, False
        try:
            m.load_state_dict({"step": progress(iteration, outer_steps), "batches_committed": 0})
            m.start_quorum()
        except TimeoutError as e:
            return (TIMEOUT, brief(e)), None
        except Exception as e:  # noqa: BLE001 - a quorum that failed: this cycle is discarded
            return (ERROR, f"the quorum failed ({brief(e)})"), None
        error = m.errored()
        if error is not None:  # the group could not be configured, or the heal failed
            return (ERROR, brief(error.original_exception)), None
        try:
            size = self.pg.size()
        except RuntimeError:  # (not configured: no group at all)
            size = -1
        if size != max(m.num_participants(), 1):
            # torchft kept the last group because the quorum id did not change, but a restarted
            # lighthouse numbers its quorums anew: this id names other members. Failing the
            # cycle (a commit failure) makes the lighthouse give the next quorum a new id.
            m.report_error(RuntimeError("the quorum's group is stale (the lighthouse restarted)"))
            return (ERROR, "the quorum's group is stale (the lighthouse restarted)"), None
        self.grouped = True
        world, rank = max(m.num_participants(), 1), m.participating_rank() or 0
        try:
            mine = fingerprint(self._healed)
        except ValueError as e:  # (what it took cannot be this replica's: the cycle fails on every rank)
            m.report_error(e)
            self.grouped = False  # (no gather issued: the peers' waits on it time out)
            return (ERROR, brief(e)), None
        mine.cycles = self.opened
        # (on the group's device: NCCL's collectives take CUDA tensors only)
        rows = torch.zeros(world * Fingerprint.WIDTH, dtype=torch.int64, device=self.device)
        self.phase = "fingerprint"
        work = self.ops.all_gather_into_tensor(rows, mine.tensor().to(self.device))
        if work is not None:
            work.wait()
        error = m.errored()
        if error is not None:  # (the gather failed, or was lost here: the ops keep ``grouped`` up to date)
            return (ERROR, brief(error.original_exception)), None
        participants = [Fingerprint.of(r) for r in rows.cpu().view(world, Fingerprint.WIDTH)]
        return (OK, ""), plan(participants, rank, self._healed)

    def _agree(self, yes: bool) -> bool:
        """A vote (:func:`.ops.vote`) over the participants on each lane, then the MIN over
        this job: the same answer on every rank of this replica."""
        if self.lane is not None:
            voted = vote(self.pg, yes, self.device) if self.grouped else None
            self.grouped = voted is not None and self.grouped
            yes = bool(voted)
        flag = torch.tensor([int(yes)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control)
        return bool(flag.item())

    @staticmethod
    def refused_here(cycle: Cycle) -> bool:
        """Whether the refusal is of this replica (it then ends with the line)."""
        return cycle.rank in cycle.refused_ranks

    def close(self, ok: bool, refused: bool = False) -> bool:
        """Close the open cycle (every rank; collective): True when it commits. ``ok``: this
        replica could go through with it (nothing failed here); the result is also False when
        any lane of this replica or any participant saw a failure (torchft's ``should_commit``,
        then the commit vote). ``refused``: a cycle every participant discards for a refused
        participant (no vote: the refused one has left)."""
        if self.lane is not None:
            if not ok and self.manager.errored() is None:
                self.manager.report_error(RuntimeError(self.reason or "discarded"))
            try:
                ok = bool(self.manager.should_commit())
            except Exception:  # noqa: BLE001 - a lane that cannot say: not committed
                ok = False
        self.phase = "commit"
        if refused:
            flag = torch.tensor([int(ok)], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control)
            return False
        committed = self._agree(ok)  # the commit vote
        if not committed and not self.errored():
            self.reason = "another replica's exchange failed"
        return committed

    def errored(self) -> str:
        """What failed in the open cycle, in words ('' when nothing is known here)."""
        error = self.manager.errored() if self.manager is not None else None
        if error is None:
            return self.reason
        # (gloo's messages start with the source file: "[.../unbound_buffer.cc:129] Timed out ...")
        return re.sub(r"^(\w+: )\[[^\]]*\] ", r"\1", brief(error.original_exception))

    def say_membership(self, cycle: Cycle) -> None:
        """One line when the replicas of a committed cycle are not the last one's."""
        now = cycle.replicas
        if now != self.live:
            joined = sorted(set(now) - set(self.live))
            left = sorted(set(self.live) - set(now))
            what = "; ".join([*(f"replica {r} joined" for r in joined), *(f"replica {r} left" for r in left)])
            self.log(f"DiLoCo: {what} ({len(now)} live: {', '.join(map(str, now))})")
        self.live = now

    def decide(self, value):
        """Rank 0's ``value`` on every rank of the job (a decision made from rank 0's clock or
        files: the others follow it, never their own)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def run_ended(self, train_iters: int) -> str:
        """Rank 0's :func:`~.lighthouse.ended_without` (it reads the lighthouse's status page),
        for every rank of the job: the line to end with when the run reached
        ``train_iters`` in a quorum this replica was not in, else ''."""
        return self.decide(ended_without(self.lighthouse, self.replica, train_iters) if self.rank == 0 else "")

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
