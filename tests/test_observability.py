"""Communication metrics, wandb offline runs, the run-comparison and dashboard tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, TINY, torchrun

COMM_KEYS = ["comm/grad_sync_total_s", "comm/grad_sync_exposed_s", "comm/param_gather_s",
             "comm/compress_s", "comm/decompress_s", "comm/grad_bytes_sent",
             "comm/grad_bytes_uncompressed", "comm/compression_ratio", "comm/compressed_fraction",
             "comm/param_bytes_sent", "comm/param_bytes_uncompressed", "comm/param_compression_ratio",
             "comm/param_compress_s", "comm/param_decompress_s", "comm/busbw_gbps"]
TRAIN_KEYS = ["train/lm_loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "train/step_s",
              "train/skipped_iters", "train/tokens_seen", "mem/peak_bytes"]
RUN = [*TINY, "--train-iters", "6", "--log-interval", "3", "--eval-interval", "6", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """Three real 2-rank runs: LoCo 4-bit (fp32 buffers, wandb offline), megatron's own
    reduce-scatter, and LoCo 4-bit on bf16 gradient buffers."""
    tmp = tmp_path_factory.mktemp("obs")
    wandb_dir = tmp / "wandb"
    os.environ["WANDB_MODE"] = "offline"
    try:
        _, loco = torchrun(2, [*RUN, "--loco-bits", "4", "--wandb-project", "obs", "--wandb-group", "g-obs",
                               "--wandb-exp-name", "loco4", "--wandb-save-dir", str(wandb_dir)],
                           cache_dir, tmp, name="loco4")
    finally:
        del os.environ["WANDB_MODE"]
    _, base = torchrun(2, [*RUN, "--loco-bits", "0"], cache_dir, tmp, name="base")
    _, bf16 = torchrun(2, [*RUN, "--loco-bits", "4", "--bf16", "--grad-reduce-in-bf16"], cache_dir, tmp,
                       name="loco4bf16")
    return {"tmp": tmp, "wandb": wandb_dir, "loco": loco, "base": base, "bf16": bf16}


def _train_records(metrics):
    return [m for m in metrics if "train/lm_loss" in m]


def test_loco_run_reports_every_key_with_sane_values(runs):
    """Guards against missing or mis-scaled comm metrics: every key is logged, bytes follow
    the payload formula (4 bits + an fp32 scale per 256 elements over 32-bit buffers),
    exposed <= total, and LoCo's compute and error are visible."""
    recs = _train_records(runs["loco"])
    assert [r["iteration"] for r in recs] == [3, 6]
    for r in recs:
        for k in COMM_KEYS + TRAIN_KEYS + ["loco/error_rms", "loco/quant_rel_error"]:
            assert k in r, k
        assert 4.125 / 32 <= r["comm/compression_ratio"] <= 4.125 / 32 * 1.05
        assert r["comm/grad_bytes_sent"] == pytest.approx(r["comm/compression_ratio"]
                                                          * r["comm/grad_bytes_uncompressed"])
        assert r["comm/compressed_fraction"] == 1.0
        assert 0 <= r["comm/grad_sync_exposed_s"] <= r["comm/grad_sync_total_s"]
        busy = r["comm/grad_sync_total_s"] + r["comm/param_gather_s"]
        sent = r["comm/grad_bytes_sent"] + r["comm/param_bytes_sent"]
        assert r["comm/busbw_gbps"] == pytest.approx(sent * 8 / busy / 1e9, rel=1e-6) and r["comm/busbw_gbps"] > 0
        assert r["comm/grad_sync_exposed_s_max"] >= r["comm/grad_sync_exposed_s"]
        assert r["comm/compress_s"] > 0 and r["comm/decompress_s"] > 0
        assert r["comm/param_gather_s"] > 0  # the distributed optimizer's all-gather is timed
        # 4-bit codes of a random-ish gradient: relative error well inside (0, 1).
        assert 0.01 < r["loco/quant_rel_error"] < 0.5
        assert r["loco/error_rms"] > 0
        assert r["mem/peak_bytes"] > 10 << 20
    assert recs[-1]["train/tokens_seen"] == 6 * 8 * 64
    evals = [m for m in runs["loco"] if "eval/lm_loss" in m]
    assert len(evals) == 1 and evals[0]["eval/ppl"] == pytest.approx(2.718281828 ** evals[0]["eval/lm_loss"],
                                                                       rel=1e-6)


def test_run_config_names_the_full_variant(runs):
    """Guards against dashboards averaging unlike runs (they grouped by loco_bits only, so
    fp32 and bf16 baselines, or LoCo with and without two-hop or parameter compression,
    were mixed): every run's config carries its full variant label."""
    variants = {name: runs[name][0]["config"]["variant"] for name in ("loco", "base", "bf16")}
    assert variants == {"loco": "LoCo 4-bit (symmetric/absmax/none/nearest) | fp32",
                        "base": "fp32 reduce-scatter | fp32",
                        "bf16": "LoCo 4-bit (symmetric/absmax/none/nearest) | bf16"}


def test_baseline_run_sends_uncompressed(runs):
    """Guards against LoCo bookkeeping leaking into megatron's own sync: ratio 1, no
    compression time, no LoCo metrics, same byte count as the LoCo run's uncompressed."""
    for r in _train_records(runs["base"]):
        assert r["comm/compression_ratio"] == 1.0
        assert r["comm/compressed_fraction"] == 0.0
        assert r["comm/compress_s"] == 0.0 and r["comm/decompress_s"] == 0.0
        assert 0 <= r["comm/grad_sync_exposed_s"] <= r["comm/grad_sync_total_s"]
        assert "loco/error_rms" not in r
    assert _train_records(runs["base"])[-1]["comm/grad_bytes_uncompressed"] == \
        _train_records(runs["loco"])[-1]["comm/grad_bytes_uncompressed"]


def test_bf16_buffers_halve_the_uncompressed_bytes(runs):
    """Guards against counting bf16 gradient buffers as fp32: the same 4-bit payload is
    about 0.26 of a bf16 buffer (4.125/16: 4 bits and one fp32 scale per 256-element block)."""
    r = _train_records(runs["bf16"])[-1]
    assert 4.125 / 16 * 0.99 <= r["comm/compression_ratio"] <= 4.125 / 16 * 1.05
    fp32 = _train_records(runs["loco"])[-1]
    assert r["comm/grad_bytes_uncompressed"] < 0.51 * fp32["comm/grad_bytes_uncompressed"]


def test_wandb_offline_run_directory_has_config_and_history(runs):
    """Guards against wandb blocking on the network or dropping the config: offline mode
    writes a syncable run directory whose record file holds every flag and the metrics."""
    run_dirs = list((runs["wandb"] / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1  # rank 0 only
    records = list(run_dirs[0].glob("run-*.wandb"))
    assert len(records) == 1
    data = records[0].read_bytes()
    assert data.startswith(b":W&B")
    for key in [b"loco_bits", b"wandb_group", b"g-obs", b"ddp_bucket_size", b"data_parallel_size",
                b"comm/grad_sync_exposed_s", b"comm/grad_bytes_sent", b"loco/quant_rel_error",
                b"train/lm_loss_vs_tokens", b"eval/lm_loss"]:
        assert key in data, key


def test_compare_runs_writes_table_and_pngs(runs):
    """Guards against a comparison tool that silently drops a run or writes broken plots."""
    out = runs["tmp"] / "compare"
    proc = subprocess.run([sys.executable, str(REPO / "tools/compare_runs.py"), str(runs["tmp"] / "base.jsonl"),
                           str(runs["tmp"] / "loco4.jsonl"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    table = (out / "comparison.md").read_text()
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| fp32 reduce-scatter |") and lines[3].startswith("| LoCo 4-bit |")
    assert "| 1.000 |" in lines[2] and "| 1.00x |" in lines[2]
    loco_ratio = float(lines[3].split("|")[11])
    assert 4.125 / 32 <= loco_ratio <= 4.125 / 32 * 1.05
    # Parameter bytes next to gradient bytes: megatron's fp32 all-gather moves as much as its reduce-scatter.
    assert lines[2].split("|")[9] == lines[2].split("|")[10]
    eval_loss = [m for m in runs["loco"] if "eval/lm_loss" in m][-1]["eval/lm_loss"]
    assert f"{eval_loss:.4f}" in lines[3]
    import matplotlib.image

    for name in ["loss_vs_tokens.png", "loss_vs_time.png", "step_time.png", "bytes_per_step.png"]:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(out / name).shape[0] > 100


def test_compare_runs_rejects_a_file_without_metrics(tmp_path):
    """Guards against a traceback (or an empty table) on a wrong input file."""
    bad = tmp_path / "empty.jsonl"
    bad.write_text(json.dumps({"config": {}}) + "\n")
    proc = subprocess.run([sys.executable, str(REPO / "tools/compare_runs.py"), str(bad), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "no training metrics" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_wandb_dashboard_builds_one_panel_per_key():
    """Guards against a dashboard recipe that no longer matches the logged keys or the
    wandb-workspaces API: every panel key is one the trainer logs, and the report object
    validates (it is only sent on save)."""
    sys.path.insert(0, str(REPO / "tools"))
    import wandb_dashboard

    logged = set(COMM_KEYS + TRAIN_KEYS) | {"eval/lm_loss", "loco/error_rms", "loco/quant_rel_error",
                                            "train/lm_loss_vs_tokens", "comm/grad_sync_exposed_s_max"}
    for p in wandb_dashboard.PANELS:
        for key in p["y"]:
            assert key in logged, key
    report = wandb_dashboard.build_report("proj", "ent", "g-obs", None)
    grid = report.blocks[-1]
    assert len(grid.panels) == len(wandb_dashboard.PANELS)
    assert grid.runsets[0].filters == "Config('wandb_group') == 'g-obs'"
    assert wandb_dashboard.GROUP_BY == ["variant"]
    proc = subprocess.run([sys.executable, str(REPO / "tools/wandb_dashboard.py"), "--project", "p",
                           "--group", "g", "--dry-run"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout)["filter"] == "Config('wandb_group') == 'g'"


def test_skipped_steps_log_no_grad_norm(cache_dir, tmp_path):
    """Guards against skipped steps logging `train/grad_norm` 0.0 (reads as vanished
    gradients) or the previous window's value: a window whose every step was skipped
    has no grad norm, like it has no loss; the next real step logs its own."""
    _, metrics = torchrun(1, [*TINY, "--global-batch-size", "4", "--train-iters", "3", "--inject-nan", "1-2:0"],
                          cache_dir, tmp_path)
    by_iter = {m["iteration"]: m for m in metrics if "train/skipped_iters" in m}
    assert sorted(by_iter) == [1, 2, 3]
    assert "train/grad_norm" not in by_iter[1] and "train/grad_norm" not in by_iter[2], by_iter
    assert by_iter[3]["train/grad_norm"] > 0 and by_iter[3]["train/skipped_iters"] == 2


def test_wandb_dashboard_without_a_login_is_one_line(tmp_path):
    """Guards against the dashboard tool ending in a 33-line traceback when W&B is not
    logged in (the report asks the API for the default entity while it is built, before
    the save that caught errors): one line naming the cause, non-zero exit."""
    pytest.importorskip("wandb_workspaces")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_MODE="offline", WANDB_CONFIG_DIR=str(tmp_path / "wandb"))
    proc = subprocess.run([sys.executable, "tools/wandb_dashboard.py", "--project", "p", "--group", "g"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, lines[-5:]
    assert lines[0].startswith("error: could not save the wandb report: not logged in"), lines


LOST_SERVICE = """
import os, pathlib, signal, time
from loco_megatron.config import LoggingConfig
from loco_megatron.metrics.logger import MetricsLogger

log = MetricsLogger(LoggingConfig(wandb_project="p", metrics_jsonl="m.jsonl"), {}, True, True, wandb_dir="w")
log.log(1, {"train/x": 1.0})
kids = [int(pid) for task in pathlib.Path(f"/proc/{os.getpid()}/task").iterdir()
        for pid in (task / "children").read_text().split()]
services = [pid for pid in kids if pathlib.Path(f"/proc/{pid}/comm").read_text().strip() == "wandb-core"]
assert services, kids
for pid in services:  # as Slurm's scancel does: SIGTERM to every process of the job
    os.kill(pid, signal.SIGTERM)
    while pathlib.Path(f"/proc/{pid}").exists() and "Z" not in pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2]:
        time.sleep(0.05)
log.log(2, {"train/x": 2.0})
log.summary(2, {"summary/x": 3.0})
log.close()
"""


def test_a_lost_wandb_service_costs_one_line_not_the_stop_save(tmp_path):
    """Guards against losing the stop save on scancel or preemption: Slurm sends SIGTERM to
    every process of the job, wandb's service process (wandb-core) exits on it, and rank 0's
    next wandb call raised ConnectionResetError in the middle of stopping, so the step was
    not saved and the other ranks failed in the save's collectives. The logger says so in
    one line and goes on without wandb; nothing more is printed, also at exit."""
    proc = subprocess.run([sys.executable, "-c", LOST_SERVICE], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, WANDB_MODE="offline", PYTHONPATH=str(REPO)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("iter ")]
    assert len(lines) == 1 and lines[0].startswith("warning: wandb's service process is gone (") and lines[0].endswith(
        "): wandb logging stops here, the run goes on"), lines
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r.get("iteration") for r in records] == [None, 1, 2, 2]  # config, 2 steps, the summary
