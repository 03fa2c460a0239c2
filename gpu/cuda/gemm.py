"""The CUDA runner's GEMMs on its own cuBLAS handle, so that a CUDA graph can capture them.

Not cp.matmul: CuPy refuses every cuBLAS call on a capturing stream. In cupy/cupy@6b6d9563,
cupy_backends/cuda/libs/cublas.pyx lines 642-651: setStream() raises NotImplementedError
('calling cuBLAS API during stream capture is currently unsupported') when
runtime.streamIsCapturing(stream); lines 666-668 and 1639-1644: gemmEx() calls _setStream()
first. cupy/_core/_routines_linalg.pyx: matmul (line 821) takes 2-D operands to dot (lines
856-863; dot at 475), dot to tensordot_core (538; at 541), which on compute capability >= 5.0
calls tensordot_core_v11 (630; at 702), which calls cublas.gemmEx (775).
PyTorch captures cuBLAS because it owns its handle and workspace; so does this class, through
nvmath-python's binding (nvmath/bindings/cublas.pyx: create, set_stream, set_workspace,
gemm_ex), which has no such guard. The binding is passed in (`cublas`): CI runs this class over
a host stand-in that records each call and does the column-major GEMM in numpy
(tests/test_cuda_gemm_host.py).

The element type is the arrays' (one for all three): fp16 (CUDA_R_16F), or bfloat16 bits in
uint16 arrays (CUDA_R_16BF, gpu/cuda/dtypes.py); the compute type is always CUBLAS_COMPUTE_32F
(fp32 accumulation, alpha and beta float32), as vLLM's (torch's) bf16 and fp16 GEMMs.

Row-major out[M, N] = x[M, K] @ w[N, K].T, read column-major (a row-major array is its
transpose there): out^T[N, M] = w[N, K] x^T[K, M], i.e. C = op(A) op(B) with A = w seen as
[K, N] (lda: w's row pitch) and op(A) = A^T, B = x seen as [K, M] (ldb: x's row pitch), C = out
seen as [N, M] (ldc: out's row pitch): transa T, transb N, m = N, n = M, k = K. Row pitches
come from the strides, so the leading-rows views a graph size runs over (StepBuffers.leading)
need no copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

# cudaDataType_t (library_types.h; nvmath.CudaDataType): the GEMMs' element types, by the numpy
# dtype the arrays hold them in (bf16: its bits in uint16).
CUDA_R_16F = 2
CUDA_R_16BF = 14
DATA_TYPES = {np.dtype(np.float16): CUDA_R_16F, np.dtype(np.uint16): CUDA_R_16BF}
# cuBLAS wants a workspace it owns for graph capture (cuBLAS docs, "CUDA Graphs Support"):
# PyTorch gives Hopper 32 MiB (CUBLAS_WORKSPACE_CONFIG :4096:8), so do we, on every GPU.
WORKSPACE_BYTES = 32 << 20


@dataclass(frozen=True)
class GemmArgs:
    """cublasGemmEx's shape arguments for one linear (the binding's Operation values)."""
    transa: int
    transb: int
    dtype: int    # cudaDataType_t of A, B and C
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int


def _row_pitch(a: Any, name: str) -> int:
    """Elements between rows of a 2-D 16-bit array whose rows are contiguous."""
    if a.ndim != 2 or a.strides[1] != a.itemsize or a.strides[0] % a.itemsize:
        raise ValueError(f"gemm: {name} {a.shape} strides {a.strides}: rows must be contiguous")
    return max(1, a.strides[0] // a.itemsize, a.shape[1])


def linear_args(x: Any, w: Any, out: Any, op_n: int, op_t: int) -> GemmArgs:
    """The column-major GEMM that computes row-major out = x @ w.T (see the module docstring)."""
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or out.shape != (M, N):
        raise ValueError(f"gemm: x {x.shape} @ w {w.shape}.T into out {out.shape}")
    dtype = DATA_TYPES.get(np.dtype(x.dtype))
    if dtype is None or w.dtype != x.dtype or out.dtype != x.dtype:
        raise ValueError(f"gemm: x {x.dtype}, w {w.dtype}, out {out.dtype}: the GEMMs take one of "
                         f"float16 or uint16 (bfloat16 bits) for all three")
    return GemmArgs(transa=op_t, transb=op_n, dtype=dtype, m=N, n=M, k=K, lda=_row_pitch(w, "w"),
                    ldb=_row_pitch(x, "x"), ldc=_row_pitch(out, "out"))


class CublasGemm:
    """out = x @ w.T, fp16 or bf16 arrays, fp32 compute, enqueued on one stream with one preallocated
    workspace, in eager mode and inside a graph capture alike.

    cublas: nvmath.bindings.cublas (or CI's stand-in). ptr: an array's device address
    (CuPy: a.data.ptr). The handle is bound to the stream and workspace once, here, before
    any capture: cublasSetStream resets the workspace to cuBLAS's own pool (cuBLAS docs,
    cublasSetStream), so the workspace is set after it."""

    def __init__(self, cublas: Any, stream_ptr: int, workspace_ptr: int, workspace_bytes: int,
                 ptr: Callable[[Any], int]):
        self.lib, self.ptr = cublas, ptr
        self.handle = cublas.create()
        cublas.set_stream(self.handle, stream_ptr)
        cublas.set_workspace(self.handle, workspace_ptr, workspace_bytes)
        self.op_n, self.op_t = int(cublas.Operation.N), int(cublas.Operation.T)
        self.compute = int(cublas.ComputeType.COMPUTE_32F)
        self.algo = int(cublas.GemmAlgo.DEFAULT)
        # alpha, beta: host float32 (compute 32F, pointer mode host): read when the call is
        # enqueued, so a graph keeps their values; kept alive with the handle all the same.
        self._alpha = np.ones(1, np.float32)
        self._beta = np.zeros(1, np.float32)

    def __call__(self, x: Any, w: Any, out: Any) -> None:
        a = linear_args(x, w, out, self.op_n, self.op_t)
        if a.n == 0:
            return
        # PERF: one binding call per linear; no allocation, no sync, nothing CuPy does
        self.lib.gemm_ex(self.handle, a.transa, a.transb, a.m, a.n, a.k,
                         self._alpha.ctypes.data, self.ptr(w), a.dtype, a.lda,
                         self.ptr(x), a.dtype, a.ldb, self._beta.ctypes.data,
                         self.ptr(out), a.dtype, a.ldc, self.compute, self.algo)

    def close(self) -> None:
        if self.handle:
            self.lib.destroy(self.handle)
            self.handle = 0
