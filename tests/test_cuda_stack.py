"""The `cuda` extra as pip resolves it today on Python 3.12 (issue 25): what it installs compiles
Numba CUDA kernels to PTX (NVVM from the nvidia wheels, no GPU), and numpy 2.5 beside numba-cuda
— the pair that cannot compile — is named in one line by gpu/devices.py cuda_stack_problem and
by `ringserve serve --device cuda` before any engine starts.

`make test` builds the venv (the Makefile's venv312 target: `pip install ".[cuda]"` with
pyenv's Python 3.12 into ~/.cache/ringserve-venv312, keyed by pyproject.toml and the week; numpy >= 2.5 in
its numpy25/ to put ahead). Each check runs in that interpreter with this checkout first on
PYTHONPATH; the check's verdict and a real compile must agree both ways, so the day a
numba-cuda release guards np.row_stack this file says the bound can be lifted."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("VENV312", Path.home() / ".cache" / "ringserve-venv312"))  # as the Makefile
PYTHON = VENV / "bin" / "python"
NUMPY25 = VENV / "numpy25"
_year, _week, _ = datetime.datetime.now(datetime.timezone.utc).isocalendar()
STAMP = VENV / (f".installed-{hashlib.sha256((ROOT / 'pyproject.toml').read_bytes()).hexdigest()[:12]}"
                f"-{_year}{_week:02d}")  # the Makefile's PY312_KEY

# Run in the 3.12 venv: the versions, the start-up check's verdict, and whether ringserve's
# own Numba kernels (the largest: paged attention; and the greedy argmax) compile to PTX.
PROBE = r"""
import importlib.metadata as md, json, sys
import numpy as np
from numba import cuda, types
from ringserve.gpu.devices import cuda_stack_problem
out = dict(python=sys.version.split()[0], numpy=np.__version__, numba=md.version("numba"),
           numba_cuda=md.version("numba-cuda"), problem=cuda_stack_problem())
try:
    from ringserve.gpu.cuda import numba_kernels as nk
    f16_2d, f16_4d = types.Array(types.float16, 2, "C"), types.Array(types.float16, 4, "C")
    i32_1d, i32_2d = types.Array(types.int32, 1, "C"), types.Array(types.int32, 2, "C")
    # NOTE: as the runner launches it (tests/test_cuda_compile.py NUMBA_SIGNATURES: the last
    # flag says whether the 16-bit arrays hold bf16 bits)
    sigs = {"paged_attention_kernel": (f16_2d, f16_4d, f16_4d, i32_1d, i32_1d, i32_1d, i32_2d,
                                       types.float32, types.int32, f16_2d, types.boolean),
            "argmax_kernel": (types.Array(types.float32, 2, "C"), i32_1d)}
    out["ptx"] = {name: len(cuda.compile_ptx(getattr(nk, name).py_func, sig, cc=(9, 0))[0])
                  for name, sig in sigs.items()}
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def py312(tmp_path_factory) -> tuple[Path, Path]:
    """The 3.12 venv (built by the Makefile's own target where pyenv has a Python 3.12, if
    `make test` has not) and a folder holding a `ringserve` link to this checkout."""
    if not STAMP.exists():
        proc = subprocess.run(["make", "-C", str(ROOT), "venv312"], capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if not STAMP.exists():
            pytest.skip("no Python 3.12 here (pyenv's versions/3.12*): " + proc.stdout.strip())
    pkg = tmp_path_factory.mktemp("pkg")
    (pkg / "ringserve").symlink_to(ROOT)
    return PYTHON, pkg


def _env(pkg: Path, *ahead: Path, **extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, (*ahead, pkg))), **extra)


def _probe(py312: tuple[Path, Path], *ahead: Path) -> dict:
    python, pkg = py312
    proc = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=_env(pkg, *ahead),
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_what_the_cuda_extra_resolves_compiles_numba_cuda_kernels(py312):
    got = _probe(py312)
    assert got["python"].startswith("3.12.")
    assert got.get("error") is None and got["problem"] is None, got
    assert all(n > 1000 for n in got["ptx"].values()), got
    major, minor = (int(x) for x in got["numpy"].split(".")[:2])
    assert (major, minor) < (2, 5), f"the cuda extra's numpy bound did not hold: {got}"


def test_numpy_2_5_beside_numba_cuda_is_named_and_the_verdict_matches_a_real_compile(py312):
    """numpy >= 2.5 put ahead of the venv's: the check names the pair in one line exactly when
    a real compile fails (today it does: numba-cuda 0.30.4 registers np.row_stack)."""
    got = _probe(py312, NUMPY25)
    assert int(got["numpy"].split(".")[1]) >= 5 and got["numpy"].startswith("2."), got
    if got.get("error") is None:  # a numba-cuda that guards it: the bound can go
        assert got["problem"] is None, got
        pytest.fail(f"numba-cuda {got['numba_cuda']} compiles with numpy {got['numpy']}: lift the "
                    "cuda extra's numpy<2.5 (pyproject.toml) and this test's expectation")
    assert "row_stack" in got["error"], got
    problem = got["problem"]
    assert problem is not None and "\n" not in problem, got
    assert f"numpy {got['numpy']}" in problem and f"numba-cuda {got['numba_cuda']}" in problem
    assert "numpy<2.5" in problem


def test_serve_on_cuda_names_the_pair_before_any_engine_starts(py312, tiny_model_dir):
    """`ringserve serve --device cuda` with numpy 2.5 ahead: exit 1 and one line, no engine
    started, no traceback (CUDA_VISIBLE_DEVICES stands for the GPU: the check comes first)."""
    python, pkg = py312
    env = _env(pkg, NUMPY25, CUDA_VISIBLE_DEVICES="0")
    proc = subprocess.run([str(python), "-m", "ringserve.tools.cli", "serve", "--model", str(tiny_model_dir),
                           "--device", "cuda", "--port", "0"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: numpy 2."), proc.stderr
    assert "row_stack" in lines[0] and "engine" not in proc.stderr.lower()


def test_the_offline_runner_names_the_pair_too(py312, tiny_model_dir):
    """ModelRunner with DeviceConfig(device="cuda") (what LLM and the tools build) refuses in the
    same one line, before CuPy or Numba touch a device."""
    python, pkg = py312
    code = ("from ringserve.gpu.runner import ModelRunner\nfrom ringserve.gpu.settings import DeviceConfig\n"
            "try:\n"
            f"    ModelRunner({str(tiny_model_dir)!r}, DeviceConfig(device='cuda'))\n"
            "except ValueError as e:\n    print('refused:', e)\n")
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=_env(pkg, NUMPY25))
    assert proc.stdout.startswith("refused: numpy 2.") and "row_stack" in proc.stdout, proc.stderr


def test_the_check_costs_nothing_on_a_good_pair():
    """Here (the project's venv, numpy < 2.5): no problem, numba-cuda's array module not loaded."""
    from ringserve.gpu.devices import NUMBA_CUDA_ARRAYS, cuda_stack_problem
    proc = subprocess.run([sys.executable, "-c", "import sys; from ringserve.gpu.devices import "
                           "cuda_stack_problem as c; print(c(), %r in sys.modules)" % NUMBA_CUDA_ARRAYS],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["None", "False"], proc.stderr
    assert cuda_stack_problem() is None
