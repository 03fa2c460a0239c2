"""Packed weights on the CUDA backend, the part CI runs without CuPy: the weight store that
uploads gpu/loader/quant.py's planes as they are, and the linear that reads them through quant.cu's
kernels (launched by gpu/cuda/quant.py on a GPU, by tests/cuda_host_kernels.py on the host).

Device layout: gpu/loader/quant.py's planes (u4 nibbles in 64-weight groups, or int8; a scale and
offset per block of 16/32/128 weights; bf16 bits as they are), not the raw GGUF blocks. The
scale planes in their compact exact form (gpu/loader/quant.py's module doc; quant.cu's plane_at
reads all three): K-quants as int8 factors of float32 super planes (repack factored=True:
d and -dmin per 256 weights), float32 planes of exact halves as fp16 (as_halves: every legacy
type, GPTQ), anything else float32 (AWQ, whose offsets -(z s) are no halves).
Why: (1) every quant row is 16-byte aligned, so each lane streams its quants with one vector
load (GGUF blocks are 18, 20, 22, 34, 84, 110, 144, 176 or 210 bytes: no vector load lines up
with them); (2) one kernel per plane kind serves all ten GGUF types and AWQ/GPTQ int4
(repacked into the same u4 planes; Q6_K's into u6); (3) the planes are the ones tests/test_quant_kernels.py
proves bit-identical to gguf-py's `dequantize`, in every form. The price is bytes, mostly
5-bit quants widened to int8: B/weight (raw GGUF in brackets) Q4_K 0.594 (0.5625), Q4_0 0.5625
(0.5625: no offset plane, as_zero_point), Q4_1 0.625 (0.625), Q6_K 0.828 (0.82: the u6 plane,
nibbles and 2-bit highs, as_u6), Q8_0 and Q5_0 1.0625 (1.0625/0.6875), Q3_K 1.078 (0.43), Q5_K
1.094 (0.69), Q5_1 1.125 (0.75), Q2_K 1.156 (0.33), AWQ 0.5625, GPTQ 0.516. The kernels and the
GPU check report the bytes actually read (QuantWeight.nbytes).

16-bit float matrices are dense: DenseStore (gpu/cuda/buffers.py) uploads them in the serving
dtype (gpu/cuda/dtypes.py: a bfloat16 checkpoint serves in bfloat16, its BF16 bits as they are)
and cuBLAS multiplies them. Only inside a linear that has packed parts does a BF16 part become
the "bf16" plane here, which the kernels widen to float32 exactly (a quantized model serves in
fp16; a large batch's chunks are fp16, see quant.cu's dequant_bf16 for why that is exact in
practice).

A linear with M rows of activations runs the kernel its crossover table gives for M (QuantLinear
.impl_for: the mat-vec up to matvec_max_rows, large_batch above):
- "matvec": matvec_<kind>_r<R> (bf16 activations: _bf16), dequantized in registers, on tiles of
  up to 16 rows of x (launch.MATVEC_ROWS): one launch a linear up to 16 rows;
- "tiled": gemm_<kind> (64 rows of x a block; gemm_<kind>_m128 128 above 64 rows), one launch:
  each block dequantizing a 64-feature tile of the weight into shared memory once for its
  rows (the same 16-bit values as dequant_*) and multiplying on tensor cores (mma.sync
  m16n8k16, fp32 accumulation), so each quant is read once per 64 or 128 rows of x (vLLM's
  awq_gemm, llama.cpp's MMQ: the same idea). No workspace and no cuBLAS: a
  graph captures it as it is. bf16 activations: gemm_<kind>_bf16 (mma .bf16);
- "dequant": the weight dequantized to the activations' type into a static workspace, chunk of
  rows by chunk of rows, each chunk followed by the cuBLAS GEMM. It writes and reads 4 bytes a
  weight besides the quants; it never won on the device (600-800 us against the tiled GEMM's
  116-304 at 16-256 rows, H200, 2026-12-04), so it stays only as a policy gpu_check measures.
The table (MATVEC_MAX_ROWS, LARGE_BATCH) is a HOST DEFAULT, NOT MEASURED for the kernels as they
are now: the 2026-12-04 device run measured the previous mat-vec (one 16-byte load a lane a
trip), which lost to the tiled GEMM at 16 rows in 3 of 4 cases and at 64-256 in all; the
redesigned mat-vec is expected to hold up to 8 rows. tools/gpu_check.py's linear table (--table
quant) times every kernel at rows 1, 16, 64, 256 and prints the crossover it implies; set these
two from it.
A fused weight whose parts differ in type (llama.cpp's Q4_K_M: Q4_K q/k with Q6_K v) is a
SplitWeight; each part writes its own columns of out (the kernels take out's row pitch).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np

from ringserve.gpu.cuda import launch
from ringserve.gpu.cuda.buffers import DenseStore
from ringserve.gpu.loader.packing import SplitWeight, as_fused, stack_packed
from ringserve.gpu.loader.quant import QuantWeight, as_halves, as_u6, as_zero_point, dequantize
from ringserve.gpu.loader.weights import GGMLTensor

PLANE_KINDS = ("u4", "u6", "i8", "bf16")  # read by quant.cu; dense F16, F32, BF16: DenseStore's (cuBLAS)
WORKSPACE_ELEMENTS = 32 << 20   # fp16 elements (64 MiB) a large batch's dequantized chunk takes
# The crossover table, rows of x -> kernel (the module doc: a host default, not measured yet):
# the mat-vec up to MATVEC_MAX_ROWS rows, LARGE_BATCH above.
MATVEC_MAX_ROWS = 8
LARGE_BATCH_POLICIES = ("dequant", "tiled")
LARGE_BATCH = "tiled"
# weights one 16-byte load of the quants holds (u6: of its nibble plane, a row's first K / 2 bytes)
WEIGHTS_PER_CHUNK = {"u4": 32, "u6": 32, "i8": 16, "bf16": 8}
# dequant_*'s output types, by dtype name: the activations' (fp16, bf16 bits) and float32
DEQUANT_SUFFIXES = {"float16": "f16", "uint16": "bf16", "float32": "f32"}
# quant.cu's kernels (extern "C"): what gpu/cuda/quant.py loads, tests/test_cuda_compile.py checks.
# The mat-vecs and tiled GEMMs in each activation type (launch.SUFFIXES: fp16 plain, bf16 _bf16).
KERNELS = tuple(f"matvec_{kind}_r{rows}{suffix}" for kind in PLANE_KINDS for rows in launch.MATVEC_ROWS
                for suffix in launch.SUFFIXES.values()) + \
    tuple(f"dequant_{kind}_{out}" for kind in PLANE_KINDS for out in DEQUANT_SUFFIXES.values()) + \
    tuple(f"gemm_{kind}{rows}{suffix}" for kind in PLANE_KINDS for rows in ("", "_m128")
          for suffix in launch.SUFFIXES.values())


def _on_planes(kind: str, cols: int) -> bool:
    """quant.cu reads this kind at this row length: u4 and i8 rows always fit (whole blocks of
    16+ weights), a bf16 row needs whole 16-byte loads (8 weights; else the fp16 path)."""
    return kind in PLANE_KINDS and cols % WEIGHTS_PER_CHUNK[kind] == 0


def keeps_blocks(tensor: Any) -> bool:
    """A tensor the CUDA backend keeps packed: GGUF integer blocks (a GGMLTensor) or a
    QuantWeight already made (AWQ/GPTQ from gpu/loader/hf_quant.py; gpu_check's, made on the device).
    Float tensors (BF16, F16, F32) are dense: cuBLAS in the serving dtype."""
    if isinstance(tensor, QuantWeight):
        return _on_planes(tensor.kind, tensor.shape[1])
    return isinstance(tensor, GGMLTensor) and tensor.ggml_type not in ("BF16", "F16", "F32")


class QuantStore:
    """model.WeightStore for the CUDA backend: a linear with a packed part is gpu/loader/packing.py's
    QuantWeight (or SplitWeight of several types) with its planes moved to the device (arrays of
    xp: cupy on a GPU, numpy in CI); every other weight is DenseStore's, in `dtype` (the serving
    dtype: float16 whenever a weight is packed, gpu/cuda/dtypes.py).
    QuantWeights already on the device are stacked there (np.concatenate reaches
    cupy.concatenate through __array_function__)."""

    def __init__(self, xp, dtype: str = "float16"):
        self.xp = xp
        self.dense = DenseStore(xp, dtype)
        self.vector = self.dense.vector

    def linear(self, arrays: Sequence[Any]) -> Any:
        if not any(keeps_blocks(a) for a in arrays):
            return self.dense.linear(arrays)
        return self.packed(arrays)

    def packed(self, arrays: Sequence[Any]) -> Any:
        """The arrays as planes on the device whatever their type (a BF16 tensor too: the bf16
        plane; an F16/F32 part, or a bf16 row of odd length, dense): what linear() makes of a
        weight with a packed part, and what the kernel tests and gpu_check make of one."""
        # NOTE: K-quant scales as int8 factors (fewer bytes)
        return as_fused([self._upload(p) for p in stack_packed(arrays, factored=True)])

    def _upload(self, w: Any) -> Any:
        assert isinstance(w, QuantWeight)  # stack_packed's: gpu/loader/quant.py's planes
        if not _on_planes(w.kind, w.shape[1]):  # F16, F32 parts (a bf16 row of odd length): fp16
            return self.dense.linear([dequantize(w)])
        # NOTE: no -8 d offset plane (Q4_0, GPTQ), Q6_K as u6, exact halves as fp16: fewer bytes
        w = as_halves(as_zero_point(as_u6(w)))
        check_scales(w)
        return replace(w, q=self._device(w.q), scale=self._device(w.scale), offset=self._device(w.offset),
                       scale_super=self._device(w.scale_super), offset_super=self._device(w.offset_super))

    def _device(self, a: Any) -> Any:
        """A plane on the device (None stays None), 16-byte aligned for the kernels' vector
        loads: CuPy's allocations are; a numpy view into a memory-mapped file (a lone BF16
        weight, CI's "device") may not be, and is copied."""
        if a is None:
            return None
        out = self.xp.asarray(a)
        if isinstance(out, np.ndarray) and out.ctypes.data % 16:
            out = out.copy()
        return out


Call = Callable[..., None]  # call(kernel name, (grid, block), *args): one launch of quant.cu


class QuantLinear:
    """ops.linear (and the embedding of a packed table) over QuantStore's weights.
    call: launches a quant.cu kernel (np.int32 scalars, arrays, None for a null pointer);
    gemm(x, w, out): out = x @ w.T for 16-bit arrays (CublasGemm on a GPU); workspace: a 1-D
    array in the activations' dtype (fp16, or bf16 bits), allocated once (never during a graph
    capture); the crossover table: the mat-vec up to matvec_max_rows rows of x, large_batch
    (LARGE_BATCH_POLICIES) above."""

    def __init__(self, call: Call, gemm: Callable[[Any, Any, Any], None], workspace: Any,
                 large_batch: str = LARGE_BATCH, matvec_max_rows: int = MATVEC_MAX_ROWS):
        if large_batch not in LARGE_BATCH_POLICIES:
            raise ValueError(f"large_batch {large_batch!r}: {', '.join(LARGE_BATCH_POLICIES)}")
        self.call, self.gemm, self.workspace = call, gemm, workspace
        self.large_batch, self.matvec_max_rows = large_batch, matvec_max_rows

    def impl_for(self, rows: int) -> str:
        """The kernel the crossover table runs for `rows` rows of x: "matvec", "tiled" or "dequant"."""
        return impl_for(rows, self.matvec_max_rows, self.large_batch)

    def __call__(self, x, w, out) -> None:
        if isinstance(w, QuantWeight):
            self._quant(x, w, out)
        elif isinstance(w, SplitWeight):
            lo = 0
            for part in w.parts:  # NOTE: each part writes only its own columns of out
                hi = lo + part.shape[0]
                self(x, part, out[:, lo:hi])
                lo = hi
        else:
            self.gemm(x, w, out)

    def _quant(self, x, w: QuantWeight, out) -> None:
        M, K = x.shape
        N = w.shape[0]
        if w.shape[1] != K or tuple(out.shape) != (M, N):
            raise ValueError(f"quant linear: x {x.shape} @ w {w.shape}.T into out {out.shape}")
        if M == 0:
            return
        impl = self.impl_for(M)
        if impl == "matvec":
            self.matvec(x, w, out)
        elif impl == "tiled":
            self.tiled(x, w, out)
        else:
            self.dequant_gemm(x, w, out)

    def matvec(self, x, w: QuantWeight, out) -> None:
        """matvec_<kind>_r<R> on tiles of up to 16 rows of x (any M; the table's up to matvec_max_rows)."""
        M, K, N = x.shape[0], x.shape[1], w.shape[0]
        ldx, ldo = _x_pitch(x), _pitch(out, "out")
        tile = launch.MATVEC_ROWS[-1]
        for lo in range(0, M, tile):  # PERF: one launch at decode batches up to 16
            m = min(tile, M - lo)
            self.call(*matvec_kernel(w.kind, m, N, str(x.dtype)), *weight_args(w), x[lo:lo + m],
                      np.int32(ldx), np.int32(m), np.int32(N), np.int32(K), out[lo:lo + m], np.int32(ldo))

    def tiled(self, x, w: QuantWeight, out) -> None:
        """gemm_<kind> (bf16 activations: _bf16): dequantized into shared memory, tensor cores,
        one launch (any M); no workspace."""
        M, K, N = x.shape[0], x.shape[1], w.shape[0]
        self.call(*tiled_kernel(w.kind, M, N, str(x.dtype)), *weight_args(w),
                  x, np.int32(_x_pitch(x)), np.int32(M), np.int32(N), np.int32(K), out,
                  np.int32(_pitch(out, "out")))

    def dequant_gemm(self, x, w: QuantWeight, out) -> None:
        """The weight dequantized to fp16 into the workspace, chunk of rows by chunk of rows,
        each chunk followed by the cuBLAS GEMM (any M)."""
        K, N = x.shape[1], w.shape[0]
        rows = max(1, len(self.workspace) // K)
        for lo in range(0, N, rows):  # PERF: one chunk for every linear of a 1B model
            n = min(rows, N - lo)
            chunk = self.workspace[:n * K].reshape(n, K)
            self.dequantize(w, None, lo, n, chunk)
            self.gemm(x, chunk, out[:, lo:lo + n])

    def dequantize(self, w: QuantWeight, ids, row_begin: int, num_rows: int, out) -> None:
        """out[r] = W[ids[r]] (ids None: W[row_begin + r]) in out's dtype (fp16, bf16 bits or
        float32)."""
        suffix = DEQUANT_SUFFIXES[str(out.dtype)]
        K = w.shape[1]
        self.call(f"dequant_{w.kind}_{suffix}",
                  launch.dequant_launch(num_rows, K // WEIGHTS_PER_CHUNK[w.kind]),
                  *weight_args(w), np.int32(K), ids, np.int32(row_begin), np.int32(num_rows), out,
                  np.int32(_pitch(out, "out")))

    def embedding(self, ids, table: QuantWeight, out) -> None:
        """out [T, hidden] = table[ids], dequantized in out's dtype."""
        self.dequantize(table, ids, 0, len(ids), out)


def impl_for(rows: int, matvec_max_rows: int = MATVEC_MAX_ROWS, large_batch: str = LARGE_BATCH) -> str:
    """The crossover table's kernel for `rows` rows of x (QuantLinear's; the census's)."""
    return "matvec" if rows <= matvec_max_rows else large_batch


def matvec_kernel(kind: str, rows: int, out_features: int, dtype: str) -> tuple[str, tuple]:
    """The mat-vec launch of up to 16 rows of x: (kernel name, (grid, block)); dtype: x's name."""
    variant = launch.matvec_variant(rows)
    return (f"matvec_{kind}_r{variant}{launch.SUFFIXES[dtype]}",
            launch.matvec_launch(out_features, kind, variant))


def tiled_kernel(kind: str, rows: int, out_features: int, dtype: str) -> tuple[str, tuple]:
    """The tiled GEMM's launch: (kernel name, (grid, block)); gemm_<kind>_m128 above 64 rows."""
    m128 = "_m128" if launch.gemm_rows(rows) > launch.GEMM_TILE else ""
    return f"gemm_{kind}{m128}{launch.SUFFIXES[dtype]}", launch.gemm_launch(rows, out_features)


# The forms of the scale and offset planes quant.cu reads (scale_bytes: the planes' itemsize):
# (dtype of both, with super planes)
SCALE_FORMS = (("float32", False), ("float16", False), ("int8", True))


def check_scales(w: QuantWeight) -> None:
    """w's scale planes are one of SCALE_FORMS (bf16: none), both planes in the same form."""
    if w.scale is None:
        return
    form = (str(w.scale.dtype), w.scale_super is not None)
    if form not in SCALE_FORMS or (w.offset is not None and (str(w.offset.dtype), w.offset_super is not None)
                                   != form):
        raise ValueError(f"{w.qtype}: scale {form} / offset "
                         f"{None if w.offset is None else (str(w.offset.dtype), w.offset_super is not None)} "
                         f"(dtype, super planes): not one of quant.cu's forms {SCALE_FORMS}")


def weight_args(w: QuantWeight) -> tuple:
    """quant.cu's WEIGHT_PARAMS for w (QuantStore's: check_scales passed): quants, scale and
    offset planes (None: a null pointer), super planes, scale_bytes, block (bf16: no scales),
    zero (the quants' zero point where the offset plane is left out)."""
    scale_bytes = 4 if w.scale is None else w.scale.itemsize  # NOTE: 4, 2, 1: the form (SCALE_FORMS)
    return (w.q, w.scale, w.offset, w.scale_super, w.offset_super, np.int32(scale_bytes), np.int32(w.block),
            np.int32(w.zero))


def _x_pitch(x: Any) -> int:
    """x's row pitch: quant.cu reads x in 16-byte loads (8 halves), so a multiple of 8."""
    ldx = _pitch(x, "x")
    if ldx % 8:
        raise ValueError(f"quant linear: x's row pitch {ldx} is not a multiple of 8 halves")
    return ldx


def _pitch(a: Any, name: str) -> int:
    """Elements between rows of a 2-D array whose rows are contiguous."""
    if a.ndim != 2 or a.strides[1] != a.itemsize:
        raise ValueError(f"quant linear: {name} {a.shape} strides {a.strides}: rows must be contiguous")
    return max(a.shape[1], a.strides[0] // a.itemsize)
