"""ruff over the whole tree with the project's rules (pyproject.toml [tool.ruff])."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


def test_ruff_is_clean():
    if not RUFF.exists():
        pytest.fail("ruff is missing: `make test` installs it (the test extra)")
    result = subprocess.run([str(RUFF), "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
