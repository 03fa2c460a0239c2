"""The CUDA runner's GEMMs without a GPU (issue 15 item 1): gpu/cuda/gemm.py CublasGemm over a
host stand-in of nvmath's cuBLAS binding (tests/cublas_host.py: records every call, does the
column-major GEMM in numpy on the memory the pointers name).

- the (transa, transb, m, n, k, lda, ldb, ldc) of each call reproduce x @ w.T, for every linear
  of the model: the whole forward (gpu/models ModelDefinition.forward, eager and graph-shaped, in fp16
  and in bf16) runs through the runner's own CudaOps.linear over the stand-in, the other ops
  as tests/test_cuda_forward_host.py runs them, against the CPU backend's logits;
- the forward calls no CuPy cuBLAS entry point: CudaOps is imported over a `cupy` that has no
  attribute at all (any cp.matmul / cp.dot / cp.cublas use raises), and the modules of the
  captured path are read for GEMMs by any other name (`@`, .dot, tensordot, einsum, cublas).
What it cannot check: cuBLAS itself, the numbers tensor cores give, the capture.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import test_cuda_forward_host as fwd
from cublas_host import CUDA_R_16BF, CUDA_R_16F, ComputeType, HostCublas, Operation
from fp16_checks import decode_against_cpu, widen
from ringserve.gpu.bfloat16 import to_bfloat16, widen_bfloat16
from ringserve.gpu.cuda import gemm
from ringserve.gpu.cuda.gemm import CublasGemm, linear_args
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig

pytestmark = pytest.mark.sim
STREAM = 0x5EED
F16, F32 = np.float16, np.float32
KERNEL_OPS = ("copy_in", "copy_in_corner", "embedding", "add_bias", "add_rms_norm",
              "attention", "silu_mul", "gather_rows", "to_float32")


def host_gemm(cublas: HostCublas) -> CublasGemm:
    workspace = np.zeros(1024, np.uint8)
    g = CublasGemm(cublas, STREAM, cublas.ptr(workspace), workspace.nbytes, cublas.ptr)
    g.workspace = workspace  # type: ignore[attr-defined]  # kept alive with the handle
    return g


# the serving dtypes as the device holds them: (storage dtype, float32 -> storage, storage -> float32)
DTYPES = {"float16": (F16, lambda a: a.astype(F16), lambda a: a.astype(F32)),
          "bfloat16": (np.uint16, lambda a: to_bfloat16(np, a), lambda a: widen_bfloat16(np, a))}
CUDA_TYPES = {"float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("pad", [0, 8])
@pytest.mark.parametrize("M,K,N", [(1, 64, 3), (7, 96, 40), (33, 17, 5)])
def test_gemm_reproduces_x_at_w_transposed(M, K, N, pad, dtype):
    """Leading-rows views of taller buffers (a graph size's views); pad: rows wider than the
    matrix, so that x's, w's and out's pitches all differ from K and N. bf16: uint16 bits, the
    call's types CUDA_R_16BF, the result x @ w.T of the bf16 values rounded once to bf16."""
    store, narrow, widen = DTYPES[dtype]
    rng = np.random.default_rng(M)
    cublas = HostCublas()
    g = host_gemm(cublas)
    big_x = narrow(rng.standard_normal((M + 4, K + pad)))
    w = narrow(rng.standard_normal((N, K + 2 * pad)))[:, :K]
    big_out = np.full((M + 4, N + 3 * pad), 0xFFFF, np.uint16).view(store).copy()  # NaN in both
    x, out = big_x[:M, :K], big_out[:M, :N]
    g(x, w, out)
    exact = widen(x) @ widen(w).T
    # one rounding of sums near |exact|: half a unit of the last place of the 16-bit type
    spacing = np.spacing(np.abs(exact).astype(F16)).astype(F32) * (8 if dtype == "bfloat16" else 1)
    assert np.all(np.abs(widen(out) - exact) <= spacing + 1e-4 * np.abs(exact).max())
    big_out.view(np.uint16)[:M, :N] = 0xFFFF
    assert (big_out.view(np.uint16) == 0xFFFF).all()  # nothing outside the view written
    (call,) = cublas.calls
    assert (call.transa, call.transb, call.m, call.n, call.k) == (Operation.T, Operation.N, N, M, K)
    assert (call.lda, call.ldb, call.ldc) == (K + 2 * pad, K + pad, N + 3 * pad)
    assert (call.atype, call.btype, call.ctype) == (CUDA_TYPES[dtype],) * 3
    assert call.compute_type == ComputeType.COMPUTE_32F
    assert (call.a, call.b, call.c) == (w.ctypes.data, x.ctypes.data, out.ctypes.data)


def test_handle_gets_stream_then_workspace_before_any_gemm():
    """cublasSetStream resets the workspace: the order matters, and both precede capture."""
    cublas = HostCublas()
    g = host_gemm(cublas)
    assert [e[0] for e in cublas.events] == ["create", "set_stream", "set_workspace"]
    handle = g.handle
    assert cublas.handles[handle]["stream"] == STREAM
    g.close()
    assert cublas.events[-1] == ("destroy", handle) and g.handle == 0


def test_the_stand_in_has_nvmaths_names_and_values():
    """Where nvmath-python is installed (the `cuda` extra), the stand-in's enums and the
    functions CublasGemm calls are the binding's own."""
    nvmath = pytest.importorskip("nvmath")
    from nvmath.bindings import cublas
    assert int(nvmath.CudaDataType.CUDA_R_16F) == CUDA_R_16F == gemm.CUDA_R_16F
    assert int(nvmath.CudaDataType.CUDA_R_16BF) == CUDA_R_16BF == gemm.CUDA_R_16BF
    for enum_name in ("Operation", "ComputeType", "GemmAlgo"):
        ours = getattr(HostCublas, enum_name)
        for member in ours:
            assert int(getattr(getattr(cublas, enum_name), member.name)) == int(member), member
    for fn in ("create", "destroy", "set_stream", "set_workspace", "gemm_ex"):
        assert callable(getattr(cublas, fn))


def test_bad_operands_are_refused():
    x, w = np.zeros((2, 8), F16), np.zeros((3, 8), F16)
    with pytest.raises(ValueError, match="one of float16 or uint16"):
        linear_args(x.astype(F32), w, np.zeros((2, 3), F16), 0, 1)
    with pytest.raises(ValueError, match="x float16, w uint16"):  # fp16 activations, bf16 weights
        linear_args(x, w.view(np.uint16), np.zeros((2, 3), F16), 0, 1)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        linear_args(np.zeros((8, 2), F16).T, w, np.zeros((2, 3), F16), 0, 1)
    with pytest.raises(ValueError, match=r"x \(2, 8\) @ w \(3, 9\)"):
        linear_args(x, np.zeros((3, 9), F16), np.zeros((2, 3), F16), 0, 1)


@pytest.fixture
def cuda_ops_class(monkeypatch):
    """gpu/cuda/runner.py's CudaOps, imported over a `cupy` in which every name raises."""
    def no_cupy(name):
        raise AttributeError(f"cupy.{name} used in the CUDA forward's host run")
    fake = types.ModuleType("cupy")
    fake.__getattr__ = no_cupy  # type: ignore[method-assign]
    before = set(sys.modules)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for name in ("ringserve.gpu.cuda.runner", "ringserve.gpu.cuda.attention", "ringserve.gpu.cuda.fused"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module("ringserve.gpu.cuda.runner").CudaOps
    for name in set(sys.modules) - before:  # the modules bound to the fake go (numba's stay)
        if any(value is fake for value in vars(sys.modules[name]).values()):
            del sys.modules[name]


class CheckedGemm:
    """The runner's gemm, each call's result checked against numpy's x @ w.T."""

    def __init__(self, inner: CublasGemm):
        self.inner = inner
        self.shapes: set[tuple[int, int]] = set()  # (out features, in features) seen

    def __call__(self, x, w, out) -> None:
        self.inner(x, w, out)
        want = widen(x) @ widen(w).T
        np.testing.assert_allclose(widen(out), want, rtol=1e-2, atol=1e-2)
        self.shapes.add(w.shape)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_forward_through_the_runners_gemm_matches_the_cpu_backend(tiny_cuda_model_dir, cuda_host,
                                                                   cuda_ops_class, decode, dtype):
    host = fwd.HostRunner(tiny_cuda_model_dir, cuda_host, dtype=dtype)
    c = host.config
    cublas = HostCublas()

    def init(self, c, cuda_host):
        fwd.HostOps.__init__(self, c, cuda_host)
        self.stream = contextlib.nullcontext()
        self.gemm = CheckedGemm(host_gemm(cublas))

    # CudaOps's own linear, add_bias and to_float32; the kernels as the host forward runs them
    ops_class = type("HostCudaOps", (cuda_ops_class,),
                     {"__init__": init, **{n: getattr(fwd.HostOps, n) for n in KERNEL_OPS}})
    host.ops = ops_class(c, cuda_host)
    cpu = ModelRunner(tiny_cuda_model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=fwd.NUM_BLOCKS, block_size=fwd.BLOCK_SIZE))
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3]]
    tables = np.random.default_rng(5).permutation(fwd.NUM_BLOCKS)[:8].reshape(2, 4).astype(np.int32)
    decode_against_cpu(cpu, host, prompts, tables, fwd.BLOCK_SIZE, 3, graph=decode == "graph")
    # every linear of the model went through cuBLAS's gemm_ex: QKV, o, gate-up, down, lm_head
    assert host.ops.gemm.shapes == {(c.q_size + 2 * c.kv_size, c.hidden_size), (c.hidden_size, c.q_size),
                                    (2 * c.intermediate_size, c.hidden_size),
                                    (c.hidden_size, c.intermediate_size), (c.vocab_size, c.hidden_size)}
    per_step = 4 * c.num_hidden_layers + 1
    assert len(cublas.calls) == 3 * per_step
    assert {call.atype for call in cublas.calls} == {CUDA_R_16F if dtype == "auto" else CUDA_R_16BF}


def test_a_packed_forward_through_the_runners_ops(tmp_path, cuda_host, cuda_ops_class, monkeypatch):
    """CudaOps's own linear and embedding over a tiny Q4_K_M GGUF (a Q6_K embedding, QKV split
    into Q4_K and Q6_K parts): quant.cu (host build) through QuantLinear against the CPU backend;
    every packed linear stays in quant.cu (quant_linear's crossover: the mat-vec for the decodes,
    the tiled GEMM for the prefill), none is dequantized into cuBLAS."""
    from ringserve.gpu.cuda.quant_linear import QuantLinear
    model_dir = fwd.tiny_gguf(tmp_path, "q4_k_m", monkeypatch)
    host = fwd.HostRunner(model_dir, cuda_host)
    c = host.config
    cublas = HostCublas()

    def init(self, c, cuda_host):
        fwd.HostOps.__init__(self, c, cuda_host)
        self.stream = contextlib.nullcontext()
        self.gemm = CheckedGemm(host_gemm(cublas))
        self.quant = QuantLinear(cuda_host.get("quant.cu").call, self.gemm, np.full(1 << 16, np.nan, F16))

    own = {"embedding"}  # CudaOps's: the packed table through quant.cu
    ops_class = type("HostCudaOps", (cuda_ops_class,),
                     {"__init__": init, **{n: getattr(fwd.HostOps, n) for n in KERNEL_OPS if n not in own}})
    host.ops = ops_class(c, cuda_host)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=fwd.NUM_BLOCKS, block_size=fwd.BLOCK_SIZE))
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3] + list(range(40, 100))]  # 68 rows: the tiled GEMM
    tables = np.random.default_rng(5).permutation(fwd.NUM_BLOCKS)[:8].reshape(2, 4).astype(np.int32)
    decode_against_cpu(cpu, host, prompts, tables, fwd.BLOCK_SIZE, 2, graph=True)
    # the prefill (68 rows) and the decodes alike: no packed weight reaches cuBLAS's stand-in
    assert not host.ops.gemm.shapes, host.ops.gemm.shapes


# What runs inside a capture: CudaOps (runner.py) and the modules it launches through.
CAPTURED = ("runner.py", "gemm.py", "fused.py", "attention.py", "buffers.py", "numba_kernels.py",
            "capture.py", "quant.py", "quant_linear.py")
GEMM_NAMES = {"matmul", "dot", "tensordot", "einsum", "inner", "vdot", "linalg", "cublas",
              "cublasLt"}


def _gemm_uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            found.append(f"line {node.lineno}: @")
        elif isinstance(node, ast.Attribute) and node.attr in GEMM_NAMES:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = getattr(node, "module", None) or ""
            names = [module] + [a.name for a in node.names]
            if any("cublas" in n for n in names) and not module.startswith("nvmath"):
                found.append(f"line {node.lineno}: import {names}")
    return found


def test_the_captured_path_names_no_other_gemm():
    """A CuPy GEMM by any spelling (cp.matmul, x @ w, cp.dot, cupy_backends' cublas) in the
    modules a capture runs through; runner.py is read from CudaOps and the forward down."""
    root = Path(gemm.__file__).parent
    offenders = {}
    for name in CAPTURED:
        tree = ast.parse((root / name).read_text())
        if name == "runner.py":  # the capture's part: CudaOps and CudaModelRunner._forward
            classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
            runner_forward = [f for f in classes["CudaModelRunner"].body
                              if isinstance(f, ast.FunctionDef) and f.name in ("_forward", "_logits_at")]
            tree = ast.Module(body=[classes["CudaOps"], *runner_forward], type_ignores=[])
        if found := _gemm_uses(tree):
            offenders[name] = found
    assert not offenders, offenders


def test_the_gemm_check_sees_a_cupy_matmul():
    """The checker finds what it must: the old CudaOps.linear."""
    old = ("def linear(self, x, weight, out):\n    with self.stream:\n"
           "        cp.matmul(x, weight.T, out=out)\n")
    assert _gemm_uses(ast.parse(old)) == ["line 3: .matmul"]
    assert _gemm_uses(ast.parse("out[...] = x @ w.T")) == ["line 1: @"]
    assert _gemm_uses(ast.parse("from cupy_backends.cuda.libs import cublas")) != []
