"""The import arrows of docs/design.md §2, as import-linter contracts (pyproject.toml
[tool.importlinter]): server → ipc ← engine → gpu, tools may use anything, each exception named.

import-linter finds `ringserve` on sys.path; the editable install maps it with an import hook
it cannot read, so the check runs with a `ringserve` link to the repository on PYTHONPATH."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(tmp_path: Path, config: Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.fail("lint-imports is missing: `make test` installs it (the test extra)")
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "ringserve").symlink_to(ROOT)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "path"))
    return subprocess.run([str(LINT_IMPORTS), "--no-logo", "--no-cache", str(config)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_are_kept(tmp_path):
    result = _lint(tmp_path, ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def test_a_broken_arrow_is_reported(tmp_path):
    """The same check without the offline API's named exception must fail: the contracts see
    the package's real imports (they cannot pass by analysing nothing)."""
    text = (ROOT / "pyproject.toml").read_text()
    exception = '    "ringserve.engine.llm -> ringserve.server.tokenizer",\n'
    assert exception in text
    config = tmp_path / "pyproject.toml"
    config.write_text(text.replace(exception, ""))
    result = _lint(tmp_path, config)
    assert result.returncode != 0
    assert "ringserve.engine.llm -> ringserve.server.tokenizer" in result.stdout, result.stdout
