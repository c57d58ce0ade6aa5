"""Layouts: megatron-core's rules for the dense and the (folded) expert grid, --dry-run,
tools/launch.py render's layout check, the TransformerEngine flag, and LoCo on folded MoE."""

import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY, run_launch, torchrun, train_losses

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _dry_run(*args, world=None, env_extra=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env_extra or {}))
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *args, "--dry-run"]
    cmd += ["--world-size", str(world)] if world else []
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _error_line(proc) -> str:
    lines = [l for l in proc.stderr.splitlines() if l.strip() and "warn" not in l.lower()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def _geometry(config) -> int:
    """Ranks the config's header says it assumes: '# GPUs: N nodes x G' or '# CPU: 1 node x R ranks'
    (what a dry run without --world-size checks)."""
    from loco_megatron.training.preflight import header_world_size

    found = header_world_size(str(config))
    assert found, f"{config.name}: its header comment must name the GPUs (or CPU ranks) it assumes"
    return found[0]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_dry_runs_at_its_template_geometry_and_its_header_is_its_dry_run(config):
    """Guards against a shipped config that cannot start on the GPUs its header (and Slurm
    template) assume: the Mixtral config's EP 8 did not divide the DP 4 of its 32-GPU
    template before parallel folding. Also: every GPU config uses TransformerEngine layers
    while this CPU machine still validates it; and the header's figures are its dry run's
    (tools/config_headers.py), not numbers that disagree with it: the GPU configs' dry runs
    assumed vocabulary 4096 and LoCo off while their headers said LLaMA-3's 128256 and 4-bit
    (llama3_8b 45.1 vs 49.2 GiB; Mixtral 'LoCo: off'), and llama_1b's header figure was
    computed with 32000 tokens while it named 128256."""
    from loco_megatron.cli import parse_config
    from loco_megatron.training.preflight import dry_run

    world = _geometry(config)
    out = dry_run(parse_config(["--config", str(config)]), world)  # what --dry-run prints (CLI: below)
    assert f"world size {world} are valid" in out and f"layout: world {world} = TP" in out
    assert re.search(r"memory per GPU \(estimate.*total \d+\.\d (GiB|MiB)", out), out
    if config.stem.startswith("tiny_"):
        assert "local layers" in out
    else:
        assert "transformer_engine layers" in out and "TransformerEngine:" in out
        # The GPU configs state their LoCo setting and vocabulary in the file: the plain dry run shows them.
        assert "LoCo: 4-bit" in out and "(--dry-run-vocab-size: no --tokenizer-model given" in out
    sys.path.insert(0, str(REPO / "tools"))
    import config_headers

    text = config.read_text()
    commands = [l for l in text.splitlines() if l.startswith(config_headers.COMMAND)]
    assert commands and f"--config configs/{config.name} --dry-run --world-size {world}" in commands[0], commands
    assert config_headers.regenerated(text) == text, f"{config.name}: run python tools/config_headers.py"


def test_mixtral_folds_experts_on_its_32_gpus_and_impossible_layouts_give_one_line():
    """Guards against the expert grid not being megatron-core's (world % (ETP x EP x PP)):
    Mixtral's TP 2 x PP 4 x EP 8 fits 32 ranks only with ETP 1 (expert DP 1), and ETP 2
    (megatron's default ETP = TP) needs 64; and against a dry run of an impossible layout
    printing more than one line, a traceback, or exiting 0."""
    mixtral = str(REPO / "configs" / "mixtral_8x7b.yaml")
    proc = _dry_run("--config", mixtral, world=32)
    assert "TP 2 x PP 4 x DP 4" in proc.stdout and "experts ETP 1 x EP 8 x PP 4 x expert DP 1" in proc.stdout
    line = _error_line(_dry_run("--config", mixtral, "--expert-tensor-parallel-size", "2", world=32))
    assert "--expert-tensor-parallel-size x --expert-model-parallel-size" in line and "2 x 8 x 4 = 64" in line
    assert "64" in _dry_run("--config", mixtral, "--expert-tensor-parallel-size", "2", world=64).stdout
    line = _error_line(_dry_run("--tensor-model-parallel-size", "2", world=3))
    assert "--tensor-model-parallel-size" in line and "world size 3" in line
    proc = run_launch([sys.executable, str(REPO / "pretrain_gpt.py"), "--world-size", "4"], None, 120)
    assert "--world-size: only with --dry-run" in _error_line(proc)  # a real start's world is torchrun's


def test_dry_run_without_world_size_checks_the_world_the_config_header_names(tmp_path, monkeypatch, capsys):
    """Guards against ``--dry-run`` of a multi-node config without --world-size quietly
    checking world 1 (a layout nobody will run, saying "LoCo: 4-bit" where one rank
    compresses nothing): it checks the ranks the config's header names and says so in its
    first line; the default config's header names its 2 CPU ranks; a config without such a
    header is one line asking for --world-size, exit 2."""
    from loco_megatron.cli import main_invocation
    from loco_megatron.training.preflight import dry_run

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    llama = str(REPO / "configs" / "llama2_7b.yaml")
    for argv, world, said in ((["--config", llama], 16, f"{llama} names 2 nodes x 8 GPUs in its header"),
                              ([], 2, "configs/tiny_gpt.yaml names 1 node x 2 CPU ranks in its header")):
        config, _, dry = main_invocation([*argv, "--dry-run"])
        assert dry == (world, f"no --world-size: {said}"), dry
        first = dry_run(config, dry.world_size, False, dry.source).splitlines()[0]
        assert first == f"dry run: the config and the layout for world size {world} (no --world-size: {said}) are valid; " \
                        "no process was started", first
    config, _, dry = main_invocation(["--config", llama, "--dry-run", "--world-size", "32"])
    assert dry == (32, "")  # given: no note
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main_invocation(["--dry-run"])[2] == (4, "$WORLD_SIZE")  # a dry run under torchrun
    monkeypatch.delenv("WORLD_SIZE")
    bare = tmp_path / "mine.yaml"
    bare.write_text("# my model\nnum-layers: 2\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main_invocation(["--config", str(bare), "--dry-run"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_gpt.py: error: --world-size: a dry run needs the number of ranks to check: give --world-size N "
        f"({bare} names none in a '# GPUs: N nodes x G' header line)"]


def test_dry_run_with_no_data_parallel_group_says_loco_compresses_nothing():
    """Guards against a dry run at one rank (or DP 1) printing "LoCo: 4-bit ..." as if it
    compressed gradients, where a real start's line says that nothing is compressed (no
    data-parallel group of more than one rank): the dry run prints the same line."""
    from loco_megatron.cli import parse_config
    from loco_megatron.training.preflight import dry_run
    from loco_megatron.training.summary import loco_compresses_nothing, loco_settings

    def loco_line(flags, world):
        config = parse_config(flags)
        return config, next(l for l in dry_run(config, world).splitlines() if l.startswith("LoCo:"))

    for flags, world in ((["--loco-bits", "4"], 1), (["--loco-bits", "4", "--tensor-model-parallel-size", "2"], 2),
                         (["--config", str(REPO / "configs" / "tiny_moe.yaml"), "--loco-bits", "4"], 1)):
        config, line = loco_line(flags, world)
        assert line == loco_compresses_nothing(config), (flags, line)
        assert line.endswith("no data-parallel group of more than one rank here, so nothing is compressed: "
                             "gradients are synced exactly"), line
    for flags, world in ((["--loco-bits", "4"], 2),  # dense DP 2; below: dense DP 1, expert DP 2
                         (["--config", str(REPO / "configs" / "tiny_moe.yaml"), "--loco-bits", "4",
                           "--tensor-model-parallel-size", "4", "--sequence-parallel", "--expert-model-parallel-size",
                           "2", "--expert-tensor-parallel-size", "1"], 4)):
        config, line = loco_line(flags, world)
        assert line == loco_settings(config), (flags, line)


def test_memory_estimate_counts_loco_only_where_a_data_parallel_group_compresses():
    """Guards against the dry run's memory estimate counting LoCo's error buffers and
    workspace where nothing is compressed: ``--dry-run --world-size 1 --loco-bits 4`` said
    "LoCo error + workspace 18.2 MiB" (the same as at world 2) where a real run holds none,
    as did DP 1 inside every DiLoCo replica; and a MoE whose expert DP is 1 (EP = world)
    counted an error for its expert parameters, which its gradient hook never compresses."""
    from loco_megatron.cli import parse_config
    from loco_megatron.training.memory_estimate import estimate, expert_parameter_count

    def loco_mib(out: str) -> float:
        return float(re.search(r"LoCo error \+ workspace ([\d.]+)", out).group(1))

    one, two = (_dry_run("--loco-bits", "4", world=w) for w in (1, 2))  # the command line, as a user runs it
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert loco_mib(one.stdout) == 0.0 and loco_mib(two.stdout) > 0, (one.stdout, two.stdout)

    def est(flags, world):
        config = parse_config(flags)
        return config, estimate(config, world, 4096)

    for flags, world in ((["--loco-bits", "4"], 1), (["--loco-bits", "4", "--diloco-replicas", "2"], 2)):
        _, with_loco = est(flags, world)
        _, without = est([*flags[2:], "--loco-bits", "0"], world)
        assert with_loco["loco_error"] == with_loco["loco_workspace"] == 0, (flags, with_loco)
        assert with_loco["total"] == without["total"], flags
    _, replicas_dp2 = est(["--loco-bits", "4", "--diloco-replicas", "2"], 4)  # DP 2 inside each replica
    assert replicas_dp2["loco_error"] > 0 and replicas_dp2["loco_workspace"] > 0

    moe = ["--config", str(REPO / "configs" / "tiny_moe.yaml"), "--loco-bits", "4"]
    config, both = est(moe, 2)  # dense DP 2, expert DP 2: every gradient compressed
    _, dense_only = est([*moe, "--expert-model-parallel-size", "2"], 2)  # expert DP 1
    per_element = 1 + 4 / config.loco.loco_block_size
    assert both["loco_error"] == pytest.approx(both["params"] * per_element)
    assert dense_only["loco_error"] == pytest.approx((both["params"] - expert_parameter_count(config)) * per_element)


def test_launch_render_dry_runs_the_job_it_renders(tmp_path):
    """Guards against rendering (and then submitting) a job whose layout cannot start: render
    checks nodes x GPUs per node ranks and stops with the dry run's one line, exit 2."""
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURM_JOB_NODELIST="a,b", SLURM_NNODES="2",
               SLURM_GPUS_ON_NODE="8", SLURM_JOB_ID="5")
    cmd = [sys.executable, "tools/launch.py", "render", "--config", "configs/mixtral_8x7b.yaml",
           "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --expert-tensor-parallel-size x --expert-model-parallel-size x "
        "--pipeline-model-parallel-size = 1 x 8 x 4 = 32 does not divide the world size 16"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(env, SLURM_NNODES="4", SLURM_JOB_NODELIST="a,b,c,d"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "# layout: world 32 = TP 2 x PP 4 x DP 4" in proc.stdout
    assert sum(1 for l in proc.stdout.splitlines() if "tools/torchrun.py" in l) == 4


def test_config_rules_for_expert_folding_are_one_line_errors():
    """Guards against megatron-core asserting (a traceback on every rank) for layouts the
    config could have refused: biased (--no-swiglu) experts need ETP 1, the expert FFN must
    split over ETP, ETP needs experts, and EP with TP needs sequence parallelism."""
    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError

    moe = ["--num-experts", "4", "--tensor-model-parallel-size", "2"]
    for flags, named in ((moe + ["--no-swiglu"], "--expert-tensor-parallel-size"),
                         (moe + ["--moe-ffn-hidden-size", "33", "--sequence-parallel"], "--moe-ffn-hidden-size"),
                         (["--expert-tensor-parallel-size", "1"], "needs --num-experts"),
                         (moe + ["--expert-model-parallel-size", "2"], "--sequence-parallel"),
                         (moe + ["--expert-tensor-parallel-size", "1", "--sequence-parallel"], "EP > 1 or ETP = TP")):
        with pytest.raises(ConfigError, match=re.escape(named)):
            parse_config(flags)
    ok = parse_config(moe + ["--no-swiglu", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2",
                             "--sequence-parallel"])
    assert (ok.data_parallel_size(4), ok.expert_data_parallel_size(4)) == (2, 2)


def test_transformer_engine_flag_without_te_is_one_line_before_any_process_group(tmp_path):
    """Guards against --transformer-impl transformer_engine on a machine without
    TransformerEngine failing deep in megatron's layer specs (after torch.distributed started,
    once per rank) instead of one line, exit 2, with nothing written. (Where TE is installed,
    the same check must let the run through.)"""
    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError
    from loco_megatron.model import check_transformer_engine

    config = parse_config(["--transformer-impl", "transformer_engine"])
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        with pytest.raises(ConfigError):
            check_transformer_engine(config)
    else:
        check_transformer_engine(config)
        return
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), "--transformer-impl", "transformer_engine",
                           "--save", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    line = _error_line(proc)
    assert "--transformer-impl transformer_engine: TransformerEngine cannot be imported" in line
    assert not out.exists()


def _params(path) -> dict:
    model = torch.load(path, weights_only=False)["model"][0]
    return {k: v for k, v in model.items() if torch.is_tensor(v) and v.is_floating_point()}


@pytest.mark.parametrize("flags,expert_dp_groups", [
    # EP 2 is the folded layout whose expert buckets LoCo compresses; EP 4 (expert groups of
    # one rank, megatron's exact path) was dropped for suite time: size-1 expert groups are
    # covered by the MoE EP = DP runs of tests/test_training.py.
    (["--expert-model-parallel-size", "2"], [[0, 2], [1, 3]]),
], ids=["tp2-ep2-etp1"])
def test_folded_moe_trains_with_loco_and_every_group_agrees(flags, expert_dp_groups, cache_dir, tmp_path):
    """Guards against LoCo syncing expert buckets over the wrong group under parallel folding
    (TP 2 with ETP 1 on 4 gloo ranks): expert gradients must be reduced over megatron-core's
    expert data-parallel group (EP 4: one rank each, megatron's exact path; EP 2: {0,2} and
    {1,3}, compressed, while TP peers 0 and 1 hold different experts), dense ones over the
    dense DP group, and TP-replicated ones (router, norms) must stay equal on all ranks. After
    LoCo 4-bit training with finite losses, every parameter is bit-identical on the ranks of
    the group that owns it (and folded experts are not averaged across TP: they differ)."""
    from megatron.core.parallel_state import RankGenerator

    ck = tmp_path / "ck"
    args = TINY + ["--num-experts", "4", "--moe-router-topk", "2", "--tensor-model-parallel-size", "2",
                   "--expert-tensor-parallel-size", "1", "--sequence-parallel", *flags, "--loco-bits", "4",
                   "--train-iters", "3", "--save", str(ck), "--save-interval", "3", "--ckpt-format", "torch"]
    proc, metrics = torchrun(4, args, cache_dir, tmp_path)
    losses = train_losses(metrics)
    assert sorted(losses) == [1, 2, 3] and all(torch.isfinite(torch.tensor(v)) for v in losses.values()), losses
    assert [m for m in metrics if "comm/compressed_fraction" in m][-1]["comm/compressed_fraction"] == pytest.approx(1.0)
    ep = int(flags[1])
    # megatron-core's own rank layout (initialize_model_parallel's generators, default order).
    dense = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=1, ep=ep, dp=4 // ep, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert expert.get_ranks("dp") == expert_dp_groups
    ranks = [_params(ck / "iter_0000003" / f"rank_0000{r}.pt") for r in range(4)]
    for key in ranks[0]:
        if ".experts." in key:
            groups = expert.get_ranks("dp")
        elif "router" in key or "layernorm" in key or "final_layernorm" in key:
            groups = [[0, 1, 2, 3]]  # replicated over TP and DP
        else:
            groups = dense.get_ranks("dp")
        for group in groups:
            for r in group[1:]:
                assert torch.equal(ranks[group[0]][key], ranks[r][key]), (key, group)
        if ".experts." in key:  # TP peers hold different experts under folding
            assert not torch.equal(ranks[0][key], ranks[1][key]), key
