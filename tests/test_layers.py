"""The import arrows of docs/design.md §2, as import-linter contracts (pyproject.toml
[tool.importlinter]): one DAG, tools > server > engine > (gpu | ipc), a Gunicorn worker never
reaches engine, gpu, CuPy or Numba, and no contract ignores an import. Beside them: no two
files import each other, directly or around a circle (imports only for type checking aside).

import-linter and grimp find `ringserve` on sys.path; the editable install maps it with an
import hook they cannot read, so the checks run with a `ringserve` link to the repository."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PARTS = ("server", "engine", "gpu", "ipc", "tools")  # the subpackages (pyproject package-dir)


def _lint(tmp_path: Path, package: Path, config: Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.fail("lint-imports is missing: `make test` installs it (the test extra)")
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "ringserve").symlink_to(package)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "path"))
    return subprocess.run([str(LINT_IMPORTS), "--no-logo", "--no-cache", str(config)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_are_kept_without_exceptions(tmp_path):
    assert "ignore_imports" not in (ROOT / "pyproject.toml").read_text()
    result = _lint(tmp_path, ROOT, ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout, result.stdout


# (file, line appended, the edge import-linter must report)
BACK_EDGES = [
    ("engine/core.py", "from ringserve.server import tokenizer",
     "ringserve.engine.core -> ringserve.server.tokenizer"),
    ("gpu/batch.py", "from ringserve.ipc import limits", "ringserve.gpu.batch -> ringserve.ipc.limits"),
    ("server/sse.py", "import numba", "ringserve.server.sse -> numba"),
    ("gpu/cuda/quant_linear.py", "from ringserve.gpu.cpu import packed",
     "ringserve.gpu.cuda.quant_linear -> ringserve.gpu.cpu.packed"),
]


def test_a_back_edge_breaks_the_contracts(tmp_path):
    """A copy of the package with an engine -> server edge, a gpu -> ipc edge (independent
    siblings), a worker module importing Numba and a CUDA -> CPU backend edge: the contracts
    see the package's real imports (they cannot pass by analysing nothing) and name each edge."""
    package = tmp_path / "package"
    for part in PARTS:
        shutil.copytree(ROOT / part, package / part, ignore=shutil.ignore_patterns("__pycache__"))
    for file, line, _ in BACK_EDGES:
        with open(package / file, "a") as f:
            f.write(f"\n{line}  # noqa\n")
    result = _lint(tmp_path, package, ROOT / "pyproject.toml")
    assert result.returncode != 0
    assert "0 kept, 3 broken" in result.stdout, result.stdout
    for _, _, edge in BACK_EDGES:
        assert edge in result.stdout, result.stdout


def import_cycles(package: str) -> list[list[str]]:
    """The circles of module imports in `package` (found on sys.path): every import in a file,
    at module level or in a function, but those under `if TYPE_CHECKING:`; each circle as
    its strongly connected set of modules (Tarjan), sorted."""
    graph = grimp.build_graph(package, cache_dir=None, exclude_type_checking_imports=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def _cycles(tmp_path: Path, package: str, root: Path) -> list[list[str]]:
    """import_cycles in a fresh interpreter that finds `package` at `root` (this one may hold
    the editable install's `ringserve`, which grimp cannot read)."""
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / package).symlink_to(root)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "path"))
    out = subprocess.run([sys.executable, __file__, package], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout)


def test_no_file_imports_itself_around_a_circle(tmp_path):
    assert _cycles(tmp_path, "ringserve", ROOT) == []


def test_a_circle_of_imports_is_found(tmp_path):
    """A package with a circle of three files (one of its imports inside a function) and a
    pair that meets only under TYPE_CHECKING, which is allowed."""
    package = tmp_path / "package"
    package.mkdir()
    files = {
        "__init__.py": "",
        "a.py": "from circle import b\n",
        "b.py": "import circle.c\n",
        "c.py": "def f():\n    from circle.a import x\n",
        "d.py": "from circle import e\n",
        "e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circle import d\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    assert _cycles(tmp_path, "circle", package) == [["circle.a", "circle.b", "circle.c"]]


if __name__ == "__main__":  # _cycles' child: the circles of the package named, as JSON
    print(json.dumps(import_cycles(sys.argv[1])))
