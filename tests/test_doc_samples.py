"""The console samples of README.md and docs/*.md are the program's own output.

Every block that shows what the program prints (start-up, iteration and summary lines, a
dry run, a tool's output) is a sample marked ``<!-- sample: NAME -->`` that
``python tools/doc_samples.py --write`` writes from real runs of the commands it shows.
These tests hold the pages to that in seconds, without a training run: no console line
outside a marked sample, every marker a sample the script knows and every sample on a
page, the script's filtering, rendering and masking on made-up output, and the start-up
and dry-run samples against what the code's own line formats and an in-process dry run
print now (numbers masked), so a page cannot keep a line the program stopped printing.
``python tools/doc_samples.py --check`` compares every sample with its own command's
output from real runs, line by line (minutes; not a test).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

import doc_samples  # noqa: E402
import doc_samples_spec  # noqa: E402

PENDING: set[str] = set()
"""Pages whose console samples are being rewritten for DiLoCo's new lines; each joins the
checks once its samples carry markers (delete it from here then)."""

CONSOLE = re.compile(
    r"(iter \d|layout: |LoCo: |LoCo memory |param gather |model: |batch: |run summary: |(final loss|gradients sent|"
    r"parameters all-gathered|last checkpoint|between replicas): |DiLoCo: |kernels: |memory per GPU |dry run: |"
    r"exported |resuming from |starting fresh|checkpoint: |profile: |stop requested |TransformerEngine: |"
    r"not checked by a dry run|[\w.]+\.py: error: |error: |torchrun: )")
"""The start of a line the program or a tool prints (after a ``#`` comment marker and
indentation): a block holding one is a sample."""
INLINE = re.compile(r"(iter \d+[ /]|layout: world|LoCo: \d|LoCo memory on rank \d+: |model: \d|batch: micro|run summary: |"
                    r"DiLoCo: |kernels: grads|memory per GPU \(|dry run: the)")
"""The start of a start-up, iteration, summary or dry-run line quoted inline (in single
backticks): such a quote goes into a marked sample instead, where the script keeps it true."""


def guide_pages() -> list[pathlib.Path]:
    return [p for p in doc_samples.pages() if str(p.relative_to(REPO)) not in PENDING]


def _outside_fences(text: str) -> str:
    """``text`` with every fenced block's lines blanked (line numbers kept)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def unmarked_console_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each console line in a code block (fenced, or indented by
    four spaces after a blank line) that is not a marked sample, and of each start-up,
    iteration, summary or dry-run line quoted inline."""
    lines = text.split("\n")
    marked = {n for b in doc_samples.blocks(pathlib.Path("page"), text) for n in range(b.start, b.end + 1)}
    found, fenced, indented = [], False, False
    for n, line in enumerate(lines):
        if line.lstrip().startswith("```"):  # also a fence indented under a list item
            fenced = not fenced
            continue
        indented = line.startswith("    ") and (indented or n == 0 or not lines[n - 1].strip())
        if (fenced or indented) and n not in marked:
            shown = re.sub(r"^\s*(#\s*)?", "", line)
            if CONSOLE.match(shown):
                found.append((n + 1, line))
    prose = _outside_fences(text)
    for m in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(m.group(1).split())
        if INLINE.match(span):
            found.append((prose.count("\n", 0, m.start()) + 1, f"`{span}`"))
    return found


def test_every_console_line_is_in_a_marked_sample():
    """Guards against a sample nobody regenerates: a block or inline quote of start-up,
    iteration, summary, dry-run or tool output typed into a page (training.md kept a
    `layout: ... (VPP 1, EP 1, CP 1)` line long after the program stopped printing it;
    fsdp.md quoted a layout line inline). Such lines belong in a block marked
    `<!-- sample: NAME -->` that tools/doc_samples.py writes from a real run."""
    bad = [f"{p.relative_to(REPO)}:{n}: {line}" for p in guide_pages() for n, line in unmarked_console_lines(p.read_text())]
    assert not bad, "console lines outside a marked sample (add a sample to tools/doc_samples_spec.py):\n" + "\n".join(bad)


def test_console_line_check_catches_unmarked_samples():
    """Guards against a console-line check that passes every page: it must fail on a typed block, a `# ` commented output line in a bash
    block, an indented block and an inline quote, and pass the same lines in a marked
    sample (a prefix list that matched nothing would pass every page)."""
    page = ("Start-up:\n\n```\nlayout: world 2 = TP 1 x PP 1 x DP 2 (VPP 1, EP 1, CP 1)\n```\n\n"
            "```bash\npython pretrain_gpt.py --dry-run\n#   memory per GPU (estimate): weights 3.0 GiB\n```\n\n"
            "    run summary: 4 iterations this run\n\nIt prints `LoCo: 4-bit, block 256,\nbeta 0.8` once.\n\n"
            "<!-- sample: readme-summary -->\n```\nrun summary: 4 iterations this run\n  final loss: train 8.3\n```\n")
    found = unmarked_console_lines(page)
    assert [n for n, _ in found] == [4, 9, 12, 14], found
    assert "LoCo: 4-bit, block 256, beta 0.8" in found[-1][1]


def test_every_marker_names_a_sample_and_every_sample_is_shown_once():
    """Guards against a marker the script cannot write (a typo'd name: the block would
    never be regenerated), a sample defined but shown nowhere, or one shown twice (the
    second copy is written too, but a reader cannot tell the pages share a run)."""
    names = [b.name for p in doc_samples.pages() for b in doc_samples.blocks(p)]
    assert sorted(set(names) - set(doc_samples_spec.SAMPLES)) == []
    assert sorted(set(doc_samples_spec.SAMPLES) - set(names)) == []
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_run_is_shown_or_read():
    """Guards against a run the script would execute (minutes) that no sample shows and no
    shown run reads, and against a sample naming a run that does not exist."""
    used = {part.run for s in doc_samples_spec.SAMPLES.values() for part in s.parts}
    assert used <= set(doc_samples_spec.RUNS), sorted(used - set(doc_samples_spec.RUNS))
    needed, todo = set(), list(used)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo += doc_samples_spec.RUNS[name].after
    assert set(doc_samples_spec.RUNS) == needed, sorted(set(doc_samples_spec.RUNS) - needed)


def _block(page: str, name: str) -> doc_samples.Block:
    """The sample ``name`` of ``page`` (a path relative to the repository)."""
    return next(b for b in doc_samples.blocks(REPO / page) if b.name == name)


def test_program_lines_drop_progress_bars_and_warnings():
    """Guards against samples holding what a library writes around the program's lines:
    tqdm redraws (`0doc [00:00, ?doc/s]`, `Generating train split: ...`) with the blank
    lines their carriage returns leave, and megatron's `UserWarning: Transformer Engine and
    Apex are not installed` with its `  warnings.warn(` line (data.md held all of them),
    while the program's own lines, blank lines between them and indented summary lines
    stay."""
    raw = ["", "0doc [00:00, ?doc/s]", "1doc [00:30, 30.69s/doc]", "168doc [00:04, 33.89doc/s]",
           "Generating train split: 0 examples [00:00, ? examples/s]",
           "Generating train split: 168 examples [00:00, 814.93 examples/s]", "",
           "/site-packages/megatron/core/optimizer/optimizer.py:28: UserWarning: Transformer Engine and Apex are "
           "not installed. Falling back to local implementations", "  warnings.warn(",
           "168 documents, 1190712 tokens -> d.bin/.idx in 4.96 s (34 documents/s, 1 worker(s))", "",
           "iter 5/10 | loss 8.9830 | lr 7.22e-04", "run summary: 10 iterations this run", "  final loss: train 8.86"]
    assert doc_samples.program_lines(raw) == raw[9:]


def test_render_comments_output_and_keeps_printed_comments(monkeypatch, tmp_path):
    """Guards against a rendered block that misquotes its runs: a bash sample shows the
    command as code and each picked output line as a `# ` comment, a line the program
    prints as a comment (launch.py render's `# node 0`) is not doubled into `# # node 0`
    (data.md's render sample was), and a console sample shows `$ command`, its lines and
    a blank line before the next command."""
    monkeypatch.setitem(doc_samples_spec.RUNS, "made-up", doc_samples_spec.Run("tool --a \\\n    --b"))
    monkeypatch.setitem(doc_samples_spec.RUNS, "made-up-2", doc_samples_spec.Run("tool --c"))
    monkeypatch.setitem(doc_samples_spec.SAMPLES, "made-up-bash", doc_samples_spec.Sample(
        (doc_samples_spec.Part("made-up", (r"^# node", r"^kept")),), "bash"))
    monkeypatch.setitem(doc_samples_spec.SAMPLES, "made-up-console", doc_samples_spec.Sample(
        (doc_samples_spec.Part("made-up"), doc_samples_spec.Part("made-up-2")), "console"))
    runner = doc_samples.Runner(tmp_path)
    runner.done.update({"made-up": ["kept 1", "dropped 2", "# node 0", "0doc [00:00, ?doc/s]", "kept 3"],
                        "made-up-2": ["error: 4"]})
    assert doc_samples.render("made-up-bash", runner) == [
        "```bash", "tool --a \\", "    --b", "# kept 1", "# node 0", "# kept 3", "```"]
    assert doc_samples.render("made-up-console", runner) == [
        "```", "$ tool --a \\", "    --b", "kept 1", "dropped 2", "# node 0", "kept 3", "", "$ tool --c", "error: 4",
        "```"]


def test_check_masks_numbers_not_words():
    """Guards against a --check that either fails on every rerun (times and losses differ
    from run to run) or passes a reworded or reshaped line (a masking that hid words, or a
    dropped field), and against a marker without its fenced block passing silently."""
    page = "Text.\n\n<!-- sample: s -->\n```\niter 5/10 | loss 8.9830 | step 0.313s\nrun summary: 1,024 tokens\n```\n"
    (block,) = doc_samples.blocks(pathlib.Path("p.md"), page)
    assert (block.name, block.start, block.end) == ("s", 3, 6)
    assert doc_samples.differences(block, ["```", "iter 7/20 | loss 7.1 | step 12.5s", "run summary: 2,048 tokens",
                                           "```"]) == []
    block = dataclasses.replace(block, page=REPO / "p.md")  # the diff names the page relative to the repository
    reworded = doc_samples.differences(block, ["```", "iter 5/10 | loss 8.9830 | step 0.313s",
                                               "run summary: 1,024 samples", "```"])
    assert "+run summary: # samples" in reworded
    assert doc_samples.differences(block, ["```", "iter 5/10 | loss 8.9830", "run summary: 1,024 tokens", "```"])
    with pytest.raises(ValueError, match="not followed by a fenced block"):
        doc_samples.blocks(pathlib.Path("p.md"), "<!-- sample: s -->\ntext\n")


def test_startup_sample_is_what_the_line_formats_print():
    """Guards against training.md's start-up sample keeping lines the program no longer
    formats that way (it held `(VPP 1, EP 1, CP 1)` and `LoCo: 4-bit, block 256, ...`):
    the model, layout, batch, LoCo and kernels lines that loco_megatron/training/summary.py
    and kernel_choice.py format for the sample's own command (`--loco-bits 4` on 2 ranks)
    match the sample with numbers masked."""
    from loco_megatron.cli.parse import parse_config
    from loco_megatron.loco.kernel_choice import kernels_line
    from loco_megatron.training import summary

    config = parse_config(["--loco-bits", "4"])
    mask = doc_samples.mask
    shown = [mask(line) for line in _block("docs/training.md", "training-startup").body]
    assert shown[0] == mask(summary.model_line(config, 4096, ", 1 on rank 0"))
    assert shown[1] == mask(summary.layout_line(config, 2, 2, config.expert_data_parallel_size(2)))
    assert shown[2] == mask(summary.batch_line(config, 2))
    assert shown[3].startswith(mask(summary.loco_settings(config)) + "; rank # hands # MiB of codes + scales")
    assert shown[4] == mask(kernels_line("cpu", True, 0, None))
    assert len(shown) == 5


def test_dry_run_samples_are_a_dry_runs_output(monkeypatch):
    """Guards against the README's and parallelism.md's Mixtral dry-run samples drifting
    from what `pretrain_gpt.py --config configs/mixtral_8x7b.yaml --dry-run --world-size 32`
    prints: the dry run runs in this process (no ranks, seconds) and the script's own
    render and --check comparison must find no difference."""
    from loco_megatron.cli import main_invocation
    from loco_megatron.training.preflight import dry_run

    monkeypatch.chdir(REPO)
    command = doc_samples_spec.RUNS["mixtral-32"].command
    config, env, dry = main_invocation(command.split()[2:])
    printed = dry_run(config, dry.world_size, env.hf_hub_offline, dry.source).split("\n")
    runner = doc_samples.Runner(pathlib.Path("unused"))
    runner.done["mixtral-32"] = printed
    assert doc_samples.differences(_block("README.md", "readme-dry-run"), doc_samples.render("readme-dry-run", runner)) == []
    body = list(_block("docs/parallelism.md", "parallelism-dry-runs").body)
    first = body[1:body.index("")]  # the lines after the first `$ command`, up to the next command
    assert body[0] == f"$ {command}"
    assert [doc_samples.mask(line) for line in first] == [doc_samples.mask(line) for line in printed]
