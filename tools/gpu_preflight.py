"""gpu_check's preflight: ~30 s that say whether the long run can work, each result printed as
it comes. Imports first (they run without a GPU too: the wheel list of docs/deploy.md is
checked wherever gpu_check runs) and whether numpy and numba-cuda go together, then on the
device: the CUDA C kernels compile (NVRTC), one eager step of a tiny random Llama against the
CPU backend, and one cuBLAS GEMM captured into a CUDA graph and replayed against numpy
(gpu/cuda/gemm.py: the capture CuPy's cuBLAS refuses).
"""
from __future__ import annotations

import importlib
import sys
import tempfile
import time
import traceback
from functools import partial
from typing import Any, Callable

from ringserve.engine.config import CUDA_MAX_NUM_BATCHED_TOKENS
from ringserve.gpu.settings import CacheConfig, DeviceConfig, StepLimits

# What the gpu tests and gpu_check import beyond the standard library (docs/deploy.md lists
# the wheels; tests/test_cuda_gpu_check.py keeps the two in step).
IMPORTS = ("numpy", "cupy", "numba", "numba.cuda", "nvmath.bindings.cublas", "pytest", "httpx",
           "threadpoolctl", "safetensors", "tokenizers", "gguf", "jinja2", "msgspec", "falcon",
           "gunicorn", "uvicorn_worker", "prometheus_client")
OPTIONAL = ("torch", "transformers")  # the peer rows only


def check(results: list[dict], name: str, fn: Callable[[], Any], required: bool = True) -> bool:
    """Run one check, print its line at once, append it to results (the JSON's preflight)."""
    t = time.monotonic()
    try:
        detail = fn()
        ok = True
    except Exception as e:  # a failed check is a result, not the end of the run
        detail = f"{type(e).__name__}: {e}"
        ok = False
        if not isinstance(e, ImportError):
            traceback.print_exc()
    results.append(dict(check=name, ok=ok, required=required, detail=str(detail or ""),
                        seconds=round(time.monotonic() - t, 2)))
    mark = "ok  " if ok else ("FAIL" if required else "--  ")
    print(f"preflight {mark} {name}  {detail or ''}", flush=True)
    return ok


def _import(name: str) -> str:
    module = importlib.import_module(name)
    return str(getattr(module, "__version__", "") or "")


def numpy_numba_cuda() -> str:
    """The numpy / numba-cuda pair can compile a Numba CUDA kernel (gpu/devices.py)."""
    import importlib.metadata as md

    import numpy as np

    from ringserve.gpu.devices import cuda_stack_problem
    if (problem := cuda_stack_problem()) is not None:
        raise RuntimeError(problem)
    return f"numpy {np.__version__}, numba-cuda {md.version('numba-cuda')}"


def imports(results: list[dict]) -> bool:
    ok = all([check(results, f"import {m}", partial(_import, m)) for m in IMPORTS])
    ok = check(results, "numpy / numba-cuda pair", numpy_numba_cuda) and ok
    for m in OPTIONAL:
        check(results, f"import {m}", partial(_import, m), required=False)
    return ok


def compile_kernels() -> str:
    from ringserve.gpu.cuda.attention import PagedAttention
    from ringserve.gpu.cuda.fused import FusedKernels
    FusedKernels()
    for head_dim, group in ((64, 3), (128, 4)):
        PagedAttention(head_dim, group)
    return "fused.cu, attention.cu (64/3, 128/4) through NVRTC"


def tiny_eager_step() -> str:
    """A tiny random Llama's prefill on the GPU (eager) against the CPU backend's logits."""
    import numpy as np

    from ringserve.gpu.batch import Batch
    from ringserve.gpu.cpu.runner import CpuModelRunner
    from ringserve.gpu.cuda.runner import CudaModelRunner
    from ringserve.tools.tiny_llama import make_tiny_llama
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_llama(tmp, hidden=192, heads=3, kv_heads=1, ffn=256)
        n = 9
        batch = Batch(np.arange(1, n + 1, dtype=np.int32), np.arange(n, dtype=np.int32),
                      np.arange(n, dtype=np.int32), np.array([0, n], np.int32),
                      np.array([n], np.int32), np.zeros((1, 1), np.int32))
        want = CpuModelRunner(path, DeviceConfig(device="cpu"),
                              CacheConfig(num_gpu_blocks_override=4)).execute(batch)
        runner = CudaModelRunner.from_dir(path, DeviceConfig(device="cuda", enforce_eager=True),
                                          CacheConfig(num_gpu_blocks_override=4),
                                          StepLimits(max_num_seqs=1, max_model_len=64,
                                                     max_num_batched_tokens=CUDA_MAX_NUM_BATCHED_TOKENS))
        got = runner.execute(batch)
    err = float(np.abs(got - want).max() / max(1e-6, float(np.abs(want).max())))
    if not np.isfinite(got).all() or err > 3e-2 or got.argmax() != want.argmax():
        raise AssertionError(f"logits differ from the CPU backend's: max rel err {err:.3g}")
    return f"max rel err vs CPU {err:.2e}"


def captured_gemm() -> str:
    """One CublasGemm captured into a graph (allocation refused), replayed on new inputs."""
    import cupy as cp
    import numpy as np
    from nvmath.bindings import cublas

    from ringserve.gpu.cuda import capture
    from ringserve.gpu.cuda.gemm import WORKSPACE_BYTES, CublasGemm
    stream = cp.cuda.Stream(non_blocking=True)
    host = np.random.default_rng(0)
    with stream:  # NOTE: made and filled on the stream that reads them
        ws = cp.empty(WORKSPACE_BYTES, cp.uint8)
        gemm = CublasGemm(cublas, stream.ptr, ws.data.ptr, WORKSPACE_BYTES, lambda a: a.data.ptr)
        x = cp.asarray(host.standard_normal((7, 256)).astype(np.float16))
        w = cp.asarray(host.standard_normal((96, 256)).astype(np.float16) * 0.1)
        out = cp.zeros((7, 96), cp.float16)
        gemm(x, w, out)  # eager first: cuBLAS picks its kernel outside the capture
        stream.synchronize()
        graph = capture.capture(stream, lambda: gemm(x, w, out),
                                lambda: cp.cuda.using_allocator(capture.refuse_allocation))
    x_host = host.standard_normal((7, 256)).astype(np.float16)
    x.set(x_host, stream=stream)  # the replay reads whatever x holds now
    graph.launch(stream)
    stream.synchronize()
    want = x_host.astype(np.float32) @ w.get().astype(np.float32).T
    err = float(np.abs(out.get().astype(np.float32) - want).max())
    gemm.close()
    if err > 0.05:
        raise AssertionError(f"replayed GEMM differs from numpy by {err:.3g}")
    return f"max abs err {err:.2e}"


def run(results: list[dict], has_device: bool) -> bool:
    """Every check (the device ones only with a device); True when every required one passed."""
    ok = imports(results)
    if not has_device:
        return ok
    for name, fn in (("compile .cu (NVRTC)", compile_kernels), ("tiny model eager step", tiny_eager_step),
                     ("captured cuBLAS GEMM replay", captured_gemm)):
        ok = check(results, name, fn) and ok
    return ok


if __name__ == "__main__":
    sys.exit(0 if run([], has_device=True) else 1)
