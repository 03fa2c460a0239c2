"""Which backend to run on, and which GPUs a machine has (docs/design.md §5: the backend choice is
automatic, overridable with --device).

Two questions, asked in two kinds of process:
- an engine (or LLM) asks `resolve_device("auto")`: CuPy imports and sees a device -> "cuda".
- the launcher asks `visible_gpus()` to start one engine per GPU. It must not initialize CUDA
  itself (its children are spawned and Gunicorn is exec'd, but a CUDA context in the parent
  would hold GPU memory for nothing), so it reads CUDA_VISIBLE_DEVICES or `nvidia-smi -L`.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
from typing import Mapping

DEVICES = ("auto", "cpu", "cuda")


def cuda_available() -> bool:
    """CuPy imports and the driver reports at least one device (this initializes the driver)."""
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - no cupy, no driver, a broken install: the CPU backend
        return False


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when CUDA is usable here, else "cpu"; "cpu" and "cuda" stay."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not supported ({', '.join(DEVICES)})")
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return device


def visible_gpus(environ: Mapping[str, str] | None = None, nvidia_smi: str = "nvidia-smi") -> list[str]:
    """The ids of the GPUs this process may use, without initializing CUDA: the entries of
    CUDA_VISIBLE_DEVICES when it is set (CUDA stops at the first "-1"), else one index per
    `nvidia-smi -L` line; [] when neither says there is a GPU."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = []
        for entry in env["CUDA_VISIBLE_DEVICES"].split(","):
            entry = entry.strip()
            if not entry or entry == "-1" or entry.lower() == "nodevfiles":
                break
            ids.append(entry)
        return ids
    try:
        proc = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GPU ")]
    return [str(i) for i in range(len(lines))]


def cupy_installed() -> bool:
    """CuPy can be imported (found, not imported: importing it is the engine's business)."""
    return importlib.util.find_spec("cupy") is not None


def plan_engines(device: str | None, engines: int | None,
                 environ: Mapping[str, str] | None = None) -> tuple[str, list[str | None]]:
    """The launcher's choice, made without initializing CUDA: the device the engines run on
    and, per engine, the GPU id it gets as CUDA_VISIBLE_DEVICES (None on the CPU).

    device None/"auto": cuda when CuPy is installed and a GPU is visible, else cpu.
    engines None: one per visible GPU on cuda, 1 on cpu. More engines than GPUs share them
    round-robin."""
    requested = device or "auto"
    if requested not in DEVICES:
        raise ValueError(f"--device {requested!r} is not supported ({', '.join(DEVICES)})")
    gpus = visible_gpus(environ) if requested != "cpu" else []
    if requested == "auto":
        requested = "cuda" if gpus and cupy_installed() else "cpu"
    if requested == "cuda" and not gpus:
        raise ValueError("--device cuda: no GPU is visible (CUDA_VISIBLE_DEVICES / nvidia-smi -L)")
    count = engines if engines is not None else (len(gpus) if requested == "cuda" else 1)
    if count < 1:
        raise ValueError(f"--engines must be at least 1, got {count}")
    if requested == "cpu":
        return "cpu", [None] * count
    return "cuda", [gpus[i % len(gpus)] for i in range(count)]


# NOTE: numba-cuda (0.30.4, the newest release on 2026-12-04) runs `overload(np.row_stack)`
# when its array module loads, at the first kernel compile; numpy 2.5 removed np.row_stack, so
# that compile raises AttributeError inside an engine. The `cuda` extra bounds numpy below 2.5;
# this names the pair for an environment that has it anyway (a GPU image's own numpy).
NUMBA_CUDA_ARRAYS = "numba.cuda.np.arrayobj"


def cuda_stack_problem() -> str | None:
    """One line naming an installed numpy / numba-cuda pair that cannot compile a Numba CUDA
    kernel, else None. Costs nothing where numpy still has np.row_stack; otherwise it imports
    numba-cuda's array module (no CUDA context: only the registration that fails) and tells
    whether that registration fails."""
    import importlib.metadata as md

    import numpy as np
    if hasattr(np, "row_stack"):
        return None
    try:
        numba_cuda = md.version("numba-cuda")
    except md.PackageNotFoundError:
        return None  # numba's built-in CUDA target (numba < 0.61) guards it itself
    try:
        importlib.import_module(NUMBA_CUDA_ARRAYS)
    except AttributeError as e:
        missing = "np.row_stack" if "row_stack" in str(e) else f"what it needs ({e})"
        return (f"numpy {np.__version__} has no {missing}, which numba-cuda {numba_cuda} registers "
                f"({NUMBA_CUDA_ARRAYS}): no Numba CUDA kernel can compile; install numpy<2.5 "
                "(the `cuda` extra's bound) ahead of it")
    except ImportError:
        return None  # a numba-cuda without that module: nothing registers row_stack
    return None


def cpu_threads_per_engine(engines: int = 1) -> int:
    """The cores this process may run on, shared by `engines` CPU engines (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, engines))


def host_memory_available() -> int:
    """Bytes this process may still take: the kernel's MemAvailable, or less under a cgroup v2
    memory limit (a container's)."""
    available = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        current = int(open("/sys/fs/cgroup/memory.current").read())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, int(limit) - current)
