"""Elastic DiLoCo with SparseLoCo's outer exchange (--diloco-outer-topk): two replica jobs (real
torchruns on torchft, gloo), one killed and restarted from its checkpoint."""

from __future__ import annotations

import pytest

from conftest import train_losses
from test_elastic import H, Run, _committed

SPARSE = ["--diloco-outer-topk", "8", "--diloco-outer-chunk", "64", "--diloco-outer-bits", "2"]
"""Top 8 of chunks of 64 (8 x 8 tiles of the 64-wide weights), 2-bit values (Run's 4 replaced)."""
ITERS = 24


@pytest.fixture(scope="module")
def sparse_rejoin(cache_dir, tmp_path_factory) -> dict:
    """2 replica jobs of one rank: replica 1 is SIGKILLed mid-interval after iteration 6 and
    restarted from its checkpoint of iteration 4 once replica 0, alone meanwhile, is past 14
    (it waits after step 15 until the restarted job is about to ask for a quorum)."""
    tmp = tmp_path_factory.mktemp("elastic_sparse")
    run = Run(tmp, cache_dir, replicas=2, iters=ITERS, extra=SPARSE)
    patch = pytest.MonkeyPatch()
    patch.setenv("LOCO_TEST_DUMP_LAYS", "1")  # (every job's: tests/elastic_check.py)
    try:
        run.start("r0", 0, env=run.hold(15))
        run.start("r1", 1, "--save", str(tmp / "ck1"), "--save-interval", "4")
        for r in range(2):
            run.wait_iteration(f"r{r}", 1)
        run.wait_iteration("r1", 6)
        killed_at = max(m["iteration"] for m in run.metrics("r1") if "iteration" in m)
        run.kill("r1")
        run.wait_iteration("r0", 14)
        run.start_then_release("r1b", 1, 15, "--load", str(tmp / "ck1"), "--save", str(tmp / "ck1"),
                               "--save-interval", "4")
        codes = {name: run.finish(name) for name in ("r0", "r1b")}
        return {"run": run, "codes": codes, "killed_at": killed_at}
    finally:
        run.close()
        patch.undo()


def test_sparse_replicas_agree_bit_for_bit_and_the_survivor_keeps_its_error_buffers(sparse_rejoin):
    """Guards against elastic replicas whose sparse outer steps leave them on different
    agreed parameters (a payload decoded differently, a sum in another order), and against
    the survivor of a departure and a rejoin losing its SparseLoCo error buffers when the
    exchange is re-laid for 1, then 2 replicas (its unsent outer gradient gone: the buffers
    do not depend on the replica count): replica 0 trains to the end with a falling loss,
    each of its re-lays after its first outer step leaves its error buffers bit for bit as
    they were (and they held something), no line says they start at zero, and before the
    kill and after the rejoin both replicas hold the same agreed parameters after every
    outer step."""
    run, codes = sparse_rejoin["run"], sparse_rejoin["codes"]
    assert codes["r0"] == 0 and codes["r1b"] == 0, (run.log("r0")[-2000:], run.log("r1b")[-2000:])
    log = run.log("r0")
    assert "SparseLoCo top 8 of 64" in log and "replica 1 left" in log and "replica 1 joined" in log, log[-3000:]
    assert "error buffers start at zero" not in log, log[-3000:]
    losses = train_losses(run.metrics("r0"))
    assert sorted(losses) == list(range(1, ITERS + 1)) and losses[ITERS] < losses[1] - 0.1, losses
    dumps = run.dumps(0)
    relays = [d for d in dumps if d["at"] == "lay" and d["iteration"] > H]
    assert [d["for"] for d in relays] == [[0], [0, 1]], relays
    assert all(d["before"] == d["after"] and d["nonzero"] and not d["dropped"] for d in relays), relays
    a, b = _committed(dumps), _committed(run.dumps(1))
    rejoin = [d for d in run.dumps(1) if d["at"] == "join"][-1]["iteration"]
    common = sorted(set(a) & set(b))
    assert any(it <= sparse_rejoin["killed_at"] for it in common) and any(it > rejoin for it in common), common
    for it in common:
        assert a[it]["agreed"] == b[it]["agreed"] and a[it]["outer_steps"] == b[it]["outer_steps"], it
    assert a[ITERS]["outer_steps"] >= ITERS // H - 1


def test_a_restarted_sparse_replica_heals_and_says_its_buffers_start_at_zero(sparse_rejoin):
    """Guards against a restarted replica that heals silently without its SparseLoCo error
    buffers (it trained from its checkpoint of iteration 4, and the agreed model moved on:
    its own buffers no longer fit), or that keeps stale ones: it heals from replica 0 and
    says in one line that its outer error buffers start at zero, and they are empty after
    its join while the resumed ones it loaded (from the exchange at 4) were not."""
    run = sparse_rejoin["run"]
    log = run.log("r1b")
    assert "DiLoCo: healed from replica 0" in log, log[-3000:]
    assert "DiLoCo: the outer error buffers start at zero" in log, log[-3000:]
    dumps = run.dumps(1)
    joins = [d for d in dumps if d["at"] == "join"]
    assert len(joins) == 2 and not joins[-1]["errors"], joins
    assert any(d["errors"] for d in dumps[:dumps.index(joins[-1])] if d["at"] == "cycle"), dumps
