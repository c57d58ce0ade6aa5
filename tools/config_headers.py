#!/usr/bin/env python3
"""Write each config's dry-run lines into its header comment, so the header says what
``pretrain_gpt.py --dry-run`` prints for it.

    python tools/config_headers.py           # rewrite the headers of configs/*.yaml
    python tools/config_headers.py --check   # exit 1 naming each config whose header is stale

A header names its dry runs as command lines, ``# $ python pretrain_gpt.py --config
configs/X.yaml --dry-run --world-size N [FLAGS]``; the indented ``#   `` lines under each are
that dry run's output: the model, layout, LoCo and memory lines for the first command (the
config as shipped, at its Slurm template's GPU count), the layout, optimizer and memory lines
for the others (alternatives, e.g. another TP, or --optimizer muon). tests/test_layout.py fails when a header differs.
"""

import argparse
import pathlib
import shlex
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loco_megatron.cli import parse_config  # noqa: E402
from loco_megatron.training.preflight import dry_run  # noqa: E402

COMMAND = "# $ python pretrain_gpt.py "
OUTPUT = "#   "
SHOWN = (("model:", "layout:", "LoCo:", "memory per GPU"), ("layout:", "optimizer:", "memory per GPU"))
"""The dry-run lines a header shows: for its first command, and for the alternatives."""


def dry_run_lines(command: str, first: bool) -> list[str]:
    """The lines of ``pretrain_gpt.py ARGS`` (a header's command, after ``pretrain_gpt.py``) that
    a header shows. Offline, in this process, as the CLI would print them."""
    args = shlex.split(command)
    if "--dry-run" not in args or "--world-size" not in args:
        raise ValueError(f"not a dry run at a given world size: {command}")
    at = args.index("--world-size")
    world = int(args[at + 1])
    flags = [a for i, a in enumerate(args) if a != "--dry-run" and i not in (at, at + 1)]
    report = dry_run(parse_config(flags, note=lambda line: None), world, offline=True)
    shown = SHOWN[0] if first else SHOWN[1]
    return [line for line in report.splitlines() if line.startswith(shown)]


def regenerated(text: str) -> str:
    """``text`` (a config file) with the output lines under each dry-run command rewritten."""
    out, first = [], True
    for line in text.splitlines():
        if line.startswith(OUTPUT):  # the old output: replaced under its command
            continue
        out.append(line)
        if line.startswith(COMMAND):
            out += [OUTPUT + shown for shown in dry_run_lines(line[len(COMMAND):], first)]
            first = False
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when a header is stale; write nothing")
    args = ap.parse_args()
    stale = []
    for path in sorted((REPO / "configs").glob("*.yaml")):
        text = path.read_text()
        new = regenerated(text)
        if new != text:
            stale.append(path.relative_to(REPO))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        sys.exit(f"stale dry-run lines in {', '.join(map(str, stale))}: run python tools/config_headers.py")
    print(f"{'stale' if args.check else 'rewrote'}: {', '.join(map(str, stale)) or 'none'}")


if __name__ == "__main__":
    main()
