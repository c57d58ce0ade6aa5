"""The LR schedule on a resume: new --lr / --train-iters / warmup / decay flags take effect
(or are refused in favour of the checkpoint's) as documented in loco_megatron.training.schedule,
with one line naming what differs."""

import types

import pytest

from conftest import read_metrics, run_launch, torchrun_command

FIRST = ["--lr", "0.00258", "--min-lr", "0.0001", "--train-iters", "4", "--lr-warmup-iters", "1"]


def _default_lr() -> float:
    """--lr's default for the runs below (AdamW, no DiLoCo; configs/tiny_gpt.yaml sets none)."""
    from loco_megatron.config.optimizer import default_lr

    return default_lr("adam", False)[0]


def _saved_schedule(argv):
    """The scheduler state a run of ``argv`` would checkpoint after its last step."""
    from loco_megatron.cli import parse_config
    from loco_megatron.optimizer import build_scheduler

    config = parse_config(argv)
    opt = types.SimpleNamespace(param_groups=[{"max_lr": config.optimizer.lr, "min_lr": config.optimizer.min_lr}])
    sched = build_scheduler(config, opt)
    sched.step(increment=config.train.train_iters)
    return sched.state_dict()


def _resume(argv, saved):
    """(optimizer stand-in, scheduler, note) after loading ``saved`` into a run of ``argv``.
    The param groups carry the checkpoint's max/min LR, as a torch-format load restores them."""
    from loco_megatron.cli import parse_config
    from loco_megatron.optimizer import build_scheduler
    from loco_megatron.training.schedule import ResumedSchedule

    config = parse_config(argv)
    opt = types.SimpleNamespace(param_groups=[{"max_lr": config.optimizer.lr, "min_lr": config.optimizer.min_lr}])
    view = ResumedSchedule(build_scheduler(config, opt), config)
    opt.param_groups[0].update(max_lr=saved["max_lr"], min_lr=saved["min_lr"])
    view.load_state_dict(saved)
    return opt, view.scheduler, view.note


def test_default_command_line_flags_win_and_are_named():
    """Guards against a resume silently ignoring a new --lr and an extended --train-iters
    (megatron's scheduler kept the checkpoint's 2.58e-03 and a 4-step decay): flags given on
    the command line win, each named in one line with both values."""
    saved = _saved_schedule(FIRST)
    opt, sched, note = _resume(["--lr", "0.0003", "--train-iters", "8", "--lr-warmup-iters", "1"], saved)
    assert sched.max_lr == pytest.approx(3e-4) and sched.lr_decay_steps == 8 and sched.num_steps == 4
    # cosine from 3e-4 to the checkpoint's min-lr 1e-4, 3 of 7 decay steps done
    import math
    want = 1e-4 + 0.5 * (1 + math.cos(math.pi * 3 / 7)) * (3e-4 - 1e-4)
    assert opt.param_groups[0]["lr"] == pytest.approx(want)
    assert "\n" not in note and note.startswith("LR schedule on resume: ")
    assert "--lr: this run's 0.0003 replaces the checkpoint's 0.00258 (given on the command line)" in note
    assert "LR decay iterations (--train-iters): this run's 8 replaces the checkpoint's 4" in note
    assert "--min-lr" not in note  # equal on both sides: not mentioned


def test_default_keeps_values_not_on_the_command_line():
    """Guards against a resume that does not repeat the first run's flags switching the
    schedule to this run's defaults without a word: such values keep the checkpoint's, named."""
    saved = _saved_schedule(FIRST + ["--min-lr", "0.00001", "--lr-decay-style", "linear"])
    opt, sched, note = _resume(["--train-iters", "4", "--lr-warmup-iters", "1"], saved)
    assert sched.max_lr == pytest.approx(2.58e-3) and sched.min_lr == pytest.approx(1e-5)
    assert sched.lr_decay_style == "linear" and opt.param_groups[0]["lr"] == pytest.approx(1e-5)
    assert f"--lr: the checkpoint's 0.00258 is kept, not this run's {_default_lr():g} (not on the command line" in note
    assert "--lr-decay-style: the checkpoint's linear is kept, not this run's cosine" in note


def test_override_flag_takes_every_value_from_this_run():
    """Guards against --override-opt-param-scheduler (Megatron-LM's flag) missing or leaving
    the optimizer's restored max_lr in charge: every value, also from defaults, is this run's."""
    saved = _saved_schedule(FIRST)
    opt, sched, note = _resume(["--override-opt-param-scheduler", "--train-iters", "8", "--lr-warmup-iters", "1"],
                               saved)
    assert sched.max_lr == pytest.approx(_default_lr()) and sched.lr_decay_steps == 8
    assert opt.param_groups[0]["max_lr"] == pytest.approx(_default_lr())
    assert f"--lr: this run's {_default_lr():g} replaces the checkpoint's 0.00258 (--override-opt-param-scheduler)" in note


def test_use_checkpoint_flag_keeps_every_value():
    """Guards against --use-checkpoint-opt-param-scheduler (Megatron-LM's flag) missing: the
    checkpoint's values are kept even over command-line flags, and the line says so."""
    saved = _saved_schedule(FIRST)
    opt, sched, note = _resume(["--use-checkpoint-opt-param-scheduler", "--lr", "0.0003", "--train-iters", "8",
                                "--lr-warmup-iters", "1"], saved)
    assert sched.max_lr == pytest.approx(2.58e-3) and sched.lr_decay_steps == 4
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)  # past the 4-step decay: min-lr
    assert "--lr: the checkpoint's 0.00258 is kept, not this run's 0.0003 (--use-checkpoint-opt-param-scheduler)" \
        in note


def test_both_flags_and_a_mix_that_is_no_schedule_are_one_line_errors():
    """Guards against contradictory schedule flags being accepted, and against a resume whose
    mixed values (new --lr below the checkpoint's --min-lr) decay upwards."""
    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError

    with pytest.raises(ConfigError, match="--override-opt-param-scheduler: give either it"):
        parse_config(["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"])
    saved = _saved_schedule(FIRST + ["--min-lr", "0.0005"])
    with pytest.raises(ConfigError, match="--min-lr: resuming with --lr 0.0002"):
        _resume(["--lr", "0.0002"], saved)  # --min-lr not given: the checkpoint's 0.0005 is kept


def _pretrain(args, cache, tmp_path, name):
    """A one-rank run of pretrain_gpt.py under torchrun on the suite's fork server
    (conftest.run_launch: no fresh import of torch and megatron-core per run)."""
    metrics = tmp_path / f"{name}.jsonl"
    cmd, env = torchrun_command(1, ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                                    "--eval-interval", "0", "--log-interval", "1", *args], cache, metrics)
    proc = run_launch(cmd, env, 600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lrs = {m["iteration"]: m["train/lr"] for m in read_metrics(metrics) if "train/lr" in m}
    return proc.stdout, lrs


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_with_new_lr_and_train_iters(fmt, cache_dir, tmp_path):
    """Guards against the end-to-end bug: resuming with --lr 0.0003 logged the old 2.58e-03 and
    an extended --train-iters kept the 4-step decay (torch format: the optimizer's restored
    param groups also carried the old max_lr); with --use-checkpoint-opt-param-scheduler the
    old schedule is kept."""
    ck = str(tmp_path / "ck")
    _pretrain(FIRST + ["--save", ck, "--ckpt-format", fmt], cache_dir, tmp_path, "first")
    resume = ["--lr", "0.0003", "--train-iters", "8", "--lr-warmup-iters", "1", "--load", ck]
    out, lrs = _pretrain(resume, cache_dir, tmp_path, "default")
    assert sorted(lrs) == [5, 6, 7, 8]
    assert 1e-4 < lrs[5] < 3e-4 and lrs[8] == pytest.approx(1e-4), lrs  # decays over 8 steps from 3e-4
    lines = [line for line in out.splitlines() if line.startswith("LR schedule on resume")]
    assert len(lines) == 1 and "--lr: this run's 0.0003 replaces the checkpoint's 0.00258" in lines[0], out[-2000:]
    if fmt == "torch":
        out, lrs = _pretrain(resume + ["--use-checkpoint-opt-param-scheduler"], cache_dir, tmp_path, "kept")
        assert "the checkpoint's 0.00258 is kept" in out
        assert lrs[5] == pytest.approx(1e-4)  # the 4-step decay was over
