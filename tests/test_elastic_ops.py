"""The groups and the vote between elastic replicas (loco_megatron/diloco/elastic/ops.py):
real torchft gloo groups of two members, one thread each in this process, on a real
TCPStore, configured as torchft's Manager configures them (``<store>/torchft/<quorum
id>/<lane>``, the quorum's rank and size, the members' global ranks)."""

from __future__ import annotations

import concurrent.futures
import datetime

import torch
import torch.distributed as dist
from torchft import ProcessGroupGloo

from conftest import free_port
from loco_megatron.diloco.elastic.ops import fresh_groups, vote

CPU = torch.device("cpu")
WAIT = datetime.timedelta(seconds=60)
"""The groups' timeout where every member arrives (only a wrong group would wait it out)."""


def both(fn) -> list:
    """``fn(member)`` for members 0 and 1 at once (a configuration or a collective waits for
    both); each result, or the exception it raised."""

    def run(member):
        try:
            return fn(member)
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            return e

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, (0, 1)))


def configure(pgs, addrs: list[str], quorum_id: int) -> list:
    """The Manager's configure of a quorum of both members, member ``m`` at ``addrs[m]``."""
    return both(lambda m: pgs[m].configure(addrs[m], f"replica{m}:uuid", m, 2, quorum_id, 0, 1, [0, 1]))


def votes(pgs, yes: list[bool]) -> list:
    return both(lambda m: vote(pgs[m], yes[m], CPU))


def works(pgs, addr: str, quorum_id: int) -> str:
    """Configure both members at ``addr``: the prefix both chose, after asserting that a group
    formed whose all-reduce carries each member's value to the other."""
    assert configure(pgs, [addr, addr], quorum_id) == [None, None]
    assert pgs[0].configured_at == pgs[1].configured_at
    assert votes(pgs, [True, False]) == [False, False]  # (member 0 can only learn the no from member 1)
    assert votes(pgs, [True, True]) == [True, True]
    return pgs[0].configured_at


def test_a_member_that_never_reached_the_store_costs_only_its_own_quorum():
    """Guards against one missed arrival wedging the configuration of a member set: a member
    whose configure failed before it reached the primary's store (here: it could not connect)
    must not leave state that puts the members of a later quorum on different prefixes. With
    a count of arrivals per quorum id and member set, the count stayed one behind, and when a
    restarted lighthouse handed the same members that quorum id again they chose different
    prefixes (each waiting alone until its timeout), at every later restart."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def lane0(quorum: int) -> str:
        return f"127.0.0.1:{store.port}/torchft/{quorum}/0"

    pgs = [fresh_groups(ProcessGroupGloo)(timeout=WAIT) for _ in range(2)]
    for pg in pgs:
        pg.set_timeout(datetime.timedelta(seconds=3))  # (the failed quorum is waited out)
    nowhere = f"127.0.0.1:{free_port()}/torchft/1/0"
    failed = configure(pgs, [nowhere, lane0(1)], quorum_id=1)
    assert all(isinstance(e, Exception) for e in failed), failed
    assert "the group of quorum 1 did not form: not every member reached the primary's store" in str(failed[1])
    for pg in pgs:
        pg.set_timeout(WAIT)
    works(pgs, lane0(2), quorum_id=2)  # the same lighthouse's next quorum (the commit failed: a new id)
    works(pgs, lane0(1), quorum_id=1)  # a restarted lighthouse's first quorum: the failed one's prefix


def test_a_restarted_lighthouses_quorum_ids_never_reuse_a_prefix_whose_keys_are_on_the_store():
    """Guards against a lighthouse restart reusing rendezvous keys: a restarted lighthouse
    numbers its quorums from 1 again, so torchft's prefix (.../torchft/<quorum id>/<lane>)
    names the same store keys as the previous incarnation's quorum of that id, and a group
    configured under them reads the addresses of peers long closed. Each configuration must
    agree on a prefix of its own, restart after restart."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}/torchft/1/0"
    pgs = [fresh_groups(ProcessGroupGloo)(timeout=WAIT) for _ in range(2)]
    used = []
    for _incarnation in range(3):
        prefix = works(pgs, addr, quorum_id=1)
        # gloo's rendezvous left both members' addresses under it ("<sequence>/<rank>")
        assert dist.PrefixStore(prefix.split("/", 1)[1], store).check(["0/0", "0/1"])
        assert prefix.startswith(addr + "/") and prefix not in used
        used.append(prefix)


class AbortedNCCL:
    """What a vote sees on torchft's NCCL group when the collective outlived its timeout
    (the real path needs GPUs): the timer thread's ``abort()`` set ``errored()`` and released
    the stream, the wait returned normally (it only orders the streams), and the tensor holds
    this member's own value, not the MIN. ``wait_returns``: the wait's own verdict."""

    def __init__(self, wait_returns: bool = True, aborted: bool = True):
        self.wait_returns, self.aborted = wait_returns, aborted

    def allreduce(self, tensors, opts):
        pg = self

        class Work:
            def wait(self, timeout=None):
                return pg.wait_returns

        return Work()

    def errored(self):
        return RuntimeError("aborted") if self.aborted else None


def test_a_vote_whose_collective_was_aborted_without_raising_is_a_failed_vote():
    """Guards against a vote that counts only exceptions as failures: torchft's NCCL group
    aborts a stuck collective asynchronously and the wait returns, so ``t.item()`` reads this
    member's own yes (or a partial MIN) although another member voted no or never arrived.
    The vote must read the work's and the group's status and answer None (a failed vote)."""
    assert vote(AbortedNCCL(), True, CPU) is None
    assert vote(AbortedNCCL(wait_returns=False, aborted=False), True, CPU) is None
    assert vote(AbortedNCCL(aborted=False), True, CPU) is True  # (a completed collective: its value)
