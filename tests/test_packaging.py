"""The repository's top level is the `ringserve` package (pyproject.toml maps each folder).
A wheel only contains the packages listed there, so every folder with an __init__.py must be listed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TOP = ("server", "engine", "gpu", "ipc", "tools")


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {
        "ringserve." + ".".join(init.parent.relative_to(ROOT).parts)
        for top in TOP
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found == listed
    for name in listed:
        folder = name.removeprefix("ringserve.").replace(".", "/")
        assert setuptools["package-dir"].get(name, folder) == folder


def test_cli_entry_point_imports():
    from ringserve.tools.cli import main

    assert callable(main)


def test_frontend_worker_imports_no_gpu_or_engine_code():
    """docs/design.md §2: a Gunicorn worker must never import ringserve.gpu or the engine (nor CUDA
    libraries), so that it never initializes CUDA. Checked in a fresh interpreter."""
    code = ("import sys, ringserve.server.worker, ringserve.server.http_worker\n"
            "import ringserve.server.gunicorn_conf\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'numba')"
            " or m.startswith(('ringserve.gpu', 'ringserve.engine'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
