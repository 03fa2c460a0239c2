"""Paged attention on the CPU: a Numba kernel over the whole super-sequence, and BLAS for
long prefill chunks.

Each query token of request r at position p attends to keys 0..p of r, read through r's
block table (key j lives at block_tables[r, j // block_size], row j % block_size), so
attention is causal within a request and blind across requests. Softmax in float32 with the
max subtracted.

- `paged_attention` (Numba): one compiled loop for the whole step instead of a dozen numpy
  calls per request and layer, which dominated decode steps with many requests. It reads
  every key once per query token, at ~20-30 GFLOP/s on one thread.
- `blas_attention`: a request with many query tokens over a long context (a prefill chunk of
  a long prompt: 512 queries x 8,000 keys is 0.9 GFLOP a layer and KV head) gathers its keys
  and values once into contiguous float32 and runs scores and the weighted sum as two GEMMs
  (numpy's BLAS, on the step's threads): ~90 GFLOP/s on the 2-core VM, where the Numba loop
  took a long prompt's prefill to 0.6x llama.cpp's speed (docs/bench_forward.md).
`attention` sends each request to one of them.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringserve.gpu.cpu_kernels import fast_exp
from ringserve.gpu.cpu_kv_dtypes import kv_load

# Reassociation lets LLVM vectorize the dot products; no 'nnan'/'ninf', so -inf stays -inf.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, fastmath=_FASTMATH, nogil=True, error_model="numpy")
def paged_attention(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,  # noqa: C901
                    scale, out, skip):  # pragma: no cover - compiled
    """q [T, H, D], k/v_cache [num_blocks, block_size, KVH, D] in their storage type
    (gpu/cpu_kv_dtypes.py) -> out [T, H, D] (written), except the rows of requests r with
    skip[r] (blas_attention's)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads  # query heads per KV head (GQA)
    num_reqs = seq_lens.shape[0]
    max_len = 1
    for r in range(num_reqs):
        max_len = max(max_len, seq_lens[r])
    scores = np.empty((group, max_len), dtype=np.float32)
    acc = np.empty((group, head_dim), dtype=np.float32)
    for r in range(num_reqs):
        if skip[r]:
            continue
        for t in range(query_start_loc[r], query_start_loc[r + 1]):
            num_keys = min(positions[t] + 1, seq_lens[r])
            for kvh in range(num_kv_heads):
                h0 = kvh * group
                for j0 in range(0, num_keys, block_size):  # block by block: no division per key
                    block = block_tables[r, j0 // block_size]
                    for row in range(min(block_size, num_keys - j0)):
                        for g in range(group):
                            s = np.float32(0.0)
                            for d in range(head_dim):
                                s += q[t, h0 + g, d] * kv_load(k_cache[block, row, kvh, d])
                            scores[g, j0 + row] = s * scale
                for g in range(group):
                    m = scores[g, 0]
                    for j in range(1, num_keys):
                        m = max(m, scores[g, j])
                    total = np.float32(0.0)
                    for j in range(num_keys):
                        e = fast_exp(scores[g, j] - m)
                        scores[g, j] = e
                        total += e
                    inv = np.float32(1.0) / total
                    for j in range(num_keys):
                        scores[g, j] *= inv
                acc[:, :] = 0.0
                for j0 in range(0, num_keys, block_size):
                    block = block_tables[r, j0 // block_size]
                    for row in range(min(block_size, num_keys - j0)):
                        for g in range(group):
                            w = scores[g, j0 + row]
                            for d in range(head_dim):
                                acc[g, d] += w * kv_load(v_cache[block, row, kvh, d])
                for g in range(group):
                    for d in range(head_dim):
                        out[t, h0 + g, d] = acc[g, d]


# A request takes the BLAS path when it has at least this many query tokens in the step and
# query tokens x keys reach BLAS_MIN_PAIRS: below, the Numba loop's one call beats BLAS's ~10
# numpy calls per KV head (measured: 128 x 128 Numba 0.6 ms vs 1.0; 512 x 512 9.7 vs 7.4 ms).
BLAS_MIN_QUERIES = 32
BLAS_MIN_PAIRS = 128 * 1024
# floats a score matrix holds (32 MB): up to 256 query tokens a tile, fewer at long contexts
SCORES_BUDGET = 8 << 20


@njit(cache=True, nogil=True)
def gather_kv(cache, table_row, num_keys, kv_head, out):  # pragma: no cover - compiled
    """out [num_keys, D] float32 = KV head kv_head of the request's first num_keys cached rows."""
    block_size, head_dim = cache.shape[1], cache.shape[3]
    for j in range(num_keys):
        block, row = table_row[j // block_size], j % block_size
        for d in range(head_dim):
            out[j, d] = kv_load(cache[block, row, kv_head, d])


def blas_attention(q, k_cache, v_cache, positions, t0: int, t1: int, seq_len: int, table_row, scale,
                   out) -> None:
    """paged_attention's result for one request's query tokens t0..t1-1 (paged_attention's
    arguments, the request's own seq_len and block-table row), by two GEMMs per KV head and
    tile of query tokens. NOTE: one KV head's keys and values at a time: at a 128k context an
    8B shape's are 64 MB each, all heads' would be 1 GB."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    sees = np.minimum(positions[t0:t1] + 1, seq_len)  # keys each query token sees
    num_keys = int(sees.max())
    tile = max(1, min(256, SCORES_BUDGET // (group * num_keys)))
    keys = np.empty((num_keys, head_dim), np.float32)
    values = np.empty_like(keys)
    for kvh in range(num_kv_heads):
        gather_kv(k_cache, table_row, num_keys, kvh, keys)
        gather_kv(v_cache, table_row, num_keys, kvh, values)
        heads = slice(kvh * group, (kvh + 1) * group)
        for a in range(t0, t1, tile):
            b = min(t1, a + tile)
            lane_sees = np.repeat(sees[a - t0:b - t0], group)  # lane = query * group + g, as q's heads
            n = int(lane_sees.max())
            lanes = q[a:b, heads, :].reshape(-1, head_dim) * scale
            scores = lanes @ keys[:n].T
            total = np.empty(len(lanes), np.float32)
            causal_softmax(scores, lane_sees, total)  # PERF: one pass, not numpy's four (and the mask)
            mixed = scores @ values[:n]
            mixed /= total[:, None]
            out[a:b, heads, :] = mixed.reshape(b - a, group, head_dim)


@njit(cache=True, fastmath=_FASTMATH, nogil=True, error_model="numpy")
def causal_softmax(scores, sees, total):  # pragma: no cover - compiled
    """Row i of scores [lanes, keys]: exp(s - max) over its first sees[i] keys, 0 past them
    (the keys after its query's position), its sum into total[i] (the weights stay unnormalized:
    the GEMM after this divides its 64 columns instead of these thousands)."""
    for i in range(scores.shape[0]):
        row, n = scores[i], sees[i]
        m = row[0]
        for j in range(1, n):
            m = max(m, row[j])
        t = np.float32(0.0)
        for j in range(n):
            e = fast_exp(row[j] - m)
            row[j] = e
            t += e
        for j in range(n, row.shape[0]):
            row[j] = 0.0
        total[i] = t


def attention(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables, scale, out) -> None:
    """Every request's attention (paged_attention's contract): long prefill chunks by
    blas_attention, the rest in one paged_attention call."""
    queries = np.diff(query_start_loc)
    keys = seq_lens  # the most keys a request's query tokens see
    skip = (queries >= BLAS_MIN_QUERIES) & (queries * keys >= BLAS_MIN_PAIRS)
    if not skip.all():
        paged_attention(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables, scale, out,
                        skip)
    for r in np.flatnonzero(skip):
        blas_attention(q, k_cache, v_cache, positions, int(query_start_loc[r]), int(query_start_loc[r + 1]),
                       int(seq_lens[r]), block_tables[r], scale, out)
