"""Which kernel each of the CUDA runner's ops launches, and with what geometry: pure Python over
arrays' shapes and dtypes (CuPy's, numpy's, or gpu/cuda/census.py's shape-only ones), so that
CudaOps (gpu/cuda/runner.py, fused.py, attention.py), the host-compiled forward
(tests/test_cuda_forward_host.py HostOps) and the launch census (tools/step_census.py) take
their launches from one place. A Launch names the kernel as launched: a CUDA C kernel's
extern "C" name (its _bf16 instantiation for bf16 activations), "numba <kernel>" or "cublas
gemm_ex" (cuBLAS picks its own grid: () here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringserve.gpu.cuda import launch, plan
from ringserve.gpu.cuda import quant_linear as ql
from ringserve.gpu.cuda.launch import Dims

NUMBA_THREADS = 128  # threads per block of the Numba kernels in the forward
GEMM = "cublas gemm_ex"


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: Dims
    block: Dims

    @property
    def geometry(self) -> tuple[Dims, Dims]:
        return self.grid, self.block


def _fused(name: str, x: Any) -> str:
    """fused.cu's / attention.cu's kernel of x's element type."""
    return name + launch.SUFFIXES[str(x.dtype)]


def numba_rows(name: str, rows: int) -> Launch:
    """numba_kernels.py's row kernels (embedding, gather_rows): one block per row."""
    return Launch(f"numba {name}", (rows,), (NUMBA_THREADS,))


def gemm() -> Launch:
    return Launch(GEMM, (), ())


def quant_linear(kind: str, x: Any, out_features: int) -> list[Launch]:
    """QuantLinear's launches for x @ W.T with W's planes of `kind` (quant_linear's crossover
    table): one mat-vec launch a tile of 16 rows, or the tiled GEMM, or dequantize + cuBLAS
    (the dequantize launches per workspace chunk, each with its GEMM: one pair listed)."""
    rows, dtype = x.shape[0], str(x.dtype)
    impl = ql.impl_for(rows)
    if impl == "matvec":
        return [Launch(*_flat(ql.matvec_kernel(kind, min(16, rows - lo), out_features, dtype)))
                for lo in range(0, rows, 16)]
    if impl == "tiled":
        return [Launch(*_flat(ql.tiled_kernel(kind, rows, out_features, dtype)))]
    return [Launch(f"dequant_{kind}_f16", (), ()), gemm()]


def quant_embedding(kind: str, num_rows: int, hidden: int, out: Any) -> Launch:
    """QuantLinear.embedding: dequant_<kind>_<out's type> of the ids' rows."""
    return Launch(f"dequant_{kind}_{ql.DEQUANT_SUFFIXES[str(out.dtype)]}",
                  *launch.dequant_launch(num_rows, hidden // ql.WEIGHTS_PER_CHUNK[kind]))


def _flat(kernel: tuple[str, tuple]) -> tuple:
    name, (grid, block) = kernel
    return name, grid, block


def add_rms_norm(h: Any, out: Any) -> Launch:
    return Launch(_fused("add_rms_norm", out), *launch.norm_launch(*h.shape))


def qk_norm(qkv: Any, num_qk_heads: int) -> Launch:
    return Launch(_fused("qk_norm", qkv), *launch.qk_norm_launch(qkv.shape[0], num_qk_heads))


def rope_store_kv(qkv: Any, num_heads: int, num_kv_heads: int, head_dim: int, rot_half: int) -> Launch:
    return Launch(_fused("rope_store_kv", qkv),
                  *launch.rope_store_kv_launch(qkv.shape[0], num_heads, num_kv_heads, head_dim, rot_half))


def silu_mul(out: Any) -> Launch:
    return Launch(_fused("silu_mul", out), *launch.silu_launch(*out.shape))


def gelu_tanh_mul(out: Any) -> Launch:
    """Gemma 3's MLP activation: silu_mul's geometry."""
    return Launch(_fused("gelu_tanh_mul", out), *launch.silu_launch(*out.shape))


def rms_norm(x: Any) -> Launch:
    """In-place RMSNorm (Gemma 3's post-attention and post-MLP norms): add_rms_norm's geometry."""
    return Launch(_fused("rms_norm", x), *launch.norm_launch(*x.shape))


def scale_embedding() -> Launch:
    """Gemma 3's embedding scale: one CuPy elementwise multiply (CuPy picks its grid: () here)."""
    return Launch("cupy multiply", (), ())


def add_bias(x: Any) -> Launch:
    return Launch(_fused("add_bias", x), *launch.elementwise_launch(x.shape[0] * x.shape[1]))


def to_float32(src: Any) -> Launch:
    return Launch(_fused("to_float32", src), *launch.elementwise_launch(src.shape[0] * src.shape[1]))


def attention(backend: str, qkv: Any, num_heads: int, num_kv_heads: int, head_dim: int,
              splits: int, rope: bool = False) -> Launch:
    """attention.cu's paged_attention (its splits combined in the same launch), or the Numba
    kernel (one block per (token, head), no split). rope: a decode-only step's
    paged_attention_rope (RoPE and the K/V write in the same launch: no rope_store_kv)."""
    T = qkv.shape[0]
    if backend != "rawkernel":
        return Launch("numba paged_attention_kernel", (T, num_heads), (NUMBA_THREADS,))
    name = "paged_attention_rope" if rope else "paged_attention"
    return Launch(_fused(name, qkv), *launch.attention_launch(T, num_kv_heads, splits))


def fuses_rope(backend: str, decode_only: bool) -> bool:
    """Whether attention's launch does RoPE and the K/V write (else rope_store_kv first): the
    RawKernel on a step of one token per request (its own key is its request's last)."""
    return backend == "rawkernel" and decode_only


def graph_splits(*, tokens: int, num_kv_heads: int, max_model_len: int, num_sms: int) -> int:
    """The split count a graph of `tokens` query tokens is captured with (a decode graph's
    requests, a verify graph's n x (1 + K); CudaModelRunner.capture_graphs: planned for
    max_model_len, whatever the requests' lengths)."""
    return plan.attention_splits(num_tokens=tokens, num_kv_heads=num_kv_heads, max_seq_len=max_model_len,
                                 num_sms=num_sms)


def graph_window_splits(*, tokens: int, num_kv_heads: int, max_model_len: int, num_sms: int,
                        windows) -> dict[int, int]:
    """The sliding windows' split counts of that graph (plan.window_splits)."""
    return plan.window_splits(windows, num_tokens=tokens, num_kv_heads=num_kv_heads,
                              max_seq_len=max_model_len, num_sms=num_sms)
