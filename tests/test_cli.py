"""pretrain_gpt.py's command line: choices in --help, typo suggestions, the renamed
error-feedback flag, and the generated configuration reference."""

import importlib.util

import pytest

from conftest import REPO


def test_help_shows_the_choices_of_enumerated_flags():
    """Guards against --help showing `--loco-bits INT` (the user has to guess 3 is invalid)
    and against the help's choices drifting from what the config validates."""
    from loco_megatron.cli import build_parser
    from loco_megatron.config import ConfigError, LoCoConfig

    text = " ".join(build_parser().format_help().split())
    for shown in ("--loco-bits {0,2,4,8}", "--loco-error-bits {8,16,32}", "--ckpt-format {torch_dist,torch,fsdp_dtensor}",
                  "--lr-decay-style {constant,linear,cosine}", "--recompute-granularity {selective,full}"):
        assert shown in text, shown
    # The same list validates: each shown value is accepted, another is refused in one line.
    for bits in (0, 2, 4, 8):
        assert LoCoConfig(loco_bits=bits).loco_bits == bits
    with pytest.raises(ConfigError, match=r"^--loco-bits: 3 is not one of 0, 2, 4, 8$"):
        LoCoConfig(loco_bits=3)
    with pytest.raises(ConfigError, match=r"^--loco-bits: True is not one of"):  # bool is not the int 1
        LoCoConfig(loco_bits=True)


def test_unknown_flag_and_key_name_the_closest_one(tmp_path):
    """Guards against a typo'd flag printing argparse's usage (or "unrecognized arguments"
    with no hint), a flag abbreviation silently meaning another flag, and a typo'd YAML key
    without a suggestion."""
    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError

    with pytest.raises(ConfigError, match=r"^unknown flag --loco-bit \(did you mean --loco-bits\?\)$"):
        parse_config(["--loco-bit", "4"])
    with pytest.raises(ConfigError, match=r"^unknown flag --loco-bitz \(did you mean --loco-bits\?\)$"):
        parse_config(["--loco-bitz=4"])
    with pytest.raises(ConfigError, match=r"^unknown flag --qqqqqqqq$"):  # nothing close: no suggestion
        parse_config(["--qqqqqqqq"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("loco_bitz: 4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'loco_bitz' in .*c\.yaml \(did you mean loco-bits\?\)$"):
        parse_config(["--config", str(cfg)])


def test_deprecated_error_feedback_spellings_still_work(tmp_path, capsys):
    """Guards against the rename of --loco-no-error-feedback (whose negation was the double
    negative --no-loco-no-error-feedback) breaking existing scripts, config files and saved
    run configs, or printing its note more than once."""
    from loco_megatron.cli import make_config, parse_config

    assert parse_config([]).loco.loco_error_feedback is True
    assert parse_config(["--no-loco-error-feedback"]).loco.loco_error_feedback is False
    assert capsys.readouterr().err == ""
    assert parse_config(["--loco-no-error-feedback"]).loco.loco_error_feedback is False
    assert capsys.readouterr().err.splitlines() == [
        "pretrain_gpt.py: note: --loco-no-error-feedback is deprecated; use --no-loco-error-feedback"]
    assert parse_config(["--no-loco-no-error-feedback"]).loco.loco_error_feedback is True
    assert "use --loco-error-feedback" in capsys.readouterr().err
    cfg = tmp_path / "old.yaml"
    cfg.write_text("loco-bits: 4\nloco-no-error-feedback: true\n")
    config = parse_config(["--config", str(cfg)])
    assert (config.loco.loco_bits, config.loco.loco_error_feedback) == (4, False)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "key loco-no-error-feedback is deprecated; use loco-error-feedback: false" in err[0]
    # The command line's new spelling wins over the file's old key.
    assert parse_config(["--config", str(cfg), "--loco-error-feedback"]).loco.loco_error_feedback is True
    # A run config saved before the rename (checkpoints, metrics files) rebuilds silently.
    capsys.readouterr()
    assert make_config({"loco_bits": 4, "loco_no_error_feedback": True}).loco.loco_error_feedback is False
    assert capsys.readouterr().err == ""


def test_configuration_reference_is_generated_from_the_dataclasses():
    """Guards against docs/configuration.md going stale when a config field, its default,
    choices or docstring changes."""
    spec = importlib.util.spec_from_file_location("gen_config_docs", REPO / "tools" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.render()
    assert "| `--loco-bits` | int | `0` | `0`, `2`, `4`, `8` | Bits per transmitted gradient code" in text
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == text, "docs/configuration.md is stale: regenerate with python tools/gen_config_docs.py"
