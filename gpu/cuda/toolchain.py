"""The CUDA C toolchain without a GPU: NVRTC (the compiler CuPy uses at run time) to PTX, and
ptxas's resource report (registers, spills, shared memory) for the compile checks (docs/design.md §8.3)
and tools/gpu_check.py.

NVRTC comes from cuda-bindings + nvidia-cuda-nvrtc-cu12 and ptxas from nvidia-cuda-nvcc-cu12
(both pulled in by numba-cuda[cu12]); a CUDA toolkit on PATH or in $CUDA_HOME works too.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).parent
# The one list of NVRTC options, used by the compile checks and by the CuPy launchers.
BASE_OPTIONS = ("--std=c++17",)


_LOCAL_INCLUDE = re.compile(r'^#include "(\w+\.cuh)"$', re.MULTILINE)


def source(name: str) -> str:
    """A .cu file's text with its local headers (#include "x.cuh": elem.cuh) pasted in: NVRTC
    gets code, not a folder, and the host build compiles the same text."""
    text = (SOURCE_DIR / name).read_text()
    return _LOCAL_INCLUDE.sub(lambda m: (SOURCE_DIR / m.group(1)).read_text(), text)


def options(defines: dict[str, int] | None = None) -> tuple[str, ...]:
    return BASE_OPTIONS + tuple(f"-D{k}={v}" for k, v in sorted((defines or {}).items()))


def _wheel_dir(package: str) -> Path | None:
    try:
        module = __import__(package, fromlist=["__file__"])
    except ImportError:
        return None
    paths = getattr(module, "__path__", None)
    return Path(list(paths)[0]) if paths else None


def cuda_include_dir() -> Path:
    """Where cuda_fp16.h is: the nvidia-cuda-runtime wheel, else $CUDA_HOME, else /usr/local/cuda."""
    candidates = []
    wheel = _wheel_dir("nvidia.cuda_runtime")
    if wheel:
        candidates.append(wheel / "include")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(Path(home) / "include")
    for c in candidates:
        if (c / "cuda_fp16.h").is_file():
            return c
    raise FileNotFoundError("cuda_fp16.h not found: install nvidia-cuda-runtime-cu12 or set CUDA_HOME")


def ptxas_path() -> Path:
    wheel = _wheel_dir("nvidia.cuda_nvcc")
    if wheel and (wheel / "bin" / "ptxas").is_file():
        return wheel / "bin" / "ptxas"
    found = shutil.which("ptxas") or (os.environ.get("CUDA_HOME") and shutil.which(
        "ptxas", path=str(Path(os.environ["CUDA_HOME"]) / "bin")))
    if not found:
        raise FileNotFoundError("ptxas not found: install nvidia-cuda-nvcc-cu12 or put a CUDA toolkit "
                                "on PATH")
    return Path(found)


def nvrtc_ptx(code: str, arch: str, opts: tuple[str, ...] = BASE_OPTIONS, name: str = "kernel.cu") -> str:
    """Compile CUDA C to PTX for arch ('sm_80', 'sm_90') with NVRTC; raises with its log."""
    from cuda.bindings import nvrtc

    def check(result):
        err, *rest = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
        return rest[0] if len(rest) == 1 else rest

    prog = check(nvrtc.nvrtcCreateProgram(code.encode(), name.encode(), 0, [], []))
    try:
        args = [f"--gpu-architecture=compute_{arch.split('_')[1]}", f"-I{cuda_include_dir()}", *opts]
        err, = nvrtc.nvrtcCompileProgram(prog, len(args), [a.encode() for a in args])
        # NOTE: NVRTC writes into the buffer it is given: a bytearray of our own, never a bytes
        # object (b" " * 1 is CPython's cached one-byte b" ": an empty log's NUL would then turn
        # every b" " of the process into b"\0", as it once did to the converter's header padding)
        size = check(nvrtc.nvrtcGetProgramLogSize(prog))
        log = bytearray(size)
        check(nvrtc.nvrtcGetProgramLog(prog, log))
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed for {name} ({arch}, {' '.join(opts)}):\n"
                               f"{log.decode(errors='replace')}")
        size = check(nvrtc.nvrtcGetPTXSize(prog))
        ptx = bytearray(size)
        check(nvrtc.nvrtcGetPTX(prog, ptx))
        return bytes(ptx).rstrip(b"\0 ").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def ptxas_report(ptx: str, arch: str) -> dict[str, KernelResources]:
    """ptxas -v on the PTX: each entry function's registers, shared memory, stack and spills."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([str(ptxas_path()), "-v", f"-arch={arch}", str(src), "-o",
                               str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed ({arch}):\n{proc.stderr}")
    report: dict[str, KernelResources] = {}
    name: str | None = None
    spill: tuple[int, ...] = (0, 0, 0)
    for line in proc.stderr.splitlines():
        if m := _FUNC.search(line):
            name = m.group(1)
        elif (m := _SPILL.search(line)) and name:
            spill = tuple(int(x) for x in m.groups())
        elif (m := _REGS.search(line)) and name:
            report[name] = KernelResources(name, int(m.group(1)), int(m.group(2) or 0),
                                           spill[0], spill[1], spill[2])
            name, spill = None, (0, 0, 0)
    return report
