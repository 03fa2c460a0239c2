"""The indexing-heavy kernels in Numba CUDA: embedding gather, row gather at the last positions,
greedy argmax, and paged attention (the readable reference of the RawKernel in attention.cu,
and the runner's kernel only for head sizes attention.cu does not compile for:
launch.attention_backend_for).

Written so that Numba's CUDA simulator can run them (CI has no GPU, docs/design.md §8): no warp
shuffles (reductions go through shared memory), every loop strided by blockDim so a block of
32 threads (the simulator) and of 128 (a device) compute the same thing. Math in float32;
arrays fp16 on a device (any float dtype works), or bf16 as its bits in uint16
(gpu/cuda/dtypes.py). numba-cuda 0.30 has a bfloat16 scalar type (numba.cuda.bf16) but no
bf16 arrays to hand it (CuPy and numpy have none) and the simulator lacks it (its bf16 module
is None); so the kernels that only move values (the row gather) move the uint16 bits
unchanged, which is exact, and the ones that compute (the embedding into the float32
residual, paged attention) convert with bf16_to_float32 / float32_to_bf16 below: plain
integer and ldexp/frexp arithmetic, which both a device and the simulator run. Their `bf16`
argument says whether the 16-bit arrays are bf16 bits (the launchers set it from the dtype);
both branches compile for either dtype, only one runs.

Each launcher takes `threads` (threads per block) and `stream` (a Numba stream; on a device,
numba.cuda.external_stream(cupy_stream.ptr) so the launch joins a CuPy stream and its graph).
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32, uint16

from ringserve.gpu.cuda.block_reduce import block_argmax

# Paged attention: one block per (token, head); each thread holds the outputs for up to
# MAX_DIMS_PER_THREAD of the head's dims, and the block scores ATTN_TILE keys at a time.
MAX_HEAD_DIM = 256
MAX_DIMS_PER_THREAD = 8
ATTN_TILE = 32  # keys per tile = the largest block size the launcher accepts (and the sim's)


@cuda.jit(device=True, inline=True)
def bf16_to_float32(bits):  # pragma: no cover - device code
    """bf16 bits (a uint16) -> its float32 value, exactly (normal, subnormal, inf, NaN)."""
    b = int(bits)
    e = (b >> 7) & 0xFF
    m = b & 0x7F
    if e == 0:
        v = math.ldexp(float32(m), -133)  # subnormal: m * 2^-133
    elif e == 0xFF:
        v = float32(math.inf) if m == 0 else float32(math.nan)
    else:
        v = math.ldexp(float32(m + 128), e - 134)  # (1 + m/128) * 2^(e - 127)
    return -v if b & 0x8000 else v


@cuda.jit(device=True, inline=True)
def round_half_even(y):  # pragma: no cover - device code
    """A float32 y >= 0 (below 2^31) to the nearest int32, ties to even, in float32 arithmetic
    (every step exact: y - floor(y) of a float32 is)."""
    n = int32(y)
    r = y - float32(n)
    if r > float32(0.5) or (r == float32(0.5) and n & 1):
        n += 1
    return n


@cuda.jit(device=True, inline=True)
def float32_to_bf16(x):  # pragma: no cover - device code
    """float32 -> bf16 bits (a uint16), rounded to nearest even (torch's and cuda_bf16.h's
    __float2bfloat16): 8 significant bits of |x| by frexp, the sign apart."""
    if x != x:
        return uint16(0x7FC0)
    sign = 0x8000 if math.copysign(float32(1.0), x) < 0 else 0  # -0.0 too
    a = -x if x < 0 else x
    if a == math.inf:
        return uint16(sign | 0x7F80)
    if a == 0:
        return uint16(sign)
    frac, e = math.frexp(a)  # a = frac * 2^e, frac in [0.5, 1)
    if e <= -126:  # below bf16's smallest normal 2^-126: subnormal steps of 2^-133
        return uint16(sign | round_half_even(math.ldexp(a, 133)))  # 128: the smallest normal
    q = round_half_even(math.ldexp(frac, 8))  # 128..256
    if q == 256:
        q = 128
        e += 1
    biased = e + 126  # a = (q / 128) * 2^(e - 1)
    if biased >= 0xFF:
        return uint16(sign | 0x7F80)
    return uint16(sign | (biased << 7) | (q - 128))


@cuda.jit
def gather_rows_kernel(x, indices, out, widen_bf16):  # pragma: no cover - device code
    """out[b, :] = x[indices[b], :]; grid (B,). widen_bf16: x holds bf16 bits and out is float
    (the embedding into the residual stream); else values move as they are (bf16 bits too)."""
    b = cuda.blockIdx.x
    src = indices[b]
    for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        if widen_bf16:
            out[b, d] = bf16_to_float32(x[src, d])
        else:
            out[b, d] = x[src, d]


@cuda.jit
def argmax_kernel(logits, out):  # pragma: no cover - device code
    """out[b] = first index of the max of logits[b]; grid (B,), blockDim a power of two ≤ 128."""
    best_v = cuda.shared.array(128, float32)
    best_i = cuda.shared.array(128, int32)
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    v = float32(-math.inf)
    idx = int32(0x7FFFFFFF)
    for j in range(tid, logits.shape[1], cuda.blockDim.x):
        x = float32(logits[b, j])
        if x > v:  # strided ascending j: the first max of this thread wins ties
            v = x
            idx = j
    _, first = block_argmax(v, idx, best_v, best_i)
    if tid == 0:
        out[b] = first


@cuda.jit(device=True, inline=True)
def request_of(query_start_loc, t):  # pragma: no cover - device code
    """The request owning token t: the last r with query_start_loc[r] <= t (binary search)."""
    lo = 0
    hi = query_start_loc.shape[0] - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if query_start_loc[mid] <= t:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda.jit(device=True, inline=True)
def load(a, bf16):  # pragma: no cover - device code
    """An element of a 16-bit array as float32 (bf16: a's uint16 bits)."""
    return bf16_to_float32(a) if bf16 else float32(a)


@cuda.jit
def paged_attention_kernel(qkv, k_cache, v_cache, positions, query_start_loc, seq_lens,  # noqa: C901
                           block_tables, scale, window, out, bf16):  # pragma: no cover - device code
    """out [T, H*D]: token t, head h attends causally to its request's keys through the block
    table (window > 0: only keys p - window < k <= p, no table entry before them read).
    grid (T, H). Tiles of ATTN_TILE keys: each thread scores one key of the tile into shared
    memory, then every thread folds the tile into its dims' accumulators (online softmax). Two
    barriers per tile, none per key. bf16: qkv, the caches and out hold bf16 bits (uint16)."""
    q_sh = cuda.shared.array(MAX_HEAD_DIM, float32)
    s_sh = cuda.shared.array(ATTN_TILE, float32)
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    block_size, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_heads = out.shape[1] // d
    kv = h // (num_heads // kvh)
    r = request_of(query_start_loc, t)
    n = min(positions[t] + 1, seq_lens[r])
    first = max(0, positions[t] + 1 - window) if window > 0 else 0  # the window's first key
    for i in range(tid, d, nt):
        q_sh[i] = load(qkv[t, h * d + i], bf16) * scale
    acc = cuda.local.array(MAX_DIMS_PER_THREAD, float32)
    for i in range(MAX_DIMS_PER_THREAD):
        acc[i] = float32(0.0)
    m = float32(-math.inf)
    total = float32(0.0)
    cuda.syncthreads()
    for start in range(first, n, ATTN_TILE):
        tile = min(ATTN_TILE, n - start)
        for jj in range(tid, tile, nt):
            j = start + jj
            blk = block_tables[r, j // block_size]
            row = j % block_size
            s = float32(0.0)
            for i in range(d):
                s += q_sh[i] * load(k_cache[blk, row, kv, i], bf16)
            s_sh[jj] = s
        cuda.syncthreads()
        m_new = m
        for jj in range(tile):
            m_new = max(m_new, s_sh[jj])
        corr = math.exp(m - m_new)
        total *= corr
        for c in range(MAX_DIMS_PER_THREAD):
            acc[c] *= corr
        for jj in range(tile):
            j = start + jj
            blk = block_tables[r, j // block_size]
            row = j % block_size
            p = math.exp(s_sh[jj] - m_new)
            total += p
            c = 0
            for i in range(tid, d, nt):
                acc[c] += p * load(v_cache[blk, row, kv, i], bf16)
                c += 1
        m = m_new
        cuda.syncthreads()
    inv = float32(1.0) / total if total > 0 else float32(0.0)
    c = 0
    for i in range(tid, d, nt):
        if bf16:
            out[t, h * d + i] = float32_to_bf16(acc[c] * inv)
        else:
            out[t, h * d + i] = acc[c] * inv
        c += 1


# Launchers: one place that knows each kernel's grid.

def _is_bf16(a) -> bool:
    """A 16-bit activation array that holds bf16 bits (gpu/cuda/dtypes.py: uint16)."""
    return str(a.dtype) == "uint16"


def embedding(ids, table, out, *, threads=128, stream=0):
    """out[t, :] = table[ids[t], :]: a row gather of the embedding table into out's dtype (a
    bf16 table widened exactly)."""
    if ids.shape[0]:
        gather_rows_kernel[ids.shape[0], threads, stream](table, ids, out,
                                                          _is_bf16(table) and not _is_bf16(out))


def gather_rows(x, indices, out, *, threads=128, stream=0):
    if indices.shape[0]:
        gather_rows_kernel[indices.shape[0], threads, stream](x, indices, out, False)


def argmax(logits, out, *, threads=128, stream=0):
    if threads & (threads - 1) or threads > 128:
        raise ValueError(f"argmax: threads {threads} must be a power of two <= 128")
    if logits.shape[0]:
        argmax_kernel[logits.shape[0], threads, stream](logits, out)


def paged_attention(qkv, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
                    scale, out, *, window=0, threads=128, stream=0):
    head_dim = k_cache.shape[3]
    if head_dim > MAX_HEAD_DIM or head_dim > MAX_DIMS_PER_THREAD * threads:
        raise ValueError(f"paged_attention: head_dim {head_dim} needs at most {MAX_HEAD_DIM} "
                         f"and {MAX_DIMS_PER_THREAD} dims per thread ({threads} threads)")
    num_heads = out.shape[1] // head_dim
    if qkv.shape[0]:
        paged_attention_kernel[(qkv.shape[0], num_heads), threads, stream](
            qkv, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
            float32(scale), int32(window), out, _is_bf16(out))
