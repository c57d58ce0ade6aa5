"""The combination matrix (issue 21, item 10): every pair of values of any two of the
factors below runs together in some cell, on 2-4 gloo ranks, 4 steps with a save at step
2, then a resume from step 2 at the same layout and one at another (a --ddp-bucket-size
change at the same world size, or a DP change: 2 <-> 4 ranks).

Invariants checked in every cell, with its flags in the test id and every message:
parameters bit-identical across the ranks of each DP group after every step; the
same-layout resume bit-exact against the uninterrupted run; the other-layout resume
continuing (first resumed loss within ``RESUME_RTOL`` of the uninterrupted run) with
each reset of state announced in one line (--ckpt-format torch: a DP change is refused
with one line instead); the bytes metrics equal to what the collectives were handed.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from allpairs import all_pairs, coverable_pairs
from conftest import REPO, TINY, read_metrics, torchrun_command, train_losses

FACTORS = {
    "loco_bits": (0, 2, 4),
    "hierarchical": (False, True),
    "param_gather_bits": (0, 4),
    "bf16": (False, True),
    "parallel": ("dp", "tp2", "pp2vpp", "ep2"),
    "overlap_param_gather": (False, True),
    "async_save": (False, True),
    "ckpt_format": ("torch_dist", "torch"),
    "other_layout": ("bucket", "dp"),
}

RESUME_RTOL = 1e-4
"""First resumed loss at another layout vs the uninterrupted run: the weights and the
global batch are the same, only the reduction order (DP) may differ."""

OTHER_BUCKET = "15000"
"""--ddp-bucket-size of the other-layout resume (TINY's is 40000: more buckets here)."""

RESET = re.compile(r"re-seeded|\b(at|from) zero\b|start(s|ing)? (afresh|fresh)")
"""A line announcing that some state starts afresh."""


def valid(cell: dict) -> bool:
    """Combinations that can run. Two-hop LoCo needs LoCo on and a data-parallel group
    spanning two nodes with several ranks each (DP4 with --loco-ranks-per-node 2: TP2 and
    PP2 leave DP2 on 4 ranks); --async-save is torch_dist only (config/checkpoint.py)."""
    if cell["hierarchical"] and (cell["loco_bits"] == 0 or cell["parallel"] not in ("dp", "ep2")):
        return False
    return not (cell["async_save"] and cell["ckpt_format"] != "torch_dist")


def world_size(cell: dict) -> int:
    """2 ranks where the factors allow (DP2, or EP2 x DP2); 4 for TP2/PP2 x DP2 and two-hop."""
    return 4 if cell["hierarchical"] or cell["parallel"] in ("tp2", "pp2vpp") else 2


CELLS = all_pairs(FACTORS, valid, cost=world_size)


def cell_id(cell: dict) -> str:
    return "-".join([
        f"loco{cell['loco_bits']}" + ("-hier" if cell["hierarchical"] else ""),
        f"pgb{cell['param_gather_bits']}", "bf16" if cell["bf16"] else "fp32", cell["parallel"],
        *(["overlap-pg"] if cell["overlap_param_gather"] else []), *(["async"] if cell["async_save"] else []),
        cell["ckpt_format"], f"other-{cell['other_layout']}"])


def cell_args(cell: dict) -> list[str]:
    args = TINY + ["--train-iters", "4", "--loco-bits", str(cell["loco_bits"]),
                   "--param-gather-bits", str(cell["param_gather_bits"]), "--ckpt-format", cell["ckpt_format"]]
    if cell["hierarchical"]:
        args += ["--loco-hierarchical", "--loco-ranks-per-node", "2"]
    args += ["--bf16"] if cell["bf16"] else []
    args += {"dp": [], "tp2": ["--tensor-model-parallel-size", "2"],
             "pp2vpp": ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                        "--num-layers", "4"],
             "ep2": ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"],
             }[cell["parallel"]]
    args += ["--overlap-param-gather"] if cell["overlap_param_gather"] else []
    args += ["--async-save"] if cell["async_save"] else []
    return args


def test_generator_covers_every_valid_pair_and_respects_constraints():
    """Guards against a matrix generator that drops a pair of factor values (a combination
    never tested), emits a cell the code cannot run (two-hop without LoCo or across one
    node, --async-save with --ckpt-format torch), or changes cells from run to run."""
    need = coverable_pairs(FACTORS, valid)
    have = set()
    for cell in CELLS:
        assert valid(cell), cell_id(cell)
        have |= {((a, cell[a]), (b, cell[b])) for i, a in enumerate(FACTORS) for b in list(FACTORS)[i + 1:]}
    assert need <= have, sorted(need - have)[:5]
    assert (("hierarchical", True), ("loco_bits", 0)) not in {tuple(sorted(p)) for p in have}
    assert all(not c["async_save"] for c in CELLS if c["ckpt_format"] == "torch")
    assert all_pairs(FACTORS, valid, cost=world_size) == CELLS and len({cell_id(c) for c in CELLS}) == len(CELLS)


def test_generator_on_a_small_space():
    """Guards against the greedy covering missing pairs or ignoring its constraint where
    the answer is known: 3 binary factors need 4 cells; forbidding a=1 with b=1 leaves
    that pair uncovered and every other one covered."""
    factors = {"a": (0, 1), "b": (0, 1), "c": (0, 1)}
    cells = all_pairs(factors, lambda c: True)
    assert len(cells) == 4 and coverable_pairs(factors, lambda c: True) == set().union(
        *({((x, c[x]), (y, c[y])) for x, y in (("a", "b"), ("a", "c"), ("b", "c"))} for c in cells))
    ok = lambda c: not (c["a"] == 1 and c["b"] == 1)  # noqa: E731
    cells = all_pairs(factors, ok)
    assert all(ok(c) for c in cells)
    assert len(coverable_pairs(factors, ok)) == 11


def _run(nproc: int, args: list[str], cache: str, tmp_path, name: str, flags: str):
    metrics = tmp_path / f"{name}.jsonl"
    cmd, env = torchrun_command(nproc, args, cache, metrics, script="tests/matrix_run.py")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return proc, read_metrics(metrics)


def _ok(proc, flags: str, name: str) -> None:
    assert proc.returncode == 0, (f"[{flags}] {name} run failed with {proc.returncode}:\n"
                                  + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))


def _check_run(proc, metrics: list, nproc: int, start: int, two_hop: bool, flags: str, name: str) -> None:
    """Identical parameters after every step (and as loaded), and bytes metrics = the
    collectives' bytes, in a run of steps ``start+1 .. 4``."""
    where = f"[{flags}] {name}"
    iters = list(range(max(start, 1), 5))
    checks = re.findall(r"IDENTICAL rank=(\d+) iter=(\d+) dense=(\w+) expert=(\w+)", proc.stdout)
    assert sorted({(int(r), int(i)) for r, i, _, _ in checks}) == [(r, i) for r in range(nproc) for i in iters], \
        (where, checks)
    bad = [c for c in checks if "False" in c]
    assert not bad, f"{where}: parameters differ across data-parallel ranks (rank, iter, dense, expert): {bad}"
    wire = [dict(kv.split("=") for kv in line.split()[1:]) for line in proc.stdout.splitlines()
            if line.startswith("WIRE ")]
    assert len(wire) == nproc * (4 - start), (where, len(wire))
    for w in wire:
        w = {k: int(v) for k, v in w.items()}
        assert w["grad_split"] == w["grad_out"], f"{where}: grad_bytes_sent_intra+inter vs wire to other ranks: {w}"
        if not two_hop:  # flat: every row handed over counts (two-hop: only rows for other ranks)
            assert w["grad_metric"] == w["grad_in"], f"{where}: grad_bytes_sent vs bytes handed to collectives: {w}"
        else:
            assert w["grad_metric"] == w["grad_out"], f"{where}: two-hop grad_bytes_sent vs wire: {w}"
        assert w["param_metric"] == w["param"], f"{where}: param_bytes_sent vs gathered bytes: {w}"
    logged = {m["iteration"]: m for m in metrics if "comm/grad_bytes_sent" in m}
    for it in range(start + 1, 5):
        mine = [w for w in wire if int(w["iter"]) == it]
        for key, metric in (("grad_metric", "comm/grad_bytes_sent"), ("param_metric", "comm/param_bytes_sent")):
            mean = sum(int(w[key]) for w in mine) / nproc
            assert logged[it][metric] == pytest.approx(mean, rel=1e-12), (where, it, metric)


@pytest.mark.parametrize("cell", CELLS, ids=[cell_id(c) for c in CELLS])
def test_matrix_cell(cell, cache_dir, tmp_path):
    """Guards against any combination of the factors breaking an invariant: ranks of a
    DP group drifting apart, state missing from a checkpoint (same-layout resume not
    bit-exact), a resume at another layout or bucket size that crashes, silently resets
    state or continues from wrong weights, and bytes metrics that differ from what the
    collectives moved."""
    flags = cell_id(cell)
    n, args = world_size(cell), cell_args(cell)
    two_hop = cell["hierarchical"]  # always 4 ranks, 2 per node
    ck = tmp_path / "ck"
    proc, ref = _run(n, args + ["--save", str(ck), "--save-interval", "2"], cache_dir, tmp_path, "ref", flags)
    _ok(proc, flags, "uninterrupted")
    _check_run(proc, ref, n, 0, two_hop, flags, "uninterrupted")
    a = train_losses(ref)
    (ck / "latest_checkpointed_iteration.txt").write_text("2\n")  # resume from iteration 2

    proc, same = _run(n, args + ["--load", str(ck)], cache_dir, tmp_path, "same", flags)
    _ok(proc, flags, "same-layout resume")
    _check_run(proc, same, n, 2, two_hop, flags, "same-layout resume")
    b = train_losses(same)
    assert b == {3: a[3], 4: a[4]}, f"[{flags}] same-layout resume not bit-exact: {a} vs {b}"
    assert not [line for line in proc.stdout.splitlines() if RESET.search(line)], f"[{flags}] {proc.stdout[-1500:]}"

    if cell["other_layout"] == "bucket":
        other_n, other_args = n, args + ["--ddp-bucket-size", OTHER_BUCKET]
    else:
        other_n, other_args = (2 if n == 4 else 4), args
    proc, other = _run(other_n, other_args + ["--load", str(ck)], cache_dir, tmp_path, "other", flags)
    if cell["ckpt_format"] == "torch" and other_n != n:  # one file per rank: only the same layout loads
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert proc.returncode == 2 and len(errors) == 1 and "different model/parallel layout" in errors[0] \
            and "Traceback" not in proc.stderr, f"[{flags}] torch format at DP {other_n}: {proc.stderr[-1500:]}"
        return
    _ok(proc, flags, f"other-layout ({cell['other_layout']}) resume")
    _check_run(proc, other, other_n, 2, two_hop and other_n == n, flags, f"other-layout ({cell['other_layout']}) resume")
    c = train_losses(other)
    assert sorted(c) == [3, 4] and c[3] == pytest.approx(a[3], rel=RESUME_RTOL), \
        f"[{flags}] other-layout resume does not continue the run: {a} vs {c}"
    announced = [line for line in proc.stdout.splitlines() if RESET.search(line)]
    resharded = other_n != n
    reset_loco = cell["loco_bits"] > 0
    reset_pgb = cell["param_gather_bits"] > 0
    if resharded:  # one line for RNG, LoCo and --param-gather-bits state together
        assert len(announced) == 1 and "RNG re-seeded" in announced[0], f"[{flags}] {announced}"
    else:  # per-rank state read back where it fits; each part that does not fit says so once
        assert sum("LoCo" in line for line in announced) == int(reset_loco), f"[{flags}] {announced}"
        assert sum("param-gather" in line for line in announced) == int(reset_pgb), f"[{flags}] {announced}"
        assert len(announced) <= int(reset_loco) + int(reset_pgb), f"[{flags}] {announced}"
