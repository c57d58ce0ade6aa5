"""Bad input: one line naming the flag or file, non-zero exit, nothing written."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import REPO, run_launch


def _run(args, tmp_path, env_extra=None, cache=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env.update(env_extra or {})
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *args,
           "--save", str(out / "ckpt"), "--metrics-jsonl", str(out / "m.jsonl")]
    if cache:
        cmd += ["--data-cache-path", cache]
    proc = run_launch(cmd, {**env, "OMP_NUM_THREADS": "1"}, 300, cwd=tmp_path)  # on the fork server
    return proc, out


def _assert_one_line_error(proc, out, needle):
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.strip() and "warn" not in l.lower()]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert needle in lines[0], lines[0]
    assert not out.exists(), "bad input must not write anything"


@pytest.mark.parametrize("args,needle", [
    (["--loco-bits", "3"], "--loco-bits"),
    (["--loco-beta", "1.0"], "--loco-beta"),
    (["--param-gather-bits", "3"], "--param-gather-bits"),
    (["--param-gather-bits", "2", "--loco-block-size", "264"], "--param-gather-bits"),  # hadamard: power of two
    (["--param-gather-bits", "4", "--no-use-distributed-optimizer"], "--param-gather-bits"),
    (["--loco-block-size", "100"], "--loco-block-size"),
    (["--num-attention-heads", "3"], "--hidden-size"),
    (["--tensor-model-parallel-size", "3"], "--num-attention-heads"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], "--num-experts"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], "--global-batch-size"),
    (["--lr-warmup-iters", "500"], "--lr-warmup-iters"),
    (["--data-path", "nowhere/x"], "--data-path: nowhere/x.bin does not exist"),  # not "--tokenizer-model: is required"
    (["--train-data-path", "nowhere/t", "--valid-data-path", "nowhere/v"], "--train-data-path: nowhere/t.bin does not"),
    (["--split", "1,2"], "--split"),
    (["--config", "missing.yaml"], "missing.yaml"),
])
def test_bad_flags(args, needle, tmp_path):
    """Guards against invalid values starting a run or dying with a traceback."""
    proc, out = _run(args, tmp_path)
    _assert_one_line_error(proc, out, needle)


def test_unknown_config_key(tmp_path):
    """Guards against typos in config files being silently ignored."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num-layers: 2\nnum-layerz: 3\n")
    proc, out = _run(["--config", str(cfg)], tmp_path)
    _assert_one_line_error(proc, out, "num-layerz")


def test_world_size_not_divisible_by_tp_pp(tmp_path):
    """Guards against a layout that does not fit the launched ranks."""
    proc, out = _run(["--tensor-model-parallel-size", "2"], tmp_path, {"WORLD_SIZE": "3"})
    _assert_one_line_error(proc, out, "world size 3")


def test_missing_and_corrupt_data_files(tmp_path, cache_dir):
    """Guards against crashes deep inside megatron on missing/corrupt .bin/.idx files
    and on a tokenizer whose vocabulary does not match the data."""
    from loco_megatron.data.corpus import ensure_default_corpus

    prefix, model = ensure_default_corpus(cache_dir, 4096)
    proc, out = _run(["--data-path", str(tmp_path / "nope"), "--tokenizer-model", model], tmp_path)
    _assert_one_line_error(proc, out, "nope.bin")
    # Both missing: the dataset is named (it decides which tokenizer is needed), not the tokenizer.
    proc, out = _run(["--data-path", str(tmp_path / "nope"), "--tokenizer-model", str(tmp_path / "tok.model")],
                     tmp_path)
    _assert_one_line_error(proc, out, f"--data-path: {tmp_path / 'nope'}.bin does not exist")
    proc, out = _run(["--data-path", prefix, "--tokenizer-model", str(tmp_path / "tok.model")], tmp_path)
    _assert_one_line_error(proc, out, "tok.model")

    bad = tmp_path / "bad"
    pathlib.Path(str(bad) + ".idx").write_bytes(pathlib.Path(prefix + ".idx").read_bytes())
    pathlib.Path(str(bad) + ".bin").write_bytes(pathlib.Path(prefix + ".bin").read_bytes()[:1000])
    proc, out = _run(["--data-path", str(bad), "--tokenizer-model", model], tmp_path)
    _assert_one_line_error(proc, out, "corrupt")

    from loco_megatron.data.tokenizer import train_sentencepiece

    small = train_sentencepiece(["def f(x):\n    return x + 1\n" * 50, "import os\n" * 20] * 20,
                                str(tmp_path / "small"), 300)
    proc, out = _run(["--data-path", prefix, "--tokenizer-model", small], tmp_path)
    _assert_one_line_error(proc, out, "--tokenizer-model")


def test_corrupt_checkpoint_is_refused(tmp_path, cache_dir):
    """Guards against --load crashing mid-start or silently training from scratch when
    the checkpoint it points at is unreadable."""
    ck = tmp_path / "ck"
    (ck / "iter_0000004").mkdir(parents=True)
    (ck / "iter_0000004" / "rank_00000.pt").write_bytes(b"garbage")
    (ck / "latest_checkpointed_iteration.txt").write_text("4\n")
    proc, out = _run(["--load", str(ck), "--num-layers", "2", "--hidden-size", "64"], tmp_path,
                     cache=cache_dir)
    assert proc.returncode != 0
    assert "--load" in proc.stderr and "rank_00000.pt" in proc.stderr
    assert (ck / "iter_0000004" / "rank_00000.pt").read_bytes() == b"garbage"


@pytest.mark.parametrize("argv,needle", [
    (["--num-layerz", "3"], "unknown flag --num-layerz (did you mean --num-layers?)"),
    (["--lr-warmup-iter", "3"], "unknown flag --lr-warmup-iter (did you mean --lr-warmup-iters?)"),
    (["--foo-bar", "1"], "unknown flag --foo-bar"),  # nothing is close: no "(did you mean --loco-beta?)"
    (["--num-layers", "two"], "argument --num-layers: invalid int value: 'two'"),
])
def test_flag_error_is_one_line_from_rank_0_only(argv, needle, monkeypatch, capsys):
    """Guards against an argparse error printing the 60-line usage from every rank (their
    lines running together): one line, from rank 0 only, exit 2 on every rank."""
    from loco_megatron.cli import main_config

    for rank, lines_wanted in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as info:
            main_config(argv)
        assert info.value.code == 2
        err = capsys.readouterr()
        lines = [line for line in (err.out + err.err).splitlines() if line.strip()]
        assert len(lines) == lines_wanted, lines[:5]
        if lines:
            assert lines[0] == f"pretrain_gpt.py: error: {needle}"


def test_a_suggestion_is_offered_only_when_a_name_is_close(tmp_path):
    """Guards against suggesting an unrelated flag or key for an unknown one: ``--foo-bar``
    said "(did you mean --loco-beta?)", the shared ``--`` making any two flags look alike;
    a dropped or doubled letter is still suggested, in flags and config-file keys."""
    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError

    for flag, wanted in (("--foo-bar", ""), ("--data", ""), ("--hiden-size", " (did you mean --hidden-size?)"),
                         ("--seq-len", " (did you mean --seq-length?)")):
        with pytest.raises(ConfigError) as e:
            parse_config([flag, "1"])
        assert str(e.value) == f"unknown flag {flag}{wanted}"
    cfg = tmp_path / "c.yaml"
    for key, wanted in (("foo-bar", ""), ("num-layerz", " (did you mean num-layers?)")):
        cfg.write_text(f"{key}: 1\n")
        with pytest.raises(ConfigError) as e:
            parse_config(["--config", str(cfg)])
        assert str(e.value) == f"--config: unknown key '{key}' in {cfg}{wanted}"


def test_error_line_is_written_whole_in_one_write(monkeypatch):
    """Guards against two ranks' error lines running together on one console line
    ("...no earlier checkpointpretrain_gpt.py: error: ..."): ``print`` wrote the line and
    its newline in two writes to an unbuffered stderr, and another rank's line came between
    them. The line and its newline are one write, on every rank that prints."""
    from loco_megatron.cli import report_error
    from loco_megatron.config import ConfigError

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    for rank, per_rank in ((0, False), (1, True)):
        stderr = Recorder()
        monkeypatch.setattr(sys, "stderr", stderr)
        error = ConfigError("--save: writing DIR failed on rank 1 (no space left on device)")
        error.per_rank = per_rank
        report_error(error, rank)
        assert stderr.writes == [f"pretrain_gpt.py: error: {error}\n"], stderr.writes


def test_tokenizer_model_without_a_dataset_is_refused(tmp_path, cache_dir):
    """Guards against --tokenizer-model being ignored without --data-path: a missing path
    trained on the built-in corpus with no word, and an existing one was silently unused
    (the built-in corpus has its own tokenizer). Either is one line naming the flag and the
    path, exit 2, before anything is written."""
    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError

    missing = tmp_path / "nope.model"
    proc, out = _run(["--tokenizer-model", str(missing), "--train-iters", "2"], tmp_path, cache=cache_dir)
    _assert_one_line_error(proc, out, f"--tokenizer-model: {missing} is given without --data-path")
    assert proc.returncode == 2
    existing = tmp_path / "tok.model"
    existing.write_bytes(b"x")
    with pytest.raises(ConfigError, match=f"^--tokenizer-model: {existing} is given without --data-path, and the "
                                          "built-in corpus uses its own tokenizer"):
        parse_config(["--tokenizer-model", str(existing)])


def test_load_naming_a_file_is_refused_before_any_set_up(tmp_path, cache_dir):
    """Guards against ``--load FILE`` saying "starting fresh: no checkpoint in --load FILE"
    and training from scratch (then saving over nothing the user meant to resume): a file
    cannot hold a checkpoint. One line, exit 2, before any set-up, nothing written, the file
    untouched; the checkpointer refuses it too, for callers other than pretrain_gpt.py."""
    from loco_megatron.checkpoint import Checkpointer
    from loco_megatron.config import ConfigError

    ckpt = tmp_path / "iter_0000004.pt"
    ckpt.write_bytes(b"weights")
    proc, out = _run(["--load", str(ckpt), "--train-iters", "2"], tmp_path, cache=cache_dir)
    _assert_one_line_error(proc, out, f"--load: {ckpt} is a file, not a checkpoint folder")
    assert proc.returncode == 2 and ckpt.read_bytes() == b"weights"
    with pytest.raises(ConfigError, match="is a file, not a checkpoint folder"):
        Checkpointer(None, str(ckpt), 0, {}).find_resume_dir()


def test_yaml_bool_for_a_number_is_refused(tmp_path):
    """Guards against YAML `num-layers: true` being taken as 1 (bool is an int in Python),
    and against a bad value from a config file not naming the file and key (the user
    looked for a flag they never typed); a flag given on the command line is named as one."""
    import re

    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError

    cfg = tmp_path / "c.yaml"
    at = re.escape(f"--config: {cfg}, key ")
    cfg.write_text("num-layers: true\n")
    with pytest.raises(ConfigError, match=f"^{at}num-layers: True is not an int$"):
        parse_config(["--config", str(cfg)])
    cfg.write_text("lr: false\nloco-bits: 3\n")
    with pytest.raises(ConfigError, match=f"^{at}lr: False is not a float$"):
        parse_config(["--config", str(cfg)])
    with pytest.raises(ConfigError, match=f"^{at}loco-bits: 3 is not one of 0, 2, 4, 8$"):
        parse_config(["--config", str(cfg), "--lr", "0.1"])
    with pytest.raises(ConfigError, match="^--loco-bits: 5 is not one of"):
        parse_config(["--config", str(cfg), "--lr", "0.1", "--loco-bits", "5"])


def test_tokenizer_model_directory_is_named_as_such(tmp_path):
    """Guards against `--tokenizer-model DIR` saying "does not exist" for a folder that does."""
    from loco_megatron.config import ConfigError
    from loco_megatron.data.tokenizer import load_tokenizer

    with pytest.raises(ConfigError, match="is a directory, not a sentencepiece .model file"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_idx_gives_one_line_and_no_stray_traceback(damage, tmp_path, cache_dir, monkeypatch):
    """Guards against a corrupt .idx printing a stray `IndexedDataset.__del__` traceback
    (megatron's half-built object, collected later) after the right one-line error."""
    import gc

    from loco_megatron.config import ConfigError
    from loco_megatron.data.corpus import ensure_default_corpus
    from loco_megatron.data.indexed import check_indexed_dataset

    prefix, _ = ensure_default_corpus(cache_dir, 4096)
    good = pathlib.Path(prefix + ".idx").read_bytes()
    bad = tmp_path / "bad"
    pathlib.Path(str(bad) + ".bin").write_bytes(pathlib.Path(prefix + ".bin").read_bytes())
    pathlib.Path(str(bad) + ".idx").write_bytes(os.urandom(100) if damage == "garbage" else good[:40])
    stray = []
    monkeypatch.setattr(sys, "unraisablehook", stray.append)
    with pytest.raises(ConfigError) as info:
        check_indexed_dataset(str(bad), None, None)
    message = str(info.value)
    del info  # its traceback holds megatron's frames (and any half-built object)
    gc.collect()
    assert stray == [], [s.exc_value for s in stray]
    assert message.startswith(f"--data-path: {bad}.idx is corrupt"), message


def test_bad_input_under_torchrun_is_the_failure_summarys_root_cause(tmp_path):
    """Guards against bad input under torchrun ending in torchrun's summary with
    ``error_file: <N/A>`` and no cause (the one line lost among 45): the worker writes its
    line to torch elastic's error file, so bare torchrun's summary names it as the root
    cause (torchrun exits 1 for any failed worker), and tools/launch_single_node.sh
    (tools/torchrun.py, also under the Slurm templates) ends in that one line with exit 2."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    line = "pretrain_gpt.py: error: --loco-bits: 3 is not one of 0, 2, 4, 8"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "pretrain_gpt.py", "--loco-bits", "3"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    root = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {line}" in root and "<N/A>" not in root, root
    assert 'pretrain_gpt.py", line' not in proc.stderr and "loco_megatron" not in proc.stderr  # no worker traceback

    missing = tmp_path / "nope.model"
    proc = subprocess.run(["bash", "tools/launch_single_node.sh", "configs/tiny_gpt.yaml", "--tokenizer-model",
                           str(missing), "--data-path", str(tmp_path / "ds")], cwd=REPO,
                          env=dict(env, NPROC_PER_NODE="2"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    why = f"pretrain_gpt.py: error: --data-path: {tmp_path / 'ds'}.bin does not exist"  # named before the tokenizer
    last = proc.stderr.strip().splitlines()[-1]  # the rank that met it first prints it
    assert re.fullmatch(rf"torchrun: rank [01] failed with exit code 2: {re.escape(why)}", last), last


def test_bad_input_line_survives_a_slow_rank_0(tmp_path):
    """Guards against the bad-input line going missing under torchrun: every rank meets the
    same error at its own pace, and rank 0 alone printed it while the others slept 3 s and
    exited; a rank 0 still importing then (a loaded machine) was stopped by torchrun's
    teardown before it printed, and the run ended with no `pretrain_gpt.py: error` line at
    all. Here rank 0 starts 60 s late (a sitecustomize used only by this test), so the
    race goes the bad way every time: the line must still appear exactly once, whole, with
    bare torchrun (exit 1) and with tools/launch_single_node.sh (tools/torchrun.py: its
    one line names the rank that printed, exit 2)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")
    line = "pretrain_gpt.py: error: --loco-bits: 3 is not one of 0, 2, 4, 8"
    bare = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                           "pretrain_gpt.py", "--loco-bits", "3"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    launcher = subprocess.run(["bash", "tools/launch_single_node.sh", "configs/tiny_gpt.yaml", "--loco-bits", "3"],
                              cwd=REPO, env=dict(env, NPROC_PER_NODE="3"), capture_output=True, text=True,
                              timeout=120)
    for proc, code in ((bare, 1), (launcher, 2)):
        lines = (proc.stdout + proc.stderr).splitlines()
        assert proc.returncode == code and lines.count(line) == 1, (proc.returncode, proc.stderr[-3000:])
    root = bare.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {line}" in root and "rank      : 0 " not in root, root  # rank 0 never got there
    last = launcher.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"torchrun: rank [12] failed with exit code 2: {re.escape(line)}", last), last


def test_learning_rate_defaults_follow_the_optimizer_and_diloco(tmp_path):
    """Guards against the tuned defaults (docs/benchmarks.md, section 13) not reaching a run, or
    overriding what a user set: --lr's and Muon's factor's defaults are the sweep's best cells for
    the optimizer, data parallel or inside DiLoCo (DEFAULT_LRS); a --lr or factor given (flag or
    config file) wins; a --min-lr above the default --lr is one line naming the default."""
    import yaml

    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError
    from loco_megatron.config.optimizer import DEFAULT_LRS

    def lrs(*argv):
        c = parse_config(list(argv), note=lambda line: None)
        return c.optimizer.lr, c.optimizer.muon_extra_scale_factor, c.diloco.diloco_outer_lr

    muon, muloco = DEFAULT_LRS["muon", False], DEFAULT_LRS["muon", True]
    assert lrs()[0] == DEFAULT_LRS["adam", False][0] == 3e-3
    assert lrs("--optimizer", "muon")[:2] == muon and muon[0] * muon[1] == pytest.approx(1.6e-3)
    assert lrs("--diloco-replicas", "2") == (*DEFAULT_LRS["adam", True], 0.55) and DEFAULT_LRS["adam", True][0] == 1e-3
    assert lrs("--diloco-replicas", "2", "--optimizer", "muon", "--diloco-inner-steps", "16") == (*muloco, 0.4)
    assert lrs("--diloco-replicas", "2", "--lr", "2e-3", "--muon-extra-scale-factor", "0.3") == (2e-3, 0.3, 0.55)
    moe = REPO / "configs" / "tiny_moe.yaml"  # sets its own --lr: the config's, not the optimizer's default
    assert lrs("--config", str(moe), "--optimizer", "muon")[:2] == (yaml.safe_load(moe.read_text())["lr"], muon[1])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 0.0005\n")
    assert lrs("--config", str(cfg), "--optimizer", "muon")[0] == 5e-4
    with pytest.raises(ConfigError, match=r"^--min-lr: must be in \[0, --lr\] \(--lr's default here: 0\.001\)$"):
        parse_config(["--diloco-replicas", "2", "--min-lr", "2e-3"], note=lambda line: None)
