"""Elastic DiLoCo's seams replayed through the real coordinator and outer step, torchft stubbed.

Each replica is a job of its own (a gloo world of 2 ranks: rank 0 hosts the one lane, rank 1
hosts none), as under torchrun; every rank runs the real
:class:`~loco_megatron.diloco.elastic.coordinator.ElasticCoordinator` (its control-group
gather, go and commit votes) and the real
:class:`~loco_megatron.diloco.elastic.step.ElasticOuterStep` (heal, agreement, batch split,
4-bit outer exchange with error buffers, checkpoints). Only torchft is replaced, by a
scripted lighthouse over one TCPStore (:class:`ScriptManager`, :class:`StoreGroup`): the
quorum of each round is the replicas the script makes ask in it, a replica behind the
furthest (torchft's step) is healed from the lowest id among the furthest with its
``state_dict`` sent through the store, and the group's collectives are exchanges through
the store, in rank order.

A *script* gives, per round, each replica's action: ``train`` (its steps up to its next sync
point, then that cycle), ``stall`` (one step, which closes a delayed exchange, then nothing
this round: it misses the round's quorum and is behind at its next one), ``die`` (one step,
then its state is gone), ``dead``, ``restart:fresh`` or ``restart:K`` (a new job, from its
own checkpoint of round K, that joins in this round's quorum); flags ``+save`` (a checkpoint
right after the sync point's cycle: under a delay or eager updates, with the exchange in
flight) and
``+lose`` (this replica's outer exchange in the round's cycle is lost: the cycle is
discarded everywhere). Every rank reports, after each round it acted in, what it holds:
its iteration, outer steps, split, share, the share its data iterator reads, the replicas
of its last cycle and (lane host) the hash of its outer state; under eager updates (script
key ``eager``) also the means of what it sent last, of its eager part and of its
parameters ahead of the agreed ones.
"""

from __future__ import annotations

import io
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

GBS = 12
"""Each step's global batch (shares are whole granules of 2)."""
N = 600
"""Elements of each replica's model (one lane, one fragment)."""


class Done:
    def wait(self, timeout=None):
        return True


class StoreGroup:
    """torchft's process group, faked over a TCPStore: each collective of a configured group
    puts this rank's tensor under ``<prefix>/<op>/<rank>``, waits for every rank's and
    computes the result from them in rank order (every rank the same)."""

    def __init__(self, store, timeout: float):
        self.store, self.timeout = store, timeout
        self.prefix, self.rank, self.world, self.op = "", 0, 0, 0

    def configure(self, prefix: str, rank: int, world: int) -> None:
        self.prefix, self.rank, self.world, self.op = prefix, rank, world, 0

    def errored(self):  # (torchft's groups: the error of a collective aborted without raising)
        return None

    def size(self) -> int:
        if not self.world:
            raise RuntimeError("not configured")
        return self.world

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        key = f"{self.prefix}/{self.op}"
        self.op += 1
        buf = io.BytesIO()
        torch.save(t.detach().cpu().clone(), buf)
        self.store.set(f"{key}/{self.rank}", buf.getvalue())
        keys = [f"{key}/{r}" for r in range(self.world)]
        self.store.wait(keys, __import__("datetime").timedelta(seconds=self.timeout))
        return [torch.load(io.BytesIO(self.store.get(k)), weights_only=True) for k in keys]

    def allreduce(self, tensors, opts):
        from torch.distributed.distributed_c10d import ReduceOp

        t = tensors[0]
        rows = self._exchange(t)
        out = rows[0].clone()
        for row in rows[1:]:
            out = torch.minimum(out, row) if opts.reduceOp == ReduceOp.MIN else out + row
        t.copy_(out)
        return Done()

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        outputs[0].copy_(torch.cat([r.reshape(-1) for r in self._exchange(inputs[0])]).view_as(outputs[0]))
        return Done()

    def allgather(self, output_lists, inputs, opts):
        for out, row in zip(output_lists[0], self._exchange(inputs[0])):
            out.copy_(row)
        return Done()

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        assert not output_split_sizes and not input_split_sizes, "even splits only"
        rows = self._exchange(input)
        piece = input.numel() // self.world
        output.copy_(torch.cat([r.reshape(-1)[self.rank * piece:(self.rank + 1) * piece] for r in rows]).view_as(output))
        return Done()


class ScriptManager:
    """torchft's Manager, faked: the quorum of (history, round, attempt) is the replicas the
    script makes ask in that round (``members``); steps and the heal go through the store."""

    def __init__(self, store, replica: int, pg: StoreGroup, load_state_dict, state_dict, timeout: float):
        # (the round's members and the heal are waited for at least a minute: a short exchange
        # timeout, which a script may set to discard cycles quickly, must not fail a quorum
        # whose members are still training towards it)
        self.store, self.replica, self.pg, self.timeout = store, replica, pg, max(timeout, 60.0)
        self._load, self._state = load_state_dict, state_dict
        self.step = 0
        self.where = ("", [])  # (history/round key, members of the round's quorum)
        self.attempt = 0
        self.error = None
        self.rank = self.world = 0

    def at_round(self, key: str, members: list[int]) -> None:
        self.where, self.attempt = (key, sorted(members)), 0

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])

    def start_quorum(self) -> None:
        import datetime

        key, members = self.where
        q = f"{key}/a{self.attempt}"
        self.attempt += 1
        self.error = None
        self.store.set(f"{q}/step/{self.replica}", str(self.step))
        self.store.wait([f"{q}/step/{r}" for r in members], datetime.timedelta(seconds=self.timeout))
        steps = {r: int(self.store.get(f"{q}/step/{r}")) for r in members}
        furthest = max(steps.values())
        source = min(r for r in members if steps[r] == furthest)
        behind = furthest > 0 and any(s < furthest for s in steps.values())  # (init_sync False: none at step 0)
        if behind and self.replica == source:
            buf = io.BytesIO()
            torch.save(self._state(), buf)
            self.store.set(f"{q}/heal", buf.getvalue())
        self.rank, self.world = members.index(self.replica), len(members)
        self.pg.configure(f"{q}/pg", self.rank, self.world)
        if behind and steps[self.replica] < furthest:
            self.store.wait([f"{q}/heal"], datetime.timedelta(seconds=self.timeout))
            self._load(torch.load(io.BytesIO(self.store.get(f"{q}/heal")), weights_only=False))

    def errored(self):
        return self.error

    def report_error(self, e: Exception) -> None:
        if self.error is None:
            self.error = type("Errored", (), {"original_exception": e})()

    def should_commit(self) -> bool:  # (one lane per replica: this lane's own verdict)
        return self.error is None

    def num_participants(self) -> int:
        return self.world

    def participating_rank(self):
        return self.rank

    def shutdown(self, wait: bool = False) -> None:
        pass


def _coordinator_class():
    from loco_megatron.diloco.elastic.coordinator import ElasticCoordinator

    class ReplayCoordinator(ElasticCoordinator):
        """The real coordinator with :class:`ScriptManager` for torchft's Manager."""

        def start(self) -> None:
            self.pg = StoreGroup(self.script_store, self.exchange_timeout.total_seconds())
            self.manager = ScriptManager(self.script_store, self.replica, self.pg, self._take,
                                         lambda: self.heal_state(), self.exchange_timeout.total_seconds())
            self.manager.at_round(*self.script_round)

    return ReplayCoordinator


class Replica:
    """One rank of one replica job: its model, data share and outer step."""

    def __init__(self, script: dict, replica: int, rank: int, control, store, logs: list):
        from loco_megatron.diloco.elastic.lanes import NoLane
        from loco_megatron.diloco.elastic.replica import Rules, SplitSettings
        from loco_megatron.diloco.elastic.split import fixed_share
        from loco_megatron.diloco.elastic.step import ElasticOuterStep
        from loco_megatron.diloco.exchange import OuterChannel
        from loco_megatron.diloco.outer import ShardViews
        from loco_megatron.diloco.schedule import FragmentSchedule

        self.replica, self.rank, self.script = replica, rank, script
        replicas, mode = script["replicas"], script["mode"]
        coordinator = _coordinator_class()("", replica, replicas, rank, 0 if rank == 0 else None, 1, ("", 0),
                                           control, torch.device("cpu"), float(script.get("quorum_timeout", 60)),
                                           float(script.get("exchange_timeout", 60)), logs.append)
        coordinator.script_store, coordinator.script_round = store, ("", [])
        self.coordinator = coordinator
        torch.manual_seed(1234)  # (every replica starts from the same weights)
        self.param = torch.randn(N) if rank == 0 else torch.empty(0)
        self.iteration = 0
        self.data_share = (0, GBS)  # what the data iterator reads (as MicroBatchIterator: the batch, until set)
        self.laid = 0  # channels laid anew since this job started (the first lay included)

        def relay(key: str, world: int):
            if world is not None:
                self.laid += 1
            if rank != 0:
                return NoLane(world)
            return OuterChannel(N, None, 4, 64, ops=coordinator.ops, kernels="torch", stream_rank=replica,
                                world=world, name=key)

        channels = {"fragment0": (ShardViews([self.param]), relay("fragment0", None), 0, 0)}
        initial = fixed_share(replica, replicas, GBS) if mode == "fixed" else None
        split = SplitSettings(mode, GBS, 2, float(script["weights"][str(replica)]), initial, self._slowest)
        eager = bool(script.get("eager"))
        kind, extra = ElasticOuterStep, {}
        if eager:  # (--diloco-eager: the exchange of a sync's cycle closes at the next sync)
            from loco_megatron.diloco.elastic.eager import ElasticEagerStep

            kind, extra = ElasticEagerStep, {"naive": bool(script.get("naive"))}
        self.outer = type("ReplayStep", (kind,), {"recheck_s": 0.05, "retry_s": 0.05})(
            channels, FragmentSchedule(script["H"], 1, script["tau"], eager), 0.7, 0.9,
            0.5 if script["tau"] else 0.0, lambda update: update(0), lambda work: None, lambda: None, logs.append,
            coordinator=coordinator, replica=replica, config_hash=7, relay=relay, split=split,
            rules=Rules(replicas, 1, 2), **extra)
        if initial is not None:
            self._set_share(initial.offset, initial.samples)
        self.heals = 0  # heals taken since this job started
        heal = self.outer._heal

        def counted(cycle) -> None:
            self.heals += 1
            heal(cycle)

        self.outer._heal = counted

    def bind(self) -> None:
        """What the trainer binds after its checkpoint is loaded (training/setup.py's bind_heal)."""
        self.outer.bind_progress(lambda: {"iteration": self.iteration, "scheduler_steps": self.iteration},
                                 self._take_progress, self._set_share)

    @staticmethod
    def _slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def _take_progress(self, state: dict, kept: bool) -> None:
        self.iteration = int(state["iteration"])

    def _set_share(self, offset: int, samples: int) -> None:
        self.data_share = (offset, samples)

    def at_round(self, key: str, members: list[int]) -> None:
        self.coordinator.script_round = (key, members)
        if self.coordinator.manager is not None:
            self.coordinator.manager.at_round(key, members)

    def step(self) -> None:
        """One inner step: the model moves by what its share holds (replicas with other
        shares drift apart), then the outer step's schedule."""
        self.iteration += 1
        share = self.outer.share
        if self.rank == 0:
            self.param.add_(1e-3 * (1 + (share.offset if share is not None else 0)))
        speed = 10.0 * float(self.script["weights"][str(self.replica)])  # (throughput: a fixed speed per replica)
        self.outer.count_step((share.samples if share is not None else GBS) / speed)
        self.outer.after_step(self.iteration)

    def to_sync(self, faults=None) -> None:
        """Steps up to this replica's next sync point, its cycle with ``faults`` injected
        (:attr:`ElasticCoordinator.faults`: this cycle's collectives only)."""
        h = self.script["H"]
        target = (self.iteration // h + 1) * h
        while self.iteration < target - 1:
            self.step()
        self.coordinator.faults = faults
        self.step()
        self.coordinator.faults = None

    def save(self) -> dict:
        import copy

        self.outer.settle()
        return {"outer": copy.deepcopy(self.outer.state_dict()), "iteration": self.iteration,
                "param": self.param.clone()}

    def load(self, saved: dict) -> None:
        self.iteration = saved["iteration"]  # (the data iterator keeps its position, not its share)
        self.param.copy_(saved["param"])  # (the model: the replica's own training since its last commit)
        self.outer.load_state_dict(saved["outer"])

    def report(self, k: int) -> dict:
        from loco_megatron.diloco.elastic.agreement import state_hash

        share = self.outer.share
        return {"round": k, "replica": self.replica, "rank": self.rank, "iteration": self.iteration,
                "outer_steps": self.outer.outer_steps, "split": self.outer.split_id,
                "share": None if share is None else [share.offset, share.samples],
                "data_share": None if self.data_share is None else list(self.data_share),
                "live": list(self.coordinator.live), "laid": self.laid, "heals": self.heals,
                "rows": getattr(self.outer.channels["fragment0"][1], "world", None),
                "state": state_hash(self.outer.agreed, self.outer.momentum, self.outer.outer_steps)
                if self.rank == 0 else None, **self._eager_report()}

    def _eager_report(self) -> dict:
        """Under eager updates (lane host): the mean of what it sent last, of its eager part,
        and of its parameters minus the agreed ones."""
        eager = getattr(self.outer, "eager", None)
        if eager is None or self.rank != 0:
            return {}
        state = eager["fragment0"]
        agreed = self.outer.agreed["fragment0"]
        return {"sent": float(state.sent.mean()), "offset": float(state.offset.mean()),
                "ahead": float((self.param - agreed).mean())}


def members_of(actions: dict) -> list[int]:
    """The replicas that ask in a round's quorum."""
    return sorted(int(r) for r, a in actions.items() if a.split("+")[0] == "train" or a.startswith("restart"))


def run_history(script: dict, h: int, replica: int, rank: int, control, store) -> list[dict]:
    """One scripted history on this rank; its reports."""
    logs: list = []
    reports: list = []
    if os.environ.get("LOCO_REPLAY_LOG") and rank == 0:  # (debugging a history: its lines on stderr)
        logs = type("Echo", (list,), {"append": lambda self, line: print(f"h{h} replica {replica}: {line}",
                                                                          file=__import__("sys").stderr)})()
    me, saved = None, {}
    if replica >= script["replicas"]:
        return reports  # (a history of fewer replicas than this spawn has: this one sits it out)
    for k, actions in enumerate(script["rounds"]):
        action, *flags = actions[str(replica)].split("+")
        key = f"h{h}/r{k}"
        if action == "dead":
            continue
        if action.startswith("restart"):
            me = Replica(script, replica, rank, control, store, logs)
            me.at_round(key, members_of(actions))
            source = action.split(":")[1]
            if source != "fresh":
                me.load(saved[int(source)])
            me.bind()
            me.outer.join(me.iteration)
        else:
            me.at_round(key, members_of(actions))
            if action == "train":
                armed = ["lose" in flags]

                def fault(phase: str):  # (the first collective of this cycle's exchange is lost here)
                    if phase == "outer" and armed[0]:
                        armed[0] = False
                        return "lost"
                    return None

                me.to_sync(fault)
                if "save" in flags:
                    saved[k] = me.save()
            else:  # stall, die: one step (it closes a delayed exchange), then nothing this round
                me.step()
        reports.append(me.report(k))
        if action == "die":
            me = None
    return reports


def worker(replica: int, rank: int, port: int, store_port: int, scripts: list, queue) -> None:
    """One rank of replica ``replica``'s job (its own gloo world of 2 on ``port``)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        control = dist.new_group(backend="gloo")
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=__import__("datetime").timedelta(
            seconds=120))
        out = [run_history(script, h, replica, rank, control, store) for h, script in enumerate(scripts)]
        queue.put(json.dumps({"replica": replica, "rank": rank, "histories": out}))
    except BaseException:  # noqa: BLE001 - the test prints it
        queue.put(json.dumps({"replica": replica, "rank": rank, "error": traceback.format_exc()}))
    finally:
        time.sleep(0.5)
