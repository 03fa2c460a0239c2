"""Paged attention on the CPU: a Numba kernel over the whole super-sequence.

Each query token of request r at position p attends to keys 0..p of r, read through r's
block table (key j lives at block_tables[r, j // block_size], row j % block_size), so
attention is causal within a request and blind across requests. One compiled loop for the
whole step instead of a dozen numpy calls per request and layer, which dominated decode
steps with many requests. Softmax in float32 with the max subtracted.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringserve.gpu.cpu.kernels import fast_exp
from ringserve.gpu.cpu.kv_dtypes import kv_load

# Reassociation lets LLVM vectorize the dot products; no 'nnan'/'ninf', so -inf stays -inf.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, fastmath=_FASTMATH, nogil=True, error_model="numpy")
def paged_attention(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,  # noqa: C901
                    scale, out):  # pragma: no cover - compiled
    """q [T, H, D], k/v_cache [num_blocks, block_size, KVH, D] in their storage type
    (gpu/cpu/kv_dtypes.py) -> out [T, H, D] (written)."""
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
