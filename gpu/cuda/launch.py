"""Launch geometry of the CUDA C kernels (fused.cu, attention.cu, quant.cu), pure Python so that the CuPy
launchers and the host-compiled kernel tests (tests/test_cuda_host.py) use the same numbers.

Each function returns (grid, block) as CUDA dim tuples, or the scalar a launch passes.
"""
from __future__ import annotations

from ringserve.gpu.settings import ATTENTION_BACKENDS

Dims = tuple[int, ...]
# fused.cu's and attention.cu's kernels are instantiated per element type: fp16 under their plain
# names, bf16 (its bits in uint16 arrays, gpu/cuda/dtypes.py) with this suffix; by the
# activations' dtype name (str(array.dtype), numpy's or CuPy's)
SUFFIXES = {"float16": "", "uint16": "_bf16"}
# fused.cu's kernels
FUSED_KERNELS = ("add_rms_norm", "qk_norm", "rope_store_kv", "silu_mul", "add_bias", "to_float32",
                 "gelu_tanh_mul", "rms_norm")

ATTENTION_THREADS = 128  # attention.cu: WARPS (4) * 32, one block per (token, KV head, split)
ATTENTION_HEAD_DIMS = (64, 128, 192, 256)  # attention.cu: 32 lanes x an even number of dims each


def attention_backend_for(requested: str, head_dim: int) -> str:
    """The paged-attention kernel a model gets: "auto" is the RawKernel where attention.cu
    compiles for the head size, else the Numba kernel (any head_dim up to 256)."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend {requested!r}: {', '.join(ATTENTION_BACKENDS)}")
    if requested == "auto":
        return "rawkernel" if head_dim in ATTENTION_HEAD_DIMS else "numba"
    if requested == "rawkernel" and head_dim not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"attention_backend rawkernel: attention.cu handles head_dim "
                         f"{', '.join(map(str, ATTENTION_HEAD_DIMS))}, not {head_dim}; "
                         f"use --attention-backend numba")
    return requested


def norm_launch(num_tokens: int, hidden: int) -> tuple[Dims, Dims]:
    """add_rms_norm, rms_norm: one block per token, ~4 elements per thread, whole warps (block_sum
    shuffles over full warps), at most 1024 threads (its __launch_bounds__)."""
    threads = min(1024, max(32, -(-hidden // 4 // 32) * 32))
    return (num_tokens,), (threads,)


def qk_norm_launch(num_tokens: int, num_qk_heads: int) -> tuple[Dims, Dims]:
    """qk_norm: one warp per (token, q or k head)."""
    return (num_tokens, num_qk_heads), (32,)


def rope_store_kv_launch(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         rot_half: int) -> tuple[Dims, Dims]:
    """rope_store_kv: one block per token, one thread per q (head, rotary pair) and per k/v
    element (the larger of the two loops), whole warps, up to 256."""
    work = max(num_heads * rot_half, num_kv_heads * head_dim)
    return (num_tokens,), (min(256, max(32, -(-work // 32) * 32)),)


def silu_launch(num_tokens: int, inter: int) -> tuple[Dims, Dims]:
    """silu_mul, gelu_tanh_mul: grid-stride over the T * I / 2 half2 pairs, 256 threads, grid.x <= 65535."""
    n = num_tokens * inter // 2
    return (max(1, min(65535, -(-n // 256))),), (256,)


def elementwise_launch(count: int) -> tuple[Dims, Dims]:
    """add_bias, to_float32: grid-stride over count elements, 256 threads, grid.x <= 65535."""
    return (max(1, min(65535, -(-count // 256))),), (256,)


def attention_launch(num_tokens: int, num_kv_heads: int, splits: int) -> tuple[Dims, Dims]:
    """paged_attention: grid (T, KVH, splits)."""
    return (num_tokens, num_kv_heads, splits), (ATTENTION_THREADS,)


QUANT_THREADS = 128      # quant.cu matvec_*: MV_WARPS (4) * 32
MATVEC_ROWS = (1, 2, 4, 8, 16)  # quant.cu's matvec_*_r<R> variants: decode batches up to 16 rows
DEQUANT_THREADS = 256    # quant.cu dequant_*: its __launch_bounds__
GEMM_THREADS = 128       # quant.cu gemm_*: GEMM_WARPS (4) * 32, its __launch_bounds__ (m128: twice)
GEMM_TILE = 64           # quant.cu GEMM_TILE: output features (and rows of x; m128: twice) a block computes


def matvec_variant(num_rows: int) -> int:
    """The smallest matvec_*_r<R> that takes num_rows rows of x (1 <= num_rows <= 16)."""
    return next(r for r in MATVEC_ROWS if r >= num_rows)


def matvec_rows_per_warp(kind: str, variant: int) -> int:
    """Output features a warp of matvec_<kind>_r<variant> computes (quant.cu MvRows): 2 at one
    row of x, except u6 (3 loads a unit), else 1 (its accumulators and fetch buffers within 128
    registers)."""
    return 2 if variant == 1 and kind != "u6" else 1


def matvec_launch(out_features: int, kind: str, variant: int) -> tuple[Dims, Dims]:
    """matvec_<kind>_r<variant>: 4 warps a block, matvec_rows_per_warp output features each."""
    per_block = QUANT_THREADS // 32 * matvec_rows_per_warp(kind, variant)
    return (-(-out_features // per_block),), (QUANT_THREADS,)


def dequant_launch(num_rows: int, chunks_per_row: int) -> tuple[Dims, Dims]:
    """dequant_*: grid-stride over the rows' 16-byte quant chunks, 256 threads, grid.x <= 65535."""
    n = num_rows * chunks_per_row
    return (max(1, min(65535, -(-n // DEQUANT_THREADS))),), (DEQUANT_THREADS,)


def gemm_rows(num_rows: int) -> int:
    """Rows of x a block of the tiled GEMM takes: 64 (gemm_*) up to 64 rows, else 128 (gemm_*_m128:
    each weight tile dequantized and read once per 128 rows, not 64)."""
    return GEMM_TILE if num_rows <= GEMM_TILE else 2 * GEMM_TILE


def gemm_launch(num_rows: int, out_features: int) -> tuple[Dims, Dims]:
    """gemm_*: one block per gemm_rows x 64 tile of out; grid.x over the rows of x, so that the
    blocks that read one weight tile are neighbours (its second read hits L2); grid.y <= 65535."""
    tiles_n = -(-out_features // GEMM_TILE)
    if tiles_n > 65535:
        raise ValueError(f"gemm: {out_features} output features exceed grid.y's 65535 tiles of {GEMM_TILE}")
    rows = gemm_rows(num_rows)
    return (-(-num_rows // rows), tiles_n), (GEMM_THREADS * rows // GEMM_TILE,)
