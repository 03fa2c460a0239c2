"""ruff and mypy over the whole tree with the project's rules (pyproject.toml [tool.ruff],
[tool.mypy]; docs/design.md §8).

mypy finds `ringserve` on its search path; the editable install maps it with an import hook
mypy cannot read, so mypy runs from a folder holding a `ringserve` link to the repository (as
tests/test_layers.py does for import-linter)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The package (pyproject.toml [tool.setuptools]; tests/test_packaging.py keeps that list
# complete): mypy follows each -p into every module below it.
PACKAGES = ("server", "engine", "ipc", "gpu", "tools")


def _tool(name: str) -> Path:
    tool = BIN / name
    if not tool.exists():
        pytest.fail(f"{name} is missing: `make test` installs it (the test extra)")
    return tool


def test_ruff_is_clean():
    result = subprocess.run([str(_tool("ruff")), "check", "--no-cache", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean(tmp_path):
    (tmp_path / "ringserve").symlink_to(ROOT)
    args = [str(_tool("mypy")), "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(tmp_path / "cache")]
    for package in PACKAGES:
        args += ["-p", f"ringserve.{package}"]
    result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode == 0 and not errors, (
        f"mypy found {len(errors)} error(s):\n{result.stdout}{result.stderr}")
    # Every module was read (the check cannot pass by finding nothing to check).
    modules = sum(len(list((ROOT / p).rglob("*.py"))) for p in PACKAGES)
    checked = re.search(r"no issues found in (\d+) source files", result.stdout)
    assert checked and int(checked.group(1)) == modules, (
        f"mypy checked {checked.group(1) if checked else 'no'} source files; the package has "
        f"{modules}:\n{result.stdout}")
