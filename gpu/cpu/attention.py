"""Paged attention on the CPU: a Numba kernel over the whole super-sequence.

Each query token of request r at position p attends to keys 0..p of r (a sliding window w:
keys p - w < k <= p), read through r's block table (key j lives at block_tables[r, j //
block_size], row j % block_size), so attention is causal within a request and blind across
requests. A window reads no block wholly before it: engine/kv_cache.py frees those (their table
entries then name a placeholder block), and the cost per token is O(w), not O(p). One compiled loop for the
whole step instead of a dozen numpy calls per request and layer, which dominated decode
steps with many requests. Softmax in float32 with the max subtracted.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringserve.gpu.cpu.kernels import FASTMATH, fast_exp
from ringserve.gpu.cpu.kv_dtypes import kv_load


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def paged_attention(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,  # noqa: C901
                    scale, window, out, max_tokens=2**62):  # pragma: no cover - compiled
    """q [T, H, D], k/v_cache [num_blocks, block_size, KVH, D] in their storage type
    (gpu/cpu/kv_dtypes.py) -> out [T, H, D] (written). window 0: full causal attention. A
    request with more than max_tokens query tokens is left alone (gpu/cpu/prefill_attention.py
    takes those)."""
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
        if query_start_loc[r + 1] - query_start_loc[r] > max_tokens:
            continue
        for t in range(query_start_loc[r], query_start_loc[r + 1]):
            num_keys = min(positions[t] + 1, seq_lens[r])
            first = 0 if window <= 0 else max(0, positions[t] + 1 - window)  # the window's first key
            n = num_keys - first
            if n <= 0:
                out[t, :, :] = 0.0
                continue
            start = first - first % block_size  # NOTE: from the window's first block, never before it
            for kvh in range(num_kv_heads):
                h0 = kvh * group
                for j0 in range(start, num_keys, block_size):  # block by block: no division per key
                    block = block_tables[r, j0 // block_size]
                    for row in range(max(0, first - j0), min(block_size, num_keys - j0)):
                        for g in range(group):
                            s = np.float32(0.0)
                            for d in range(head_dim):
                                s += q[t, h0 + g, d] * kv_load(k_cache[block, row, kvh, d])
                            scores[g, j0 + row - first] = s * scale
                for g in range(group):
                    m = scores[g, 0]
                    for j in range(1, n):
                        m = max(m, scores[g, j])
                    total = np.float32(0.0)
                    for j in range(n):
                        e = fast_exp(scores[g, j] - m)
                        scores[g, j] = e
                        total += e
                    inv = np.float32(1.0) / total
                    for j in range(n):
                        scores[g, j] *= inv
                acc[:, :] = 0.0
                for j0 in range(start, num_keys, block_size):
                    block = block_tables[r, j0 // block_size]
                    for row in range(max(0, first - j0), min(block_size, num_keys - j0)):
                        for g in range(group):
                            w = scores[g, j0 + row - first]
                            for d in range(head_dim):
                                acc[g, d] += w * kv_load(v_cache[block, row, kvh, d])
                for g in range(group):
                    for d in range(head_dim):
                        out[t, h0 + g, d] = acc[g, d]
