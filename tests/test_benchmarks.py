"""Benchmarks' --smoke modes run, so the scripts cannot rot."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_launch


def test_loco_bucket_smoke():
    """Guards against the bucket benchmark breaking, and against the 4-bit payload
    drifting above the spec's 0.27 x bf16 or any 2-bit quantiser option's above 0.14 x
    (side information creeping onto the wire)."""
    proc = subprocess.run([sys.executable, "benchmarks/loco_bucket.py", "--smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(l for l in proc.stdout.splitlines() if l.startswith("LoCo 4-bit"))
    assert float(row.split()[-1]) <= 0.27
    two = [float(l.split()[-1]) for l in proc.stdout.splitlines()
           if l.startswith("LoCo 2-bit") and "+ params" not in l]
    assert len(two) == 4 and max(two) <= 0.14
    # gradients and parameters both at 2 bits: the same 0.133x of bf16 gradients + bf16 parameters
    both = next(l for l in proc.stdout.splitlines() if l.startswith("LoCo 2-bit + params 2-bit"))
    assert float(both.split()[-1]) <= 0.14
    assert "compress+decompress" in proc.stdout


def _run(args, timeout=600, **kw):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc


def _main_on_fork_server(script: str, args: list, monkeypatch, capsys) -> str:
    """``python benchmarks/SCRIPT ARGS`` in this process (the file run as ``__main__`` with
    that argv and its folder first on sys.path, as the interpreter runs it), the torchruns
    it starts going to the suite's fork server (conftest.run_launch: torchrun's own CLI,
    its workers forked from an interpreter that has imported torch and megatron-core, so
    a tiny run does not spend most of its time importing) with the same command line,
    environment and output; every other command as before. Returns what it printed."""
    import runpy

    real, routing = subprocess.run, []

    def run(cmd, *a, **kw):
        cmd = [str(c) for c in cmd]
        if routing or a or cmd[1:3] != ["-m", "torch.distributed.run"]:  # (run_launch's own fallback too)
            return real(cmd, *a, **kw)
        routing.append(cmd)
        try:
            proc = run_launch(cmd, kw.get("env") or dict(os.environ), kw.get("timeout") or 600)
        finally:
            routing.pop()
        sink = kw.get("stdout")
        if hasattr(sink, "write"):  # a log file (stderr=STDOUT)
            sink.write(proc.stdout + proc.stderr)
            proc.stdout = proc.stderr = None
        return proc

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / script), *args])
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    capsys.readouterr()
    try:
        runpy.run_path(str(REPO / "benchmarks" / script), run_name="__main__")
    except SystemExit as e:
        assert e.code in (None, 0), (capsys.readouterr().out[-3000:], e.code)
    return capsys.readouterr().out


@pytest.mark.parametrize("kernels", ["torch", "triton", "cpu"])
def test_kernels_smoke(kernels, request):
    """Guards against the kernel benchmark breaking (for the reference, the C++ kernels
    and, interpreted on CPU, the Triton kernels): every size gets a row per thread count
    and implementation, the fast path is timed next to the reference with its speedup,
    and the thread scaling is reported. Asserts on what the script computes, never on the
    printed timings (the interpreter and a loaded machine make those arbitrary)."""
    if kernels == "cpu":  # a first C++ build runs here, not inside the script's time limit
        request.getfixturevalue("cpu_kernels_built")
    out = _run(["benchmarks/kernels.py", "--smoke", "--kernels", kernels]).stdout.splitlines()
    assert f"{kernels} kernels" in out[0]
    rows = [r for r in map(str.split, out) if len(r) == 10 and r[0].replace(",", "").isdigit()]
    impls = [kernels] if kernels == "torch" else [kernels, "torch"]
    want = [(n, t, k) for n in (65536, 262144) for t in ("1", "2") for k in impls]
    assert [(int(r[0].replace(",", "")), r[1], r[2]) for r in rows] == want
    speedups = [line for line in out if "over the torch reference" in line]
    assert len(speedups) == (0 if kernels == "torch" else 4)
    assert sum(f"{kernels} scaling 1 -> 2 threads" in line for line in out) == 2


def test_kernels_option_ratios_smoke(cpu_kernels_built):
    """Guards against the option benchmark (2-bit default vs 4-bit, one thread) breaking or
    losing a case: one line per option case with both ratios; never asserts timings."""
    out = _run(["benchmarks/kernels.py", "--options", "--smoke", "--kernels", "cpu"]).stdout.splitlines()
    assert "quantiser options on the cpu kernels" in out[0]
    cases = [line for line in out if "x 4-bit   decompress+sum" in line]
    assert len(cases) == 6 and "2-bit default (uniform/mse/hadamard/nearest)" in cases[0]


def test_kernels_param_gather_smoke():
    """Guards against the parameter-gather benchmark (one gather's apply: torch reference,
    C++ decode then torch's add_, fused decode-and-apply, and a gather where no shard moved)
    breaking or losing a case: one row per parameter dtype and world size, each with its
    four ratios; never asserts timings."""
    out = _run(["benchmarks/kernels.py", "--param-gather", "--smoke"]).stdout.splitlines()
    assert out[0].startswith("parameter-gather apply of one gather, 65,536-element bucket, 4-bit")
    rows = [line.split() for line in out[2:]]
    assert [(r[0], r[1]) for r in rows] == [("fp32", "2"), ("fp32", "8"), ("bf16", "2"), ("bf16", "8")]
    for r in rows:
        ratios = [float(t[:-1]) for t in r if t.endswith("x")]
        assert len(ratios) == 4 and all(x > 0 for x in ratios), r
        assert [r[i + 1] for i, t in enumerate(r) if t.endswith("x")] == ["torch", "torch", "decode+add_", "fused"], r


def test_kernels_mechanisms_and_speed_dtype(monkeypatch, capsys):
    """Guards against the mechanism comparison behind the README's choice of the C++
    kernels breaking (four mechanisms timed; torch.compile replaced by eager here, its
    compilation alone would take minutes), and against the speed study's dtype probe
    picking the slower dtype or hiding which one it used."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import kernels
    import torch

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    kernels.mechanisms(65536, 4, 1)
    out = capsys.readouterr().out
    for name in ("torch reference", "torch.compile", "C++ two passes", "C++ one pass"):
        assert sum(line.strip().startswith(name) and "x copy" in line for line in out.splitlines()) == 1, out
    import speed

    slow_bf16 = {torch.float32: 0.3, torch.bfloat16: 9.0}
    dtype, note = speed.pick_dtype("auto", probe=slow_bf16.__getitem__)
    assert dtype == "fp32" and "fp32" in note and "9000.00 ms in bf16" in note
    assert speed.pick_dtype("auto", probe={torch.float32: 2.0, torch.bfloat16: 1.0}.__getitem__)[0] == "bf16"
    assert speed.pick_dtype("bf16", probe=slow_bf16.__getitem__)[0] == "bf16"


def test_quality_smoke(tmp_path, cache_dir, monkeypatch, capsys):
    """Guards against the loss-parity study breaking: it trains both variants and writes
    the table (with the reference's zero gap) and the plot. (Its torchruns on the suite's
    fork server: _main_on_fork_server.)"""
    _main_on_fork_server("quality.py", ["--smoke", "--out", str(tmp_path), "--data-cache-path", cache_dir],
                         monkeypatch, capsys)
    table = (tmp_path / "quality.md").read_text()
    assert "| full precision (fp32 reduce-scatter) |" in table and "+0.00%" in table
    assert "| LoCo 4-bit |" in table
    assert (tmp_path / "loss_vs_tokens.png").read_bytes()[:4] == b"\x89PNG"


def test_muon_smoke(tmp_path, cache_dir, monkeypatch, capsys):
    """Guards against the Muon study breaking: data-parallel AdamW and Muon, Muon with LoCo and
    the four DiLoCo variants train (one LR each) and muon.md pairs every comparison of the
    study, which report.py's Muon section reads into its headline rows. (Its torchruns on
    the suite's fork server: _main_on_fork_server.)"""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import report_muon

    _main_on_fork_server("muon.py", ["--smoke", "--out", str(tmp_path / "muon"), "--data-cache-path", cache_dir],
                         monkeypatch, capsys)
    md = (tmp_path / "muon" / "muon.md").read_text()
    for pair in ("Muon (lr 0.001) against AdamW (lr 0.001)", "MuLoCo (2-bit outer) (lr 0.55) against MuLoCo (fp32 "
                 "outer) (lr 0.55)", "Muon + LoCo 4-bit (lr 0.001) against Muon (lr 0.001)"):
        assert pair in md, md
    (tmp_path / "muon" / "speed.md").write_text("- median ratio Muon / AdamW: **1.250** (range 1.2-1.3); "
                                                 "Newton-Schulz: **8.0%** of Muon's step (median)\n")
    rows = report_muon.headlines(tmp_path)
    assert len(rows) == 7 and all(r.startswith(report_muon.HEADLINE) for r in rows), rows
    assert rows[-1].endswith("| 1.250x; 8.0% |  |") and any("| within 0.5% |" in r for r in rows)
    assert report_muon.section(tmp_path)[0] == report_muon.HEADING



def test_sweep_smoke(tmp_path, cache_dir, monkeypatch, capsys):
    """Guards against the defaults sweep breaking or running something else than its cells say:
    every run records (its metrics' config line) the cell's --lr, factor and outer LR, the
    group's optimizer and H, and the corpus (the held-out runs its --data-path, the built-in ones
    none); sweep.md pairs the tuned cell with the previous default on both corpora, decides, and
    names the shipped default's gap to the best cell. (Its torchruns on the suite's fork
    server: _main_on_fork_server.)"""
    from loco_megatron.data.corpus import ensure_default_corpus

    heldout = pathlib.Path(ensure_default_corpus(cache_dir, 4096)[0]).parent  # stands in for the held-out corpus
    out = tmp_path / "sweep"
    _main_on_fork_server("sweep.py", ["--smoke", "--out", str(out), "--data-cache-path", cache_dir,
                                      "--heldout", str(heldout)], monkeypatch, capsys)
    sys.path.insert(0, str(REPO / "benchmarks"))
    import report_sweep  # docs/benchmarks.md's section 13 reads sweep.md's headline into the page's targets
    import sweep

    ship = sweep.shipped("adamw", 2)
    want = {"adamw-lr0.001": ("adam", 0.001, None, None), f"adamw-{ship}": ("adam", float(ship[2:]), None, None),
            "dl-muon-lr0.002-x0.2-olr0.7": ("muon", 0.002, 0.2, 0.7)}
    for corpus in ("builtin", "heldout"):
        for name, (optimizer, lr, factor, outer) in want.items():
            for seed in (1234, 1235):
                config = json.loads((out / f"{corpus}-4" / "runs" / f"{name}_seed{seed}.jsonl").open().readline())
                config = config["config"]
                assert (config["optimizer"], config["lr"], config["seed"]) == (optimizer, lr, seed), name
                if factor is not None:
                    assert config["muon_extra_scale_factor"] == factor
                    assert (config["diloco_outer_lr"], config["diloco_inner_steps"], config["diloco_replicas"]) == \
                        (outer, 2, 2)
                assert config["data_path"] == (str(heldout / "corpus_text_document") if corpus == "heldout" else None)
    md = (out / "sweep.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| AdamW, data parallel |")]
    assert len(rows) == 2 and "built-in corpus (tuning), 4" in rows[0] and "held-out corpus (check), 4" in rows[1], md
    label = sweep.cell_label(ship)
    assert all("| lr 0.001 |" in r and "(n=2)" in r and f"| {label}: " in r and "%)" in r for r in rows), rows
    assert re.search(rf"- AdamW, data parallel: (adopt|keep) lr (0\.001|{ship[2:]})", md), md
    assert "## MuLoCo (H=2, fp32 outer, 2 replicas): held-out corpus (check), 4 steps" in md
    rows = report_sweep.headlines(tmp_path)  # (the MuLoCo cell is not the shipped default: no row)
    assert len(rows) == 2 and all(r.startswith(report_sweep.HEADLINE) and r.endswith("| within 0.5% |") for r in rows), rows
    assert report_sweep.section(tmp_path)[0] == report_sweep.HEADING


def test_sweep_changes_a_default_only_where_it_wins_on_both_corpora(monkeypatch):
    """Guards against the sweep choosing on the held-out corpus, or adopting a cell that wins on
    the tuning corpus alone or inside the spread of its paired gap on the other: the tuned cell is
    the built-in corpus's best finalist (a cell run on the first seed only is none), or of the
    finalists that tie it, the one nearest the previous default; it is adopted only when it beats the previous default beyond the
    spread on both corpora at the tuning steps; the shipped default's gap is to each corpus's own
    best cell."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import sweep

    builtin = {("builtin-200", "adamw", "lr0.001"): {1: 5.00, 2: 5.10},
               ("builtin-200", "adamw", "lr0.004"): {1: 4.90, 2: 5.00},
               ("builtin-200", "adamw", "lr0.008"): {1: 4.95, 2: 5.05},
               ("builtin-200", "adamw", "lr0.002"): {1: 4.80}}  # no finalist (first seed only): not the tuned one
    clear = {("heldout-200", "adamw", "lr0.001"): {1: 5.00, 2: 5.10},
             ("heldout-200", "adamw", "lr0.004"): {1: 4.95, 2: 5.06},
             ("heldout-200", "adamw", "lr0.008"): {1: 4.90, 2: 5.00}}  # best here: must not be the tuned one
    tuned, decision, gaps = sweep.verdict({**builtin, **clear}, "adamw", 32)
    assert tuned == "lr0.004" and decision.startswith("adopt lr 0.004"), decision
    assert gaps["heldout-200"][0] == pytest.approx((-1.0 - 100 * 0.04 / 5.1) / 2)
    tie = {**clear, ("heldout-200", "adamw", "lr0.004"): {1: 4.95, 2: 5.11}}  # -1.0% and +0.2%: inside the spread
    tuned, decision, _ = sweep.verdict({**builtin, **tie}, "adamw", 32)
    assert decision.startswith("keep lr 0.001") and "heldout: tie" in decision, decision
    tuned, decision, _ = sweep.verdict(builtin, "adamw", 32)
    assert decision.startswith("keep lr 0.001") and "heldout: not run" in decision, decision
    # a finalist inside the spread of its gap to the best one: the tie nearest the previous default is tuned
    near = {**builtin, ("builtin-200", "adamw", "lr0.003"): {1: 4.93, 2: 4.99}}  # +0.6% and -0.2% against lr0.004
    assert sweep.tuned_cell(near, "builtin-200", "adamw", 32) == "lr0.003"
    assert sweep.best_cell(near, "builtin-200", "adamw") == ("lr0.004", [1, 2])
    monkeypatch.setattr(sweep, "shipped", lambda group, h: "lr0.004")
    rows = [line for line in sweep.report({**builtin, **clear}, 32) if line.startswith("| AdamW, data parallel |")]
    assert rows[0].endswith("| lr 0.004: the best cell (within 0.5%) |"), rows
    assert rows[1].endswith("| lr 0.004: +1.11% ± 0.13 (n=2) against lr 0.008 (over 0.5%) |"), rows
    assert sweep.parse_grid("muon:lr=2e-3,4e-3:x=0.2")[1] == ["lr0.002-x0.2", "lr0.004-x0.2"]
    assert sweep.cell_values("lr0.002-x0.2-olr0.55") == {"lr": "0.002", "x": "0.2", "olr": "0.55"}


def test_heldout_corpus_keeps_the_prose_and_drops_the_navigation():
    """Guards against the held-out corpus filling up with what is no prose (a page's navigation,
    table of contents, scripts, styles) or running sections together: each heading starts a
    document, text inside skipped elements is dropped even where the HTML leaves tags open."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import heldout_corpus

    body = "Debian packages are built from source. " * 8
    page = (f"<html><head><title>T</title><style>p {{}}</style></head><body><div class='navheader'>Prev Next"
            f"<a href='x'>Up</a></div><div class='toc'><p>1. Intro</div><h2>1. Intro</h2><p>{body}<br>second line"
            f"<script>var x = 1;</script><h2>2. More</h2><p>{body}<p>tail &amp; end<div class='navfooter'>Home</div>"
            "</body></html>")
    sections = heldout_corpus.page_sections(page)
    assert len(sections) == 2 and sections[0].startswith("1. Intro\n") and sections[1].startswith("2. More\n")
    assert "second line" in sections[0] and sections[1].endswith("tail & end")
    for junk in ("Prev", "Up", "var x", "p {}", "Home", "T\n"):
        assert all(junk not in s for s in sections), junk

def test_speed_smoke(tmp_path, cache_dir):
    """Guards against the speed study breaking: on a 2-node simulated cluster with a
    shaped link it trains bf16, LoCo 4-bit and DiLoCo replicas without an outer exchange
    and writes the tables and plots; LoCo sends about a quarter of bf16's bytes; the
    DiLoCo replicas' steps send next to nothing between the nodes (the link counters read
    between two steps: under 1% of bf16's), and the DiLoCo table compares against the
    computed bf16 ring all-reduce, not gloo's reduce-scatter."""
    _require_netns()
    _run(["benchmarks/speed.py", "--smoke", "--out", str(tmp_path), "--data-cache-path", cache_dir,
          "--variants", "bf16,loco4,dlnone"])
    lines = (tmp_path / "speed.md").read_text().splitlines()
    assert "compute dtype" in lines[0]  # which dtype the probe picked is reported
    bf16 = next(l for l in lines if l.startswith("| bf16 reduce-scatter"))
    loco = next(l for l in lines if l.startswith("| LoCo 4-bit"))
    sent = [float(row.split("|")[7].replace(",", "")) for row in (bf16, loco)]
    assert 0.2 < sent[1] / sent[0] < 0.3
    assert (tmp_path / "plots" / "2x1_1gbit" / "step_time.png").exists()
    wire = {v: json.loads((tmp_path / "runs" / f"2x1_1gbit_{v}.wire.json").read_text())["wire_bytes_per_step"]
            for v in ("bf16", "dlnone")}
    assert wire["dlnone"]["tx"] < 0.01 * wire["bf16"]["tx"], wire
    assert any(line.startswith("A bf16 ring all-reduce of the gradients between the replicas") for line in lines)


def _require_netns():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from simcluster import available

    reason = available()
    if reason:
        pytest.skip(f"simulated cluster unavailable: {reason}")


def test_memory_analytic_table_backs_the_configs():
    """Guards against the memory benchmark rotting and against the shipped 7B/13B/8x7B
    configs drifting from a layout its table says fits an 80 GB GPU."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from memory import analytic

    from loco_megatron.cli import parse_config
    from loco_megatron.training.memory_estimate import PARTS

    for name, dp in (("llama2_7b", 4), ("llama2_13b", 2), ("mixtral_8x7b", 8)):
        c = parse_config(["--config", str(REPO / "configs" / f"{name}.yaml")])
        p = c.parallel
        r = analytic(str(REPO / "configs" / f"{name}.yaml"), p.tensor_model_parallel_size,
                     p.pipeline_model_parallel_size, dp, p.expert_model_parallel_size,
                     p.virtual_pipeline_model_parallel_size or 1, c.model.recompute_granularity or "none",
                     p.sequence_parallel, micro_batch=c.data.micro_batch_size)
        assert 0 < r["total"] < 0.92 * 80e9, (name, r)
        assert r["total"] == pytest.approx(sum(r[k] for k in PARTS)), (name, r)  # (not dp, outer_elements)


def test_fsdp_memory_estimate_shards_what_the_strategy_says():
    """Guards against the memory estimate (``--dry-run``, benchmarks/memory.py) ignoring
    --use-megatron-fsdp: counting full weights/gradients under ZeRO-3, sharding the optimizer
    over all of DP instead of the HSDP sharding group, or a LoCo error buffer of the whole
    gradient where FSDP's hook keeps one of the shard (under every strategy, optim's
    whole-bucket gradient buffers included)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from memory import analytic

    cfg = str(REPO / "configs" / "llama2_7b.yaml")
    hsdp = {"use_megatron_fsdp": True, "num_distributed_optimizer_instances": 2, "loco_ranks_per_node": 8,
            "ckpt_format": "torch"}

    def est(extra, bits=4):
        return analytic(cfg, 1, 1, 16, 1, 1, "full", False, loco_bits=bits, extra={**extra, "loco_bits": bits})

    ddp = est({})
    by_strategy = {s: est({**hsdp, "data_parallel_sharding_strategy": s})
                   for s in ("optim", "optim_grads", "optim_grads_params")}
    params = ddp["params"]
    zero3 = by_strategy["optim_grads_params"]
    assert zero3["optimizer"] == pytest.approx(12 * params / 8)  # the sharding group: 16 ranks / 2 instances
    assert zero3["loco_error"] == pytest.approx(params / 8 * (1 + 4 / 256))
    assert ddp["optimizer"] == pytest.approx(12 * params / 16) and ddp["loco_error"] > 7 * zero3["loco_error"]
    totals = [by_strategy[s]["total"] for s in ("optim", "optim_grads", "optim_grads_params")]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 3
    assert {by_strategy[s]["loco_error"] for s in by_strategy} == {zero3["loco_error"]}  # the shard's, always
    assert by_strategy["optim"]["weights"] == ddp["weights"] and zero3["weights"] < ddp["weights"] / 4
    flat = est({"use_megatron_fsdp": True, "ckpt_format": "torch"}, bits=0)
    assert flat["weights"] < zero3["weights"] and flat["optimizer"] == pytest.approx(12 * params / 16)


def test_report_rewrites_only_the_named_section(tmp_path, monkeypatch):
    """Guards against `report.py --sections 2bit|checkpoint` clobbering the rest of the page,
    inserting a section twice on a second run or out of numeric order, or a 2-bit headline
    not taken from the table."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import report

    table = ("# Loss parity: 200 steps\n\n| variant | final eval loss | best eval loss | gap to fp32 (final) |\n"
             "|---|---|---|---|\n| full precision (fp32 reduce-scatter) | 4.98 | 4.98 | +0.00% |\n"
             "| LoCo 2-bit | 5.16 | 5.16 | +3.60% |\n| LoCo 2-bit (uniform + mse) | 5.01 | 5.01 | +0.60% |\n")
    (tmp_path / "quality2bit").mkdir()
    (tmp_path / "quality2bit" / "quality.md").write_text(table)
    (tmp_path / "checkpoint.txt").write_text("| model | format |\n|---|---|\n| tiny | torch |\n")
    page = tmp_path / "b.md"
    page.write_text("# B\n\n## 5. Pre\n\nkeep me\n\n## What the numbers mean\n\n- end\n")
    for _ in range(2):
        for section in ("2bit", "checkpoint"):  # 6 inserted after 7 exists: must land before it
            monkeypatch.setattr(sys, "argv", ["report.py", "--results", str(tmp_path), "--out", str(page),
                                              "--sections", section])
            report.main()
    text = page.read_text()
    assert text.count(report.TWO_BIT_HEADING) == 1 and text.count(report.CHECKPOINT_HEADING) == 1
    assert "keep me" in text and text.endswith("- end\n") and text.count("| tiny | torch |") == 1
    assert (text.index("## 5. Pre") < text.index(report.CHECKPOINT_HEADING) < text.index(report.TWO_BIT_HEADING)
            < text.index("## What the numbers mean"))
    section = text.split(report.TWO_BIT_HEADING, 1)[1].split("\n## ", 1)[0]
    assert ("| 200 steps | best 2-bit variant, LoCo 2-bit (uniform + mse): final eval loss vs full precision "
            "| +0.60% | within 1% |") in section
    assert "| 200 steps | original 2-bit scheme (LoCo 2-bit): final eval loss vs full precision | +3.60% |  |" in section
    assert not re.search(r"\b(met|missed)\b", section), section  # figures against targets, no verdict prose


def test_report_fast_section_updates_its_headlines_once(tmp_path, monkeypatch):
    """Guards against `report.py --sections fast` appending its headline rows again on
    every run (or dropping the other rows), against a figure not computed from the scripts'
    outputs (1.30x compress against a 1.2x target, a 1.05x step against 1.10x), and against
    a verdict in prose ("met", "missed by") where the table's measured and target columns
    say it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import report
    import report_fast

    fast = tmp_path / "fast"
    (fast / "speed_1x2").mkdir(parents=True)
    (fast / "options_1.txt").write_text(
        "quantiser options ...\n  2-bit default (uniform/mse/hadamard/nearest)   compress    65.0 ms =  1.30x 4-bit"
        "   decompress+sum     7.0 ms =  1.10x 4-bit\n")
    cells = " | ".join(["0"] * 8)
    (fast / "speed_1x2" / "speed.md").write_text(
        f"# speed\n\n### 1x2\n\n| LoCo 4-bit | 100.0 | {cells} |\n| LoCo 2-bit | 105.0 | {cells} |\n")
    page = tmp_path / "b.md"
    page.write_text("# B\n\n## Headlines against the targets\n\nintro\n\n| setting | figure | measured | target |\n"
                    "|---|---|---|---|\n| 2x1 | old row | 0.5x | <= 0.7x |\n\n"
                    "## 5. Pre\n\nkeep me\n\n## What the numbers mean\n\n- end\n")
    for _ in range(2):
        monkeypatch.setattr(sys, "argv", ["report.py", "--results", str(tmp_path), "--out", str(page),
                                          "--sections", "fast"])
        report.main()
    text = page.read_text()
    heads = text.split("## Headlines against the targets", 1)[1].split("\n## ", 1)[0]
    assert heads.count(report_fast.HEADLINE) == 4, heads  # compress, decompress, 1x2 step, GPU not lent
    assert "| 2x1 | old row | 0.5x | <= 0.7x |\n| section 10: " in heads and text.count(report_fast.HEADING) == 1
    assert ("| section 10: CPU, one thread, 16M elements, 1 run | 2-bit default compress / 4-bit kernel's, CPU time "
            "| 1.30x (median 1.30x) | <= 1.2x |") in heads
    assert "| section 10: 1x2, loopback | 2-bit default step / 4-bit step | 1.05x | <= 1.10x |" in heads
    section = text.split(report_fast.HEADING, 1)[1].split("\n## ", 1)[0]
    assert "| 1x2, loopback | 2-bit default step / 4-bit step | 1.05x | <= 1.10x |" in section
    assert not re.search(r"\b(met|missed)\b", heads + section)
    assert "keep me" in text and text.endswith("- end\n")


def test_checkpoint_smoke(cache_dir, monkeypatch, capsys):
    """Guards against the checkpoint benchmark breaking, and against checkpoints that miss
    the optimizer: every format holds at least fp32 weights + two Adam moments (12 bytes
    per parameter); against the memory table losing its per-rank rows; and against the
    distributed optimizer's state being copied for a synchronous save. Asserts on
    sizes, never on the printed times or resident-set figures. (Its torchruns on the
    suite's fork server: _main_on_fork_server.)"""
    out = _main_on_fork_server("checkpoint.py", ["--smoke", "--data-cache-path", cache_dir], monkeypatch,
                               capsys).splitlines()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out if line.startswith("| tiny")]
    assert [r[1] for r in rows] == ["torch", "torch_dist async"]
    assert all(float(r[8]) >= 12 for r in rows), rows
    out = _main_on_fork_server("checkpoint.py", ["--smoke", "--memory", "--data-cache-path", cache_dir], monkeypatch,
                               capsys).splitlines()
    memory = [[c.strip() for c in line.split("|")[1:-1]] for line in out if line.startswith("| tiny")]
    # One row per rank, its own optimizer shard beside the measured peaks (figures, no threshold).
    assert [(r[1], r[2]) for r in memory] == [("DP2", "0"), ("DP2", "1")], memory
    assert all(float(r[3]) > 0 for r in memory), memory
    # The synchronous save stages nothing itself (megatron's writer does): no state copied by
    # our code; the device peak is n/a on CPU.
    assert all(r[13] == "0.0" and r[11] == "n/a" for r in memory), memory


@pytest.mark.parametrize("kernels", ["cpu", "triton"])
def test_shapes_check_matches_and_can_fail(kernels, monkeypatch):
    """Guards against the GPU check's training-shapes step (benchmarks/shapes_check.py, the
    CPU twin of its CUDA run) rotting or passing blindly: a ragged bucket over 3 simulated
    ranks matches the torch reference on the C++ kernels bit for bit (Triton interpreted:
    within the documented bound) for the 4- and 2-bit defaults, and a decompress-and-sum
    that drops one rank's row is reported as differing."""
    env = {"TRITON_INTERPRET": "1"} if kernels == "triton" else {}
    numel = 5001 if kernels == "triton" else 70001
    proc = _run(["benchmarks/shapes_check.py", "--kernels", kernels, "--numel", str(numel), "--world", "3",
                 "--steps", "2"], env={**os.environ, **env})
    lines = [line for line in proc.stdout.splitlines() if "-bit default:" in line]
    assert len(lines) == 2 and all("DIFFERS" not in line for line in lines), proc.stdout
    if kernels == "cpu":
        assert all("identical to torch, bit for bit" in line for line in lines), proc.stdout
        sys.path.insert(0, str(REPO / "benchmarks"))
        import shapes_check  # noqa: PLC0415

        original = shapes_check.decompressor
        fused = original("cpu")

        def drop_first_row(recv, layout, out, scale):
            fused(recv[1:], layout, out, scale)

        monkeypatch.setattr(shapes_check, "decompressor", lambda k: drop_first_row if k == "cpu" else original(k))
        problems, _, _ = shapes_check.check("cpu", 4, 70001, 3, torch.float32, 1, torch.device("cpu"))
        assert any("reduced shards differ" in p for p in problems), problems


def test_report_diloco_targets_come_from_the_tables(tmp_path, monkeypatch):
    """Guards against DiLoCo figures not taken from the scripts' outputs, or taken from the
    wrong column: the wire ratio is the one against a bf16 ring all-reduce (0.0080x, not the
    measured bf16 row's), the step ratio the no-exchange one (1.25x), the no-exchange row
    shows its wire bytes and the store's share; the loss rows pick each width's best form
    at its tuned LR with its paired spread and verdict; the elastic rows carry the worst
    lost/interval and the rejoin time. Also guards against the guide's measured block being
    appended again on a second run instead of replaced, and against met/missed prose (the
    targets are a table of figures)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import report
    import report_diloco

    head = ("| DiLoCo run | mean step (s) | outer bytes / rank / step | outer time / step (ms), exposed "
            "| measured wire bytes to other nodes / rank / step | of them the rendezvous store's "
            "| wire bytes vs a bf16 ring all-reduce every step | mean step vs no outer exchange |\n"
            "|---|---|---|---|---|---|---|---|\n")
    speed = ("# Speed: 64 steps\n\n### 2x1 (inter-node link 100mbit)\n\n| gradient sync | x |\n|---|---|\n"
             "| bf16 | 1 |\n\n" + head
             + "| DiLoCo H=32, LoCo 4-bit outer | 0.625 | 9,000 | 40.0, 30.0 | 6,400 | 900 | 0.0080 | 1.25 |\n"
             "| DiLoCo replicas, no outer exchange | 0.5 | 0 | 0.0, 0.0 | 2,000 | 1,990 | 0.0025 | 1.00 |\n")
    outer_lr = ("# Outer learning rate: 1024 steps\n\n## H=32: each at its tuned LR, paired by seed against fp32 "
                "outer at its tuned LR\n\n| variant (tuned lr) | final eval loss (mean ± sd) | vs fp32 outer (lr 0.4), "
                "paired | verdict |\n|---|---|---|---|\n| fp32 outer (0.4) | 4.4000 ± 0.0100 | reference | |\n"
                "| LoCo 4-bit outer, error feedback beta 0.8 (0.55) | 4.41 | +0.30% ± 0.20 (n=4) | beyond the spread |\n"
                "| LoCo 4-bit outer, no error feedback (0.4) | 4.40 | +0.05% ± 0.20 (n=4) | tie (inside the spread) |\n"
                "| LoCo 2-bit outer, no error feedback (0.4) | 4.45 | +1.10% ± 0.30 (n=4) | beyond the spread |\n")
    elastic = ("# Elastic\n\n| replicas | median step (s) | outer interval (s) | time lost per survivor (s) | "
               "worst lost / interval (target <= 1) | rejoin (s) | whole-job restart (s) |\n|---|---|---|---|---|---|---|\n"
               "| 3 | 0.150 | 4.8 | 2.0, 2.5 | 0.52 | 41.0 | 30.0 + 2.4 |\n")
    for folder, name, text in (("speed_diloco", "speed.md", speed), ("quality_outer_lr_r2", "outer_lr.md", outer_lr),
                               ("elastic", "elastic.md", elastic)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(text)
    page, guide = tmp_path / "benchmarks.md", tmp_path / "diloco.md"
    page.write_text("# B\n\n## 5. Pre\n\nkeep me\n\n## What the numbers mean\n\n- end\n")
    guide.write_text(f"# G\n\n{report_diloco.MARK_BEGIN}\nold\n{report_diloco.MARK_END}\n\n## Flags\n")
    for _ in range(2):
        monkeypatch.setattr(sys, "argv", ["report.py", "--results", str(tmp_path), "--out", str(page),
                                          "--sections", "diloco"])
        report.main()
    text, g = page.read_text(), guide.read_text()
    assert text.count(report_diloco.HEADING) == 1 and "keep me" in text and text.endswith("- end\n")
    rows = [ln for ln in text.splitlines() if ln.startswith("| 2x1") or ln.startswith("| 2 replicas")
            or ln.startswith("| elastic")]
    assert rows == [
        "| 2x1, DiLoCo H=32, 4-bit outer | wire bytes between the replicas vs a bf16 ring all-reduce every step "
        "| 0.0080x | <= 0.01x |",
        "| 2x1 at 100 Mbit/s, DiLoCo H=32, 4-bit outer | mean step vs no outer exchange | 1.25x | <= 1.2x |",
        "| 2x1, DiLoCo replicas without outer exchanges | wire bytes to other nodes / rank / step, of them the "
        "rendezvous store's | 2,000, 1,990 | the store's only |",
        "| 2 replicas, H=32, best 4-bit form: LoCo 4-bit outer, no error feedback (0.4) | final eval loss vs fp32 "
        "outer, each at its tuned LR, paired by seed (mean ± sd) | +0.05% ± 0.20 (n=4); tie (inside the spread) "
        "| within 0.25% |",
        "| 2 replicas, H=32, best 2-bit form: LoCo 2-bit outer, no error feedback (0.4) | final eval loss vs fp32 "
        "outer, each at its tuned LR, paired by seed (mean ± sd) | +1.10% ± 0.30 (n=4); beyond the spread "
        "| within 0.5% |",
        "| elastic, 3 replica jobs, one killed | worst time lost by a survivor / outer interval | 0.52 | <= 1 |",
        "| elastic, 3 replica jobs, one restarted | launch to healed (s) | 41.0 | < 60 |"], rows
    assert "missed" not in text and " met" not in text
    assert g.count(report_diloco.MARK_BEGIN) == 1 and "old" not in g and g.endswith("## Flags\n")
    assert "| DiLoCo H=32, LoCo 4-bit outer | 0.625 |" in g


def test_diloco_study_variants_are_well_formed():
    """Guards against the DiLoCo rows of the studies running something else than their
    labels say: each speed row gives the replica count per node and H=32 (the no-exchange
    row an H beyond any run; the eager row eager updates), each quality row its H, outer width, error feedback form
    (beta 0.8, classic beta 0, none) and gain correction."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import quality
    import speed

    for key in speed.DILOCO:
        flags = speed.VARIANTS[key][1]
        assert flags[flags.index("--diloco-replicas") + 1] == "{nodes}"
        h = int(flags[flags.index("--diloco-inner-steps") + 1])
        assert h == (1000000 if key == "dlnone" else 32)
    assert "--diloco-fragments" in speed.VARIANTS["dls4"][1] and "--diloco-sync-delay" in speed.VARIANTS["dls4"][1]
    assert "--diloco-eager" in speed.VARIANTS["dle4"][1] and "--diloco-eager" not in speed.VARIANTS["dl4"][1]
    for key in quality.SECTIONS["diloco"][1:]:
        flags = quality.VARIANTS[key][1]
        bits, h = key[2], key.split("-h")[1]
        assert flags[flags.index("--diloco-outer-bits") + 1] == bits and flags[flags.index("--diloco-inner-steps") + 1] == h
        form = key[3:].split("-h")[0]
        assert ("--no-diloco-outer-error-feedback" in flags) == (form in ("n", "g")), key
        assert ("--diloco-outer-gain-correction" in flags) == form.startswith("g"), key
        beta = flags[flags.index("--diloco-outer-beta") + 1] if "--diloco-outer-beta" in flags else None
        assert (beta == "0") == (form in ("c", "gc")), key


def test_paired_gaps_pick_the_tuned_lr_on_the_sweep_seeds_and_pair_by_seed():
    """Guards against an outer-LR comparison that flatters a variant: the tuned LR must be
    chosen on the seeds every LR ran (a seed run only at one LR must not decide it), a gap
    must be the mean of per-seed differences (not the difference of means, nor against
    another seed), and a gap inside the spread of those differences must be called a tie."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import paired

    finals = {("a", "0.5"): {1: 4.0, 2: 4.2, 9: 1.0},  # seed 9 ran at 0.5 only: must not pick 0.5
              ("a", "1"): {1: 3.9, 2: 4.1},
              ("ref", "0.5"): {1: 3.8, 2: 4.0, 9: 3.0},
              ("ref", "1"): {1: 3.9, 2: 4.1}}
    assert paired.tuned_lr(finals, "a") == ("1", [1, 2])
    assert paired.tuned_lr(finals, "ref") == ("0.5", [1, 2])
    mean, sd, n = paired.paired(finals["a", "1"], finals["ref", "0.5"])
    assert n == 2 and mean == pytest.approx((100 * 0.1 / 3.8 + 100 * 0.1 / 4.0) / 2)
    assert sd == pytest.approx(abs(100 * 0.1 / 3.8 - 100 * 0.1 / 4.0) / 2 ** 0.5)
    assert paired.verdict(0.1, 0.2).startswith("tie") and paired.verdict(0.3, 0.2) == "beyond the spread"
    table = "\n".join(paired.gap_table(finals, ["ref", "a"], "ref", {}))
    assert "| a (1) |" in table and "beyond the spread" in table



def test_first_build_refuses_to_measure_a_niced_or_busy_build():
    """Guards against benchmarks/first_build.py printing a first-build time measured niced
    or on a busy machine as if it were the quiet machine's figure the docs quote: run
    under ``nice`` it measures nothing, exits 2 with one line naming why, before building."""
    proc = subprocess.run(["nice", "-n", "1", sys.executable, "benchmarks/first_build.py"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
    assert lines[0].startswith("first_build.py: error: this process runs at nice ") and "--busy-ok" in lines[0]
