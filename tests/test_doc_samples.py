"""The console samples of README.md and docs/*.md are the program's own output.

Every block that shows what the program prints (start-up, iteration and summary lines, a
dry run, a tool's output) is a sample marked ``<!-- sample: NAME -->`` that
``python tools/doc_samples.py --write`` writes from real runs of the commands it shows.
These tests hold the pages to that without rerunning them: no console line outside a
marked sample, every marker a sample the script knows, and every start-up, iteration,
summary and dry-run line of a sample made of pieces that real runs print now (numbers,
paths and option lists masked), so a page cannot keep a line the program stopped
printing. ``python tools/doc_samples.py --check`` compares each sample with its own
command's output, line by line.
"""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

from conftest import REPO, TINY, torchrun

sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))  # pretrain_gpt.py, whose dry runs the comparison reads

import doc_samples  # noqa: E402
import doc_samples_spec  # noqa: E402

PENDING = {"docs/diloco.md"}
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
KINDS = re.compile(r"(iter |LoCo memory |param gather memory |model: |layout: |batch: |LoCo: |kernels: |"
                   r"starting fresh|resuming from |checkpoint: saved with layout |run summary: |  final loss: |"
                   r"  gradients sent: |  parameters all-gathered: |  last checkpoint: |  between replicas|DiLoCo: |"
                   r"dry run: |memory per GPU |TransformerEngine: |not checked by a dry run)")
"""The kinds of line the real-run comparison checks (start-up, iteration, summary, dry run)."""


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
    """The check itself must fail on a typed block, a `# ` commented output line in a bash
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


OPTIONS = re.compile(r"\b[a-z_]+(?:/[a-z_]+)+\b")
LAYOUT = re.compile(r"world\d+_tp\d+_pp\d+_ep\d+(?:_fsdp\[[^\]]*\])?")


def _masked(line: str) -> str:
    """``line`` with the parts that vary with the run and not with the program masked:
    paths (a token with a ``/`` and a ``_``, ``.``, ``~`` or ``-``, or a leading ``/``),
    saved-layout names, option lists (``symmetric/absmax/none/nearest``) and numbers."""
    tokens = []
    for token in line.split(" "):
        core = token.strip("(),;:'\"")
        if "/" in core and (re.search(r"[_.~-]", core) or core.startswith("/")):
            token = token.replace(core, "<path>")
        tokens.append(token)
    line = LAYOUT.sub("<layout>", " ".join(tokens))
    return doc_samples.mask(OPTIONS.sub("<options>", line))


def fields(line: str) -> list[str]:
    """The masked pieces of a console line, split at ``" | "``, ``"; "`` and ``", "``."""
    return [f for f in re.split(r" \| |; |, ", _masked(line)) if f]


def _kind(line: str):
    m = KINDS.match(line)
    return m.group(1).strip() if m else None


def shown_lines(block: doc_samples.Block) -> list[str]:
    """The output lines of a sample (without its commands and their ``$``/``#`` marks)."""
    commented = block.page.read_text().split("\n")[block.start].startswith(("```bash", "```python"))
    out = []
    for line in block.body:
        if commented:
            if line.startswith("# "):
                out.append(line[2:])
        elif not line.startswith("$ "):
            out.append(line)
    return out


@pytest.fixture(scope="module")
def real_lines(cache_dir, tmp_path_factory, cpu_kernels_built, monkeypatch_module) -> list[str]:
    """What the program prints now, from a few tiny real runs: a fresh 2-rank run with the
    4-bit parameter gather and a peak for MFU; a fresh 2-rank run saving asynchronously; a
    1-rank resume of it (resharding, a saved checkpoint, the torch fallback of the
    kernels, nothing to compress); and the dry runs the samples show, in this process."""
    tmp = tmp_path_factory.mktemp("doc_runs")
    base = TINY + ["--loco-bits", "4", "--train-iters", "4", "--log-interval", "2", "--eval-interval", "4",
                   "--eval-iters", "1"]
    lines = []
    for nproc, extra in ((2, ["--param-gather-bits", "4", "--peak-tflops", "1.0"]),
                         (2, ["--save", str(tmp / "ck"), "--save-interval", "2", "--async-save"]),
                         (1, ["--load", str(tmp / "ck"), "--save", str(tmp / "ck1"), "--train-iters", "6",
                              "--loco-error-bits", "16"])):
        proc, _ = torchrun(nproc, base + extra, cache_dir, tmp, name=f"run{len(lines)}")
        lines += proc.stdout.splitlines()
    import pretrain_gpt

    monkeypatch_module.chdir(REPO)
    tokenizer = next(pathlib.Path(cache_dir).rglob("*.model"))
    dry = [doc_samples_spec.RUNS[n].command.replace("\\\n", " ").split()[2:]
           for n in ("mixtral-32", "tiny-moe-dry", "llama-header", "fsdp-layout")]
    dry.append(["--data-path", str(tmp / "nowhere"), "--tokenizer-model", str(tokenizer), "--dry-run",
                "--world-size", "2"])
    for argv in dry:
        monkeypatch_module.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
        out = pretrain_gpt_main_output(pretrain_gpt)
        lines += out.splitlines()
    return lines


def pretrain_gpt_main_output(module) -> str:
    """stdout of ``module.main()`` (a dry run: it prints its report and returns 0)."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert module.main() == 0
    return buffer.getvalue()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _unprinted(sample_lines: list[str], reference: list[str]) -> list[str]:
    """Each sample line of a checked kind with a masked piece no reference line of its
    kind has, as ``line  <- piece``."""
    have: dict[str, set[str]] = {}
    for line in reference:
        kind = _kind(line)
        if kind:
            have.setdefault(kind, set()).update(fields(line))
    bad = []
    for line in sample_lines:
        kind = _kind(line)
        missing = [f for f in fields(line) if f not in have.get(kind, ())] if kind else []
        if missing:
            bad.append(f"{line}  <- {missing}")
    return bad


def test_samples_show_only_lines_the_program_prints(real_lines):
    """Guards against a sample that holds a start-up, iteration, summary or dry-run line
    the program does not print (training.md's `(VPP 1, EP 1, CP 1)` and `LoCo: 4-bit,
    block 256, ...`, data.md's copy of the same): every piece of every such line must be
    one that a tiny real run or dry run prints now; numbers, paths, saved-layout names and
    option lists may differ (the samples come from longer runs of other commands)."""
    bad = []
    for page in guide_pages():
        for block in doc_samples.blocks(page):
            bad += [f"{page.relative_to(REPO)} ({block.name}): {b}" for b in _unprinted(shown_lines(block), real_lines)]
    assert not bad, ("sample lines the program does not print (rerun `python tools/doc_samples.py --write`):\n"
                     + "\n".join(bad))


def test_sample_check_catches_stale_lines(real_lines):
    """The comparison itself must fail on the stale lines training.md held, on a field the
    iteration line lost and on a reworded summary line, and pass the current ones with
    other numbers (a masking that hid everything would pass every page)."""
    stale = ["layout: world 2 = TP 1 x PP 1 x DP 2 (VPP 1, EP 1, CP 1), sequence parallel off, recompute none",
             "LoCo: 4-bit, block 256, beta 0.8, error 8-bit, reset every 1024, warmup 0 steps; rank 0 hands 0.94 MiB of "
             "codes + scales to its gradient collectives per step instead of 7.25 MiB (x0.129)",
             "iter 20/200 | loss 5.1 | lr 1.00e-04 | grad norm 0.5 | samples/s 12 | step 0.2s",
             "run summary: 200 steps this run; 409,600 tokens"]
    assert len(_unprinted(stale, real_lines)) == 4, _unprinted(stale, real_lines)
    current = [line for line in real_lines if _kind(line)]
    renumbered = [re.sub(r"\d", "7", line) for line in current]
    assert current and _unprinted(renumbered, real_lines) == []
