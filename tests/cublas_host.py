"""A host stand-in of nvmath.bindings.cublas for CI (no GPU, no cuBLAS): the functions and
enums gpu/cuda/gemm.py CublasGemm calls, with cuBLAS's signatures (nvmath/bindings/cublas.pyx)
and enum values (cublas_api.h, library_types.h). gemm_ex records its arguments and does the
column-major GEMM in numpy on the memory its pointers name, so wrong transposes, leading
dimensions or pointers give wrong numbers (a read outside the arrays handed out through
`ptr` fails the test instead of reading stray memory). The data types are checked too: A, B and
C share one, fp16 (CUDA_R_16F) or bf16 (CUDA_R_16BF: bits in uint16), which must be the dtype
of the arrays the pointers fall in, and the compute type is COMPUTE_32F; C is rounded to its
type from the float32 sums (bf16: to nearest even, as cuBLAS's epilogue).
"""
from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import numpy as np

from ringserve.gpu.bfloat16 import to_bfloat16, widen_bfloat16

CUDA_R_16F = 2  # library_types.h
CUDA_R_16BF = 14
DATA_TYPES = {CUDA_R_16F: np.dtype(np.float16), CUDA_R_16BF: np.dtype(np.uint16)}  # -> host storage


class Operation(enum.IntEnum):
    N = 0
    T = 1
    C = 2


class ComputeType(enum.IntEnum):
    COMPUTE_16F = 64
    COMPUTE_32F = 68


class GemmAlgo(enum.IntEnum):
    DEFAULT = -1


@dataclass(frozen=True)
class GemmCall:
    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    a: int
    b: int
    c: int
    atype: int
    btype: int
    ctype: int
    compute_type: int


class HostCublas:
    """The binding as a module-like object: create, set_stream, set_workspace, gemm_ex, destroy."""
    Operation, ComputeType, GemmAlgo = Operation, ComputeType, GemmAlgo

    def __init__(self):
        self.calls: list[GemmCall] = []
        self.events: list[tuple] = []          # (function, handle, ...) in call order
        self.handles: dict[int, dict] = {}
        self.arrays: dict[int, np.ndarray] = {}  # base address -> the array's base buffer

    def ptr(self, a: np.ndarray) -> int:
        """An array's address (CublasGemm's ptr=), remembering its memory for the bounds check."""
        base = a if a.base is None else a.base
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        self.arrays[np.asarray(base).ctypes.data] = np.asarray(base)
        return a.ctypes.data

    def create(self) -> int:
        handle = 0x1000 + len(self.handles)
        self.handles[handle] = {"stream": 0, "workspace": None}
        self.events.append(("create", handle))
        return handle

    def destroy(self, handle: int) -> None:
        self.handles.pop(handle)
        self.events.append(("destroy", handle))

    def set_stream(self, handle: int, stream: int) -> None:
        # cublasSetStream resets the workspace to cuBLAS's default pool (cuBLAS docs)
        self.handles[handle].update(stream=stream, workspace=None)
        self.events.append(("set_stream", handle, stream))

    def set_workspace(self, handle: int, workspace: int, nbytes: int) -> None:
        self.handles[handle]["workspace"] = (workspace, nbytes)
        self.events.append(("set_workspace", handle, workspace, nbytes))

    def _view(self, ptr: int, rows: int, cols: int, ld: int, dtype: np.dtype) -> np.ndarray:
        """The column-major 16-bit matrix [rows, cols] with leading dimension ld at ptr, inside
        an array of `dtype` (the one its cudaDataType_t names)."""
        assert ld >= max(1, rows), f"ld {ld} < rows {rows}"
        nbytes = ((cols - 1) * ld + rows) * 2
        for base, arr in self.arrays.items():
            if base <= ptr and ptr + nbytes <= base + arr.nbytes:
                break
        else:
            raise AssertionError(f"gemm_ex reads {nbytes} bytes at {ptr:#x}: outside every array")
        assert arr.dtype == dtype, f"gemm_ex was told {dtype} for an array of {arr.dtype}"
        buf = (ctypes.c_char * nbytes).from_address(ptr)
        return np.ndarray((rows, cols), dtype, buffer=buf, strides=(2, 2 * ld))

    def gemm_ex(self, handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta,
                c, ctype, ldc, compute_type, algo) -> None:
        state = self.handles[handle]
        assert state["stream"] and state["workspace"], f"gemm_ex without stream or workspace: {state}"
        self.calls.append(GemmCall(transa, transb, m, n, k, lda, ldb, ldc, a, b, c, atype, btype,
                                   ctype, compute_type))
        assert atype == btype == ctype and atype in DATA_TYPES, f"types {atype}, {btype}, {ctype}"
        assert compute_type == ComputeType.COMPUTE_32F, f"compute type {compute_type}: fp32 sums"
        dtype = DATA_TYPES[atype]
        alpha_v = ctypes.c_float.from_address(alpha).value
        beta_v = ctypes.c_float.from_address(beta).value
        A = self._view(a, *((m, k) if transa == Operation.N else (k, m)), lda, dtype)
        B = self._view(b, *((k, n) if transb == Operation.N else (n, k)), ldb, dtype)
        C = self._view(c, m, n, ldc, dtype)
        opA = A if transa == Operation.N else A.T
        opB = B if transb == Operation.N else B.T
        acc = alpha_v * (_widen(opA) @ _widen(opB))
        if beta_v:
            acc += beta_v * _widen(C)
        C[...] = acc.astype(np.float16) if dtype == np.float16 else to_bfloat16(np, acc)


def _widen(a: np.ndarray) -> np.ndarray:
    """A 16-bit matrix as float32 (bf16 bits widened exactly)."""
    return widen_bfloat16(np, a) if a.dtype == np.uint16 else a.astype(np.float32)
