"""The model a DiLoCo run ends on, saves and exports: the agreed one (tools/export_hf.py,
generation), every replica holding it bit for bit; one replica's own on request."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import TINY, run_launch, torchrun

ARGS = TINY + ["--train-iters", "6", "--diloco-replicas", "2", "--diloco-inner-steps", "4", "--diloco-outer-bits", "4",
               "--save-interval", "5", "--swiglu"]


@pytest.fixture(scope="module")
def run(cache_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("diloco_export")
    (tmp / "dump").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCO_TEST_DUMP_DIR", str(tmp / "dump"))
        proc, _ = torchrun(2, ARGS + ["--save", str(tmp / "ck")], cache_dir, tmp, script="tests/diloco_dump.py")
    return {"root": tmp, "stdout": proc.stdout}


def _dump(run: dict, tag: str, rank: int) -> dict:
    return torch.load(run["root"] / "dump" / f"{tag}_rank{rank}.pt")


def _export(run: dict, name: str, *extra: str) -> dict:
    from safetensors.torch import load_file

    out = run["root"] / name
    proc = run_launch([sys.executable, "tools/export_hf.py", "--out", str(out), *extra], None, 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out / "model.safetensors")), proc.stdout


def _as_hf(run: dict, params: dict) -> dict:
    from loco_megatron.export.reader import read_run_config, resolve_iteration_dir, single_rank_config
    from loco_megatron.export.weights import to_hf

    config = single_rank_config(read_run_config(resolve_iteration_dir(str(run["root"] / "ck"))))
    return to_hf(params, config, 4096)


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_export_is_the_agreed_model_every_replica_ends_on(run):
    """Guards against exporting one replica's local weights as "the model" (they differ
    from what the replicas agreed on by several percent mid-interval) and against replicas
    that end the run apart: after the final outer step at 6 (an outer step at 4, then 2
    more inner steps) both replicas hold the same weights bit for bit, the default export
    of the last checkpoint is exactly them, the export of the mid-interval checkpoint at 5
    is exactly the agreed parameters of the outer step at 4, and --replica 1 exports
    replica 1's own local weights of step 6, which differ from the agreed ones."""
    final0, final1 = _dump(run, "final", 0), _dump(run, "final", 1)
    assert _equal(final0, final1)
    assert "DiLoCo: final outer step at iteration 6: exchanged fragment(s) 0" in run["stdout"]
    ck = run["root"] / "ck"
    exported, line = _export(run, "hf_final", "--load", str(ck))
    assert "(DiLoCo: the agreed model (after the run's final outer step))" in line
    assert _equal(exported, _as_hf(run, final0))
    mid, line = _export(run, "hf_mid", "--load", str(ck / "iter_0000005"))
    assert "the agreed parameters of the last outer step" in line
    assert _equal(mid, _as_hf(run, _dump(run, "outer4", 0)))
    local1 = _dump(run, "local_end", 1)
    one, line = _export(run, "hf_replica1", "--load", str(ck), "--replica", "1")
    assert "replica 1's local model" in line
    assert _equal(one, _as_hf(run, local1)) and not _equal(one, exported)


def test_bad_replica_is_one_line(run):
    """Guards against --replica naming a replica the checkpoint does not hold exporting
    something else silently (or a traceback): one line naming the replicas it holds, exit
    2, nothing written."""
    out = run["root"] / "hf_bad"
    proc = run_launch([sys.executable, "tools/export_hf.py", "--load", str(run["root"] / "ck"), "--out", str(out),
                       "--replica", "2"], None, 600)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [
        f"export_hf.py: error: --replica: 2 is not a replica of {run['root'] / 'ck' / 'iter_0000006'} "
        "(it holds replicas 0-1)"], proc.stderr
