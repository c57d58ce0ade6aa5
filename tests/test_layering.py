"""The package's import arrows follow the data flow (CLI > config > set-up > train step >
sync > checkpoint and metrics): the bottom layers never import the ones that use them."""

import ast
import pathlib

from conftest import REPO

PACKAGE = REPO / "loco_megatron"
BOTTOM = ("checkpoint", "metrics")
"""Sub-packages at the end of the data flow: what they need from elsewhere lives below them."""
ABOVE = ("loco_megatron.training", "loco_megatron.cli")
"""What the bottom layers must not import: the training loop and the command line."""


def imported_modules(path: pathlib.Path, repo: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, dotted module)`` of every import in ``path`` (a module of the package in
    ``repo``), also those inside functions, relative ones resolved against the module's
    package (``from . import x`` gives ``package.x`` too, as it may name a submodule)."""
    package = ".".join(path.relative_to(repo).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def upward_imports(root: pathlib.Path, above: tuple[str, ...], repo: pathlib.Path = REPO) -> list[str]:
    """``file:line imports module`` for each import under ``root`` of a module in (or under) ``above``."""
    return [f"{path.relative_to(repo)}:{line} imports {name}" for path in sorted(root.rglob("*.py"))
            for line, name in imported_modules(path, repo) if any(name == a or name.startswith(a + ".") for a in above)]


def test_checkpoint_and_metrics_do_not_import_training():
    """Guards against an arrow running back up the data flow: checkpoint/ importing
    loco_megatron.training (the rank's helper-process signals, the optimizer's parts), so
    that saving a checkpoint pulls in the trainer and a change there can break loading.
    Every import is read, also one inside a function."""
    for sub in BOTTOM:
        assert upward_imports(PACKAGE / sub, ABOVE) == [], sub


def test_the_layering_check_finds_imports_inside_functions_and_relative_ones(tmp_path):
    """Guards against the check above passing vacuously: a module importing the trainer at
    its top, inside a function or relatively (``from ..training import state``) is found."""
    pkg = tmp_path / "loco_megatron" / "checkpoint"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("import os\nfrom loco_megatron.training.state import sub_optimizers\n")
    (pkg / "b.py").write_text("def f():\n    import loco_megatron.training.children\n")
    (pkg / "c.py").write_text("from ..training import state\nfrom . import files\n")
    assert upward_imports(pkg, ABOVE, tmp_path) == [
        "loco_megatron/checkpoint/a.py:2 imports loco_megatron.training.state",
        "loco_megatron/checkpoint/a.py:2 imports loco_megatron.training.state.sub_optimizers",
        "loco_megatron/checkpoint/b.py:2 imports loco_megatron.training.children",
        "loco_megatron/checkpoint/c.py:1 imports loco_megatron.training",
        "loco_megatron/checkpoint/c.py:1 imports loco_megatron.training.state"]
