"""Bad input: one line naming the flag or file, non-zero exit, nothing written."""

import os
import pathlib
import subprocess
import sys

import pytest

from conftest import REPO


def _run(args, tmp_path, env_extra=None, cache=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env.update(env_extra or {})
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *args,
           "--save", str(out / "ckpt"), "--metrics-jsonl", str(out / "m.jsonl")]
    if cache:
        cmd += ["--data-cache-path", cache]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
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
    (["--param-gather-bits", "2"], "--param-gather-bits"),
    (["--param-gather-bits", "4", "--no-use-distributed-optimizer"], "--param-gather-bits"),
    (["--loco-block-size", "100"], "--loco-block-size"),
    (["--num-attention-heads", "3"], "--hidden-size"),
    (["--tensor-model-parallel-size", "3"], "--num-attention-heads"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], "--num-experts"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], "--global-batch-size"),
    (["--lr-warmup-iters", "500"], "--lr-warmup-iters"),
    (["--data-path", "nowhere/x"], "--tokenizer-model"),
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
