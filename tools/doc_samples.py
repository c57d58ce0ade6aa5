#!/usr/bin/env python3
"""Write (``--write``) or check (``--check``) the console samples of README.md and docs/*.md
from real runs of the commands they show.

    python tools/doc_samples.py --write                      # every sample (tens of minutes)
    python tools/doc_samples.py --check                      # the same runs; numbers may differ
    python tools/doc_samples.py --write --only loco-2bit,kernels-lines
    python tools/doc_samples.py --list                       # each sample: its page and runs

A sample is the fenced block right after a line ``<!-- sample: NAME -->`` in a page.
``tools/doc_samples_spec.py`` says what NAME shows: the commands of one or more runs and
the lines each printed (all, or those its patterns pick). The runs execute, as the page
shows them, in one scratch folder (``--workdir``, default a new temporary one) that links
``pretrain_gpt.py``, ``tools/``, ``configs/`` and ``benchmarks/`` of this checkout, so what
they write (``ckpt/``, ``runs/``, ``data/``) stays there; a run whose files another reads
runs first. What libraries write around the program's lines (progress bars, Python
warnings) is left out (:func:`program_lines`). ``--write`` replaces each block with the
rendered one; ``--check`` compares them with every number masked (:func:`mask`): wording
or format that changed is reported with a diff, figures that differ from run to run
(times, losses) are not. ``--check`` exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import doc_samples_spec as spec  # noqa: E402

MARKER = re.compile(r"^<!-- sample: ([\w.-]+) -->$")
LINKED = ("pretrain_gpt.py", "tools", "configs", "benchmarks")
"""What the scratch folder links from this checkout (the paths the commands name)."""
NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")
PROGRESS = re.compile(r"\[\d+:\d+(?:<[^,\]]*)?,\s*[^\]]*(?:/s|s/\w+)\]$")
"""The end of a tqdm progress-bar line (``168doc [00:04, 33.89doc/s]``,
``Generating train split: 0 examples [00:00, ? examples/s]``): a terminal redraws it in
place, a pipe gets every redraw as a line; it is the libraries' output, not the program's."""
WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: ")
"""A Python warning's first line (``.../optimizer.py:28: UserWarning: ...``); the next line,
indented, is the source line that raised it (``  warnings.warn(``)."""


def pages() -> list[pathlib.Path]:
    """The pages that may hold samples."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def mask(line: str) -> str:
    """``line`` with every number (digits with their ``.``, ``,`` or ``:`` separators) as
    ``#`` and trailing blanks dropped: what two runs of one command print alike."""
    return NUMBER.sub("#", line).rstrip()


@dataclasses.dataclass(frozen=True)
class Block:
    """One marked sample of a page: ``lines[start]`` is its opening fence, ``lines[end]``
    its closing one."""

    page: pathlib.Path
    name: str
    start: int
    end: int
    body: tuple[str, ...]


def blocks(page: pathlib.Path, text: Optional[str] = None) -> list[Block]:
    """The marked samples of ``page`` (``text``: its contents, if already read). A marker
    not followed by a fenced block raises ValueError naming the line."""
    lines = (page.read_text() if text is None else text).split("\n")
    out = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise ValueError(f"{page}:{i + 1}: the sample marker is not followed by a fenced block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{i + 2}: the sample's fenced block is not closed")
        out.append(Block(page, m.group(1), i + 1, end, tuple(lines[i + 2:end])))
    return out


class Runner:
    """Runs :data:`spec.RUNS` in one scratch folder, each once, those it reads first."""

    def __init__(self, workdir: pathlib.Path, say=print):
        self.workdir, self.say, self.done = workdir, say, {}

    def folder(self, run: spec.Run) -> pathlib.Path:
        """The run's folder (made on first use), with :data:`LINKED` in it."""
        folder = self.workdir / run.folder
        folder.mkdir(exist_ok=True)
        for name in LINKED:
            link = folder / name
            if not link.exists():
                link.symlink_to(REPO / name)
        return folder

    def output(self, name: str, log: str = "") -> list[str]:
        """The lines run ``name`` printed (stdout and stderr as a terminal shows them), or
        with ``log`` those of that file in the scratch folder after it ran."""
        if name not in self.done:
            run = spec.RUNS[name]
            try:
                for other in run.after:
                    self.output(other)
                self.done[name] = self._execute(name, run)
            except (RuntimeError, OSError) as e:
                self.done[name] = e  # reported once per sample that reads it, run once
        if isinstance(self.done[name], Exception):
            raise self.done[name]
        if log:
            return (self.folder(spec.RUNS[name]) / log).read_text(errors="replace").splitlines()
        return self.done[name]

    def _execute(self, name: str, run: spec.Run) -> list[str]:
        self.say(f"doc_samples: running {name}: {run.command.splitlines()[0][:100]}")
        # The programs of this interpreter's environment (torchrun, torchft_lighthouse) first,
        # whether or not it is activated.
        path = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        env = dict(os.environ, PYTHONPATH=str(REPO), PATH=path, **dict(run.env))
        for key in run.unset:
            env.pop(key, None)
        script = "\n".join(part for part in (run.setup, run.command) if part)
        began = time.monotonic()
        proc = subprocess.Popen(["bash", "-c", script], cwd=self.folder(run), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        lines, sent = [], False
        watchdog = threading.Timer(run.timeout, _kill_all, (proc.pid,))  # a hung run ends
        watchdog.start()
        try:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if run.signal is not None and not sent and re.search(run.signal.when, line):
                    sent = _send(proc.pid, run.signal)
            proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                _kill_all(proc.pid)
                proc.wait()
        if run.signal is not None and not sent:
            raise RuntimeError(f"run {name} never printed a line matching {run.signal.when!r}:\n"
                               + "\n".join(lines[-30:]))
        if proc.returncode != run.exit_code:
            raise RuntimeError(f"run {name} exited {proc.returncode}, not {run.exit_code}:\n" + "\n".join(lines[-30:]))
        self.say(f"doc_samples: {name} done in {time.monotonic() - began:.0f} s")
        return lines


def _send(session: int, sig: spec.Signal) -> bool:
    """Deliver ``sig`` in the run's session (its own process group); True once sent."""
    if sig.rank is None:
        os.killpg(session, sig.signum)
        return True
    for pid in _session_pids(session):  # ascending: the worker before what it forked
        try:
            environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={sig.rank}".encode() in environ:
            os.kill(pid, sig.signum)
            return True
    return False


def _kill_all(session: int) -> None:
    """SIGKILL every process of the run (:func:`_session_pids`)."""
    for pid in _session_pids(session):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _session_pids(session: int) -> list[int]:
    """Live processes of session ``session`` and of the sessions its torchrun workers open
    (each worker starts one of its own, so also the processes whose parent is in it)."""
    stats = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X"):
            stats[int(stat.parent.name)] = (int(fields[1]), int(fields[3]))
    found = {pid for pid, (_, sid) in stats.items() if sid == session}
    grew = True
    while grew:
        more = {pid for pid, (ppid, _) in stats.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return sorted(found)


def program_lines(lines: list[str]) -> list[str]:
    """``lines`` without what a library writes around the program's own lines: progress
    bars (:data:`PROGRESS`), Python warnings (:data:`WARNING`, each with the indented source
    line below it) and the blank lines next to either (a bar's carriage returns reach a
    pipe as empty lines)."""
    noise = [False] * len(lines)
    for i, line in enumerate(lines):
        if PROGRESS.search(line.strip()) or WARNING.match(line):
            noise[i] = True
        elif i and line.startswith("  ") and WARNING.match(lines[i - 1]):
            noise[i] = True

    def near_noise(i: int, step: int) -> bool:
        while 0 <= i < len(lines) and not lines[i].strip():
            i += step
        return 0 <= i < len(lines) and noise[i]

    return [line for i, line in enumerate(lines)
            if not noise[i] and (line.strip() or not (near_noise(i, -1) or near_noise(i, 1)))]


def render(name: str, runner: Runner) -> list[str]:
    """The fenced block of sample ``name``, from its runs' commands and output."""
    sample = spec.SAMPLES[name]
    out = [spec.FENCES[sample.style]]
    for i, part in enumerate(sample.parts):
        run = spec.RUNS[part.run]
        if i and sample.style == "console":
            out.append("")  # one command and its lines, a blank line, the next
        if part.command:
            shown = run.command.split("\n")
            out += [f"$ {shown[0]}", *shown[1:]] if sample.style == "console" else shown
        lines = program_lines(runner.output(part.run, part.log))
        if part.picks is not None:
            lines = [line for line in lines if any(re.search(p, line) for p in part.picks)]
        comment = "# " if sample.style in ("bash", "python") else ""
        # a line that is already a comment (launch.py render's "# node 0") stays as printed
        out += [(line if line.startswith("#") else f"{comment}{line}").rstrip() for line in lines]
    return out + ["```"]


def differences(block: Block, rendered: list[str]) -> list[str]:
    """A diff of ``block`` against ``rendered`` with numbers masked; [] when they agree."""
    have = [mask(line) for line in block.body]
    want = [mask(line) for line in rendered[1:-1]]
    if have == want:
        return []
    return list(difflib.unified_diff(have, want, f"{block.page.relative_to(REPO)} ({block.name})",
                                     "the program's output", lineterm=""))


def marked() -> dict[str, list[Block]]:
    """Every marked block of every page, by sample name."""
    out: dict[str, list[Block]] = {}
    for page in pages():
        for block in blocks(page):
            out.setdefault(block.name, []).append(block)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help="rewrite every selected sample from its runs")
    what.add_argument("--check", action="store_true", help="compare every selected sample with its runs' output")
    what.add_argument("--list", action="store_true", help="list the samples, their pages and runs")
    ap.add_argument("--only", default="", help="comma-separated sample names (default: all)")
    ap.add_argument("--workdir", default="", help="scratch folder for the runs (default: a new temporary one, "
                                                  "removed at the end)")
    args = ap.parse_args(argv)
    found = marked()
    unknown = sorted(set(found) - set(spec.SAMPLES))
    unused = sorted(set(spec.SAMPLES) - set(found))
    if unknown or unused:
        print(f"doc_samples.py: error: markers naming no sample: {unknown or 'none'}; samples no page shows: "
              f"{unused or 'none'}", file=sys.stderr)
        return 2
    names = [n for n in args.only.split(",") if n] or list(spec.SAMPLES)
    missing = [n for n in names if n not in spec.SAMPLES]
    if missing:
        print(f"doc_samples.py: error: --only: no sample named {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.list:
        for n in names:
            runs = ", ".join(dict.fromkeys(p.run for p in spec.SAMPLES[n].parts))
            print(f"{n}: {', '.join(str(b.page.relative_to(REPO)) for b in found[n])} <- {runs}")
        return 0
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="doc_samples_"))
    workdir.mkdir(parents=True, exist_ok=True)
    runner, failed, rendered = Runner(workdir), False, {}
    try:
        for n in names:
            try:
                rendered[n] = render(n, runner)
            except (RuntimeError, OSError) as e:  # one failed run: the other samples are still written
                print(f"doc_samples.py: sample {n} not rendered: {e}", file=sys.stderr)
                failed = True
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    for page in pages():
        text = page.read_text()
        lines = text.split("\n")
        for block in reversed([b for b in blocks(page, text) if b.name in rendered]):
            if args.write:
                lines[block.start:block.end + 1] = rendered[block.name]
            else:
                diff = differences(block, rendered[block.name])
                failed |= bool(diff)
                print("\n".join(diff) if diff else f"{page.relative_to(REPO)}: {block.name}: matches")
        if args.write and "\n".join(lines) != text:
            page.write_text("\n".join(lines))
            print(f"wrote {page.relative_to(REPO)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
