"""gpu/cuda/*.cu compiled for the host with g++ against the CUDA-on-host shim (tests/cuda_host/)
and called through ctypes: shared by tests/test_cuda_host.py (each kernel vs its reference)
and tests/test_cuda_forward_host.py (the whole CUDA forward vs the CPU backend)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ringserve.gpu.cuda import launch, toolchain

HOST_DIR = Path(__file__).parent / "cuda_host"
# source -> the shim's entry points for it
ENTRIES = {"fused.cu": "fused_host.cpp", "attention.cu": "attention_host.cpp", "quant.cu": "quant_host.cpp",
           "shim": "shim_selftest.cpp"}  # "shim": the shim's own tests, no .cu


def gxx_defines(defines: dict[str, int] | None) -> list[str]:
    """toolchain.options() as g++ flags: the -D defines as they are, NVRTC's --std dropped (the
    shim needs C++20, a superset); any other NVRTC option has to be taught to this module."""
    flags = []
    for opt in toolchain.options(defines):
        if opt.startswith("-D"):
            flags.append(opt)
        elif not opt.startswith("--std="):
            raise AssertionError(f"NVRTC option {opt!r} has no host equivalent in {__file__}")
    return flags


class HostKernels:
    """A host-compiled .cu: call(kernel, (grid, block), *args) runs one emulated launch."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.cuda_host_error.restype = ctypes.c_char_p

    def call(self, kernel: str, geometry: tuple[tuple[int, ...], tuple[int, ...]], *args) -> None:
        grid, block = geometry
        dims = (ctypes.c_uint * 6)(*(tuple(grid) + (1,) * (3 - len(grid))),
                                   *(tuple(block) + (1,) * (3 - len(block))))
        if getattr(self.lib, f"launch_{kernel}")(dims, *map(_c_arg, args)) != 0:
            raise RuntimeError(f"{kernel}: {self.lib.cuda_host_error().decode()}")


def _c_arg(a):
    if a is None:
        return ctypes.c_void_p(None)
    if isinstance(a, np.ndarray):
        # dense row-major buffers, or rows of one (a column slice: the kernels that take one
        # take its row pitch, as quant.cu's out)
        assert a.flags.c_contiguous or (a.ndim == 2 and a.strides[1] == a.itemsize), \
            "kernels take dense row-major buffers"
        return ctypes.c_void_p(a.ctypes.data)
    if isinstance(a, np.int32):
        return ctypes.c_int(int(a))
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a))
    raise TypeError(f"pass np.int32 / np.float32 / arrays, like the CuPy launchers: {a!r}")


def paged_attention_args(qkv, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
                         scale: float, out, workspace: tuple = (None, None, None), window: int = 0) -> tuple:
    """paged_attention's arguments in the order PagedAttention.__call__ passes them."""
    _, block_size, kvh, _ = k_cache.shape
    return (qkv, np.int32(qkv.shape[1]), k_cache, v_cache, positions, query_start_loc, seq_lens,
            block_tables, np.int32(block_tables.shape[1]), np.int32(len(seq_lens)), np.int32(kvh),
            np.int32(block_size), np.float32(scale), np.int32(window), out, *workspace)


def paged_attention(kernels: HostKernels, qkv, k_cache, v_cache, positions, query_start_loc,
                    seq_lens, block_tables, scale: float, out, splits: int,
                    workspace: tuple = (None, None, None), window: int = 0,
                    rope: tuple | None = None) -> None:
    """What PagedAttention.__call__ launches (one kernel: its splits combined by their last block;
    rope (slot_mapping, cos, sin): paged_attention_rope, RoPE and the K/V write in the launch)."""
    T, kvh = qkv.shape[0], k_cache.shape[2]
    suffix = launch.SUFFIXES[str(qkv.dtype)]  # fp16 or bf16 (uint16 bits), as PagedAttention picks
    name = "paged_attention_rope" if rope is not None else "paged_attention"
    extra = () if rope is None else (rope[0], rope[1], rope[2], np.int32(rope[1].shape[1]))
    kernels.call(name + suffix, launch.attention_launch(T, kvh, splits), *paged_attention_args(
        qkv, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables, scale, out,
        workspace, window), *extra)


class HostBuild:
    """Builds each (source, defines) once into a folder; get() returns its HostKernels."""

    def __init__(self, gxx: str, folder: Path):
        self.gxx, self.folder = gxx, folder
        self.built: dict[tuple, HostKernels] = {}
        for name in ENTRIES:
            if name.endswith(".cu"):
                (folder / name).write_text(toolchain.source(name))

    def get(self, source: str, defines: dict[str, int] | None = None) -> HostKernels:
        key = (source, tuple(sorted((defines or {}).items())))
        if key not in self.built:
            self.built[key] = self._build(source, defines)
        return self.built[key]

    def prebuild(self, variants: list[tuple[str, dict[str, int] | None]]) -> None:
        """Build several at once (two cores: about half the time of one after another)."""
        with ThreadPoolExecutor(max_workers=2) as pool:
            for source, defines in variants:
                key = (source, tuple(sorted((defines or {}).items())))
                if key not in self.built:
                    self.built[key] = pool.submit(self._build, source, defines)
        self.built = {k: v.result() if hasattr(v, "result") else v for k, v in self.built.items()}

    def _build(self, source: str, defines: dict[str, int] | None) -> HostKernels:
        suffix = "_".join(f"{k}{v}" for k, v in sorted((defines or {}).items()))
        out = self.folder / f"{Path(source).stem}{'_' + suffix if suffix else ''}.so"
        # NOTE: -fno-gnu-unique: a __shared__ array inside a kernel template is a static local of
        # an inline function, which GCC makes a GNU-unique symbol, one copy per process across
        # every loaded .so: attention.cu's variants (each HEAD_DIM/GQA_GROUP its own sizes)
        # would all write the first one's
        cmd = [self.gxx, "-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-fno-gnu-unique",
               f"-I{HOST_DIR / 'include'}", "-iquote", str(self.folder), *gxx_defines(defines),
               str(HOST_DIR / ENTRIES[source]), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-6000:]}"
        return HostKernels(out)


def find_gxx() -> str | None:
    return shutil.which("g++")
