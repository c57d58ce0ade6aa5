"""A fresh machine installs everything from the project's files (tools/check_install.py,
.ci/run)."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

import check_install  # noqa: E402  (tools/)


def test_this_environment_has_every_import_and_program():
    """Guards against a package that only a hand installation provided (torchft and its
    torchft_lighthouse, huggingface_hub): CI builds its environment from the requirements
    files alone, where such a package is missing and this names it."""
    assert check_install.missing(REPO) == []


def test_check_names_what_is_missing_and_skips_gpu_extras_and_own_modules(tmp_path):
    """Guards against a check that cannot fail: a module nobody installed is named (with the
    file importing it) and the exit code is 1; the project's own modules, the standard
    library and the GPU extras of requirements-gpu.txt (CUDA only) are not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "helper.py").write_text("import json\n")
    (tmp_path / "main.py").write_text("import helper\nfrom pkg import x\nimport transformer_engine.pytorch\n"
                                      "from no_such_package_here.sub import y\n")
    (tmp_path / "requirements-gpu.txt").write_text("transformer-engine[pytorch]==2.11.0\n")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "check_install.py"), "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    modules = re.findall(r"module '([^']+)' \(imported by ([^)]+)\)", proc.stderr)
    assert modules == [("no_such_package_here", "main.py")], proc.stderr


def test_ci_builds_a_new_environment_and_runs_the_readme_test_command():
    """Guards against CI passing on packages installed by hand: .ci/run must build a new
    virtual environment (never with the machine's site-packages) and run, inside it, the
    README's test command, which checks the installation before the tests."""
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    command = re.search(r"```bash\n(pip install -r requirements-test.txt && .*)\n```", readme).group(1)
    assert "tools/check_install.py" in command and "pytest" in command
    lines = [line for line in ci.splitlines() if not line.startswith("#")]
    venv = next(i for i, line in enumerate(lines) if "-m venv" in line)
    assert "--system-site-packages" not in ci
    assert any("activate" in line for line in lines[venv:]) and lines.index(command) > venv
