"""Paged attention on the CPU: a Numba kernel over the whole super-sequence.

Each query token of request r at position p attends to keys 0..p of r (a sliding window w:
keys p - w < k <= p), read through r's block table (key j lives at block_tables[r, j //
block_size], row j % block_size), so attention is causal within a request and blind across
requests. A window reads no block wholly before it: engine/kv_cache.py frees those (their table
entries then name a placeholder block), and the cost per token is O(w), not O(p). One compiled loop for the
whole step instead of a dozen numpy calls per request and layer, which dominated decode
steps with many requests. Softmax in float32 with the max subtracted. For the head sizes of
gpu/cpu/fma_tiles.py's decode micro-kernels (head_dim / 16 in 1, 2, 4, 5, 6, 8, 16) a (token, KV
head) pair takes 16 keys at a time: widened from the cache by vector (vcvtph2ps for float16; the
next 16 rows prefetched), scored for each query head with one transpose-sum, and added into an
accumulator held in registers; other head sizes take the scalar loop.

Two drivers of the same per-(token, KV head) body: `paged_attention`, the readable one-thread
reference (tests, the CUDA reference), and `paged_attention_parallel`, which CpuOps runs for
every step: its (token, KV head) pairs over Numba's threads for a step whose tokens read many keys
(4,000 keys x 8 KV heads are ~3 ms a layer on one thread), on one thread otherwise. NOTE: one
driver in the engine, because the two drivers' copies of `_attend` are optimized apart (LLVM
inlines it into each, and a driver loaded from Numba's cache was compiled in another process):
they agree within float32 rounding, not bit for bit, and a token's result must not depend on the
batch it ran in.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ringserve.gpu.cpu.fma_tiles import KEY_ROWS, head_update, key_scores, widen_rows
from ringserve.gpu.cpu.kernels import FASTMATH, fast_exp
from ringserve.gpu.cpu.kv_dtypes import kv_load
from ringserve.gpu.cpu.tasks import claim

# A step whose per-token loop reads at least this many (key, token) pairs takes the parallel driver
# (~20 ns a pair and KV head on one thread; a TBB fork and join is ~10-20 us): one decode at 256
# keys of the 1B shape, 0.09 -> 0.05 ms a layer (docs/bench_forward.md)
PARALLEL_KEY_READS = 256


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _head_rows(vectors):  # pragma: no cover - compiled
    """Query heads a head_update step keeps in registers: 16 accumulators at most."""
    return 1 if vectors == 16 else (2 if vectors >= 5 else 4)


@njit(cache=True, nogil=True, error_model="numpy")
def attention_scratch(group, max_len, head_dim):  # pragma: no cover - compiled
    """One thread's scratch for _attend over at most max_len keys: scores [heads, keys] and the
    accumulator [heads, head_dim] (heads padded to whole head_update steps, keys to whole
    KEY_ROWS), rows [2 KEY_ROWS + heads, head_dim]: widened keys, widened values, the scaled
    queries; and the byte offsets of the KEY_ROWS cache rows being widened and of those prefetched."""
    heads = -(-group // 4) * 4  # NOTE: a multiple of every _head_rows
    keys = -(-max(max_len, 1) // KEY_ROWS) * KEY_ROWS
    return (np.zeros((heads, keys), np.float32), np.zeros((heads, head_dim), np.float32),
            np.zeros((2 * KEY_ROWS + heads, head_dim), np.float32), np.zeros(2 * KEY_ROWS, np.int64))


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _widen_step(cache, block_table, kvh, j0, num_keys, rows, d0, offsets, ahead, ahead_j0):  # noqa: C901 - a literal kernel a head size  # pragma: no cover - compiled
    """rows[d0 + i] = key (or value) j0 + i as float32 for i < KEY_ROWS (past num_keys the last
    key again: finite, and its probability is 0), and rows ahead_j0.. of the cache `ahead`
    prefetched (the step after this one)."""
    block_size, vectors = cache.shape[1], cache.shape[3] // 16
    s0, s1, s2 = cache.strides[0], cache.strides[1], cache.strides[2]
    for i in range(KEY_ROWS):
        j = min(j0 + i, num_keys - 1)
        offsets[i] = block_table[j // block_size] * s0 + (j % block_size) * s1 + kvh * s2
        j = min(ahead_j0 + i, num_keys - 1)
        offsets[KEY_ROWS + i] = block_table[j // block_size] * s0 + (j % block_size) * s1 + kvh * s2
    if vectors == 4:
        widen_rows(cache, ahead, offsets, rows, d0, 4)
    elif vectors == 8:
        widen_rows(cache, ahead, offsets, rows, d0, 8)
    elif vectors == 2:
        widen_rows(cache, ahead, offsets, rows, d0, 2)
    elif vectors == 16:
        widen_rows(cache, ahead, offsets, rows, d0, 16)
    elif vectors == 6:
        widen_rows(cache, ahead, offsets, rows, d0, 6)
    elif vectors == 5:
        widen_rows(cache, ahead, offsets, rows, d0, 5)
    else:
        widen_rows(cache, ahead, offsets, rows, d0, 1)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _scores_step(rows, scores, g, c, vectors):  # noqa: C901 - a literal kernel a head size  # pragma: no cover - compiled
    """scores[g, c: c + 16] = the widened keys (rows[:16]) . the scaled query (rows[32 + g])."""
    qs = rows[2 * KEY_ROWS:]
    if vectors == 4:
        key_scores(rows, qs, scores, g, c, 4)
    elif vectors == 8:
        key_scores(rows, qs, scores, g, c, 8)
    elif vectors == 2:
        key_scores(rows, qs, scores, g, c, 2)
    elif vectors == 16:
        key_scores(rows, qs, scores, g, c, 16)
    elif vectors == 6:
        key_scores(rows, qs, scores, g, c, 6)
    elif vectors == 5:
        key_scores(rows, qs, scores, g, c, 5)
    else:
        key_scores(rows, qs, scores, g, c, 1)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _update_step(rows, scores, acc, group, c, vectors):  # noqa: C901 - a literal kernel a head size  # pragma: no cover - compiled
    """acc[g] += scores[g, c: c + 16] @ the widened values (rows[16:32]) for every head g."""
    vb = rows[KEY_ROWS:2 * KEY_ROWS]
    step = _head_rows(vectors)
    for g0 in range(0, group, step):
        if vectors == 4:
            head_update(scores, vb, acc, g0, c, 4, 4)
        elif vectors == 8:
            head_update(scores, vb, acc, g0, c, 2, 8)
        elif vectors == 2:
            head_update(scores, vb, acc, g0, c, 4, 2)
        elif vectors == 16:
            head_update(scores, vb, acc, g0, c, 1, 16)
        elif vectors == 6:
            head_update(scores, vb, acc, g0, c, 2, 6)
        elif vectors == 5:
            head_update(scores, vb, acc, g0, c, 2, 5)
        else:
            head_update(scores, vb, acc, g0, c, 4, 1)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def _softmax_heads(scores, group, n):  # pragma: no cover - compiled
    """scores[g, :n] -> probabilities for g < group; the last 16-key step's keys past n get 0."""
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
        for j in range(n, -(-n // KEY_ROWS) * KEY_ROWS):
            scores[g, j] = 0.0


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def _attend_tiles(q, k_cache, v_cache, t, kvh, num_keys, first, block_table, scale, scratch,
                  out):  # pragma: no cover - compiled
    """_attend for a head_dim of HEAD_DIMS: KEY_ROWS keys at a time widened into rows, scored by
    key_scores (every head, vectors along head_dim, one transpose-sum a head) and added into the
    accumulator by head_update (acc rows in registers), gpu/cpu/fma_tiles.py."""
    scores, acc, rows, offsets = scratch
    head_dim = q.shape[2]
    group = q.shape[1] // k_cache.shape[2]
    h0, vectors, n = kvh * group, head_dim // 16, num_keys - first
    for g in range(group):
        for d in range(head_dim):
            rows[2 * KEY_ROWS + g, d] = q[t, h0 + g, d] * scale
    for c in range(0, n, KEY_ROWS):
        if c + KEY_ROWS < n:  # the next keys ahead; after the last, the first values
            _widen_step(k_cache, block_table, kvh, first + c, num_keys, rows, 0, offsets, k_cache,
                        first + c + KEY_ROWS)
        else:
            _widen_step(k_cache, block_table, kvh, first + c, num_keys, rows, 0, offsets, v_cache, first)
        for g in range(group):
            _scores_step(rows, scores, g, c, vectors)
    _softmax_heads(scores, group, n)
    acc[:, :] = 0.0
    for c in range(0, n, KEY_ROWS):
        _widen_step(v_cache, block_table, kvh, first + c, num_keys, rows, KEY_ROWS, offsets, v_cache,
                    first + c + KEY_ROWS)
        _update_step(rows, scores, acc, group, c, vectors)
    for g in range(group):
        for d in range(head_dim):
            out[t, h0 + g, d] = acc[g, d]


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def _attend(q, k_cache, v_cache, t, kvh, num_keys, first, block_table, scale, scratch,  # noqa: C901
            out):  # pragma: no cover - compiled
    """Token t's query heads of KV head kvh over keys first..num_keys-1 -> out[t, heads]
    (scratch: attention_scratch's)."""
    head_dim, block_size = q.shape[2], k_cache.shape[1]
    if head_dim % 16 == 0 and head_dim // 16 in (1, 2, 4, 5, 6, 8, 16):
        _attend_tiles(q, k_cache, v_cache, t, kvh, num_keys, first, block_table, scale, scratch, out)
        return
    scores, acc, rows = scratch[0], scratch[1], scratch[2]
    row_f = rows[0]
    group = q.shape[1] // k_cache.shape[2]
    h0 = kvh * group
    n = num_keys - first
    start = first - first % block_size  # NOTE: from the window's first block, never before it
    for j0 in range(start, num_keys, block_size):  # block by block: no division per key
        block = block_table[j0 // block_size]
        for row in range(max(0, first - j0), min(block_size, num_keys - j0)):
            for d in range(head_dim):  # PERF: the key widened once, not once per query head
                row_f[d] = kv_load(k_cache[block, row, kvh, d])
            for g in range(group):
                s = np.float32(0.0)
                for d in range(head_dim):
                    s += q[t, h0 + g, d] * row_f[d]
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
        block = block_table[j0 // block_size]
        for row in range(max(0, first - j0), min(block_size, num_keys - j0)):
            for d in range(head_dim):
                row_f[d] = kv_load(v_cache[block, row, kvh, d])
            for g in range(group):
                w = scores[g, j0 + row - first]
                for d in range(head_dim):
                    acc[g, d] += w * row_f[d]
    for g in range(group):
        for d in range(head_dim):
            out[t, h0 + g, d] = acc[g, d]


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def _key_range(positions, seq_len, window, t):  # pragma: no cover - compiled
    """(num_keys, first): token t sees keys first..num_keys-1."""
    num_keys = min(positions[t] + 1, seq_len)
    first = 0 if window <= 0 else max(0, positions[t] + 1 - window)  # the window's first key
    return num_keys, first


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def paged_attention(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
                    scale, window, out, max_tokens=2**62):  # pragma: no cover - compiled
    """q [T, H, D], k/v_cache [num_blocks, block_size, KVH, D] in their storage type
    (gpu/cpu/kv_dtypes.py) -> out [T, H, D] (written). window 0: full causal attention. A
    request with more than max_tokens query tokens is left alone (gpu/cpu/prefill_attention.py
    takes those)."""
    num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]
    group = q.shape[1] // num_kv_heads
    num_reqs = seq_lens.shape[0]
    max_len = 1
    for r in range(num_reqs):
        max_len = max(max_len, seq_lens[r])
    scratch = attention_scratch(group, max_len, head_dim)
    for r in range(num_reqs):
        if query_start_loc[r + 1] - query_start_loc[r] > max_tokens:
            continue
        for t in range(query_start_loc[r], query_start_loc[r + 1]):
            num_keys, first = _key_range(positions, seq_lens[r], window, t)
            if num_keys <= first:
                out[t, :, :] = 0.0
                continue
            for kvh in range(num_kv_heads):
                _attend(q, k_cache, v_cache, t, kvh, num_keys, first, block_tables[r], scale,
                        scratch, out)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def _claimed_pairs(q, k_cache, v_cache, positions, seq_lens, block_tables, scale, window, out,
                   owner, max_len, counter):  # pragma: no cover - compiled
    """One thread's share of paged_attention_parallel: pairs claimed until none is left, with
    scratch of its own. NOTE: a function of its own, not the prange body, so that the scratch is
    per thread by construction, whatever Numba's parfor pass decides to hoist out of a loop."""
    num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]
    group = q.shape[1] // num_kv_heads
    scratch = attention_scratch(group, max_len, head_dim)
    pairs = q.shape[0] * num_kv_heads
    w = claim(counter)
    while w < pairs:
        t, kvh = w // num_kv_heads, w % num_kv_heads
        r = owner[t]
        if r >= 0:
            num_keys, first = _key_range(positions, seq_lens[r], window, t)
            if num_keys <= first:
                out[t, kvh * group:(kvh + 1) * group, :] = 0.0
            else:
                _attend(q, k_cache, v_cache, t, kvh, num_keys, first, block_tables[r], scale,
                        scratch, out)
        w = claim(counter)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", parallel=True)
def paged_attention_parallel(q, k_cache, v_cache, positions, query_start_loc, seq_lens,
                             block_tables, scale, window, out, max_tokens,
                             counter):  # pragma: no cover - compiled
    """paged_attention with its (token, KV head) pairs claimed by Numba's threads one at a time
    (gpu/cpu/tasks.py: a descheduled thread holds back one pair, not half the step; counter:
    task_counter(tokens x KV heads); counter[1] = 1: on the calling thread alone), each thread
    its own scratch: the same result bit for bit whatever the number of threads."""
    owner = np.full(q.shape[0], -1, np.int64)  # each token's request; -1: not this kernel's
    max_len = 1
    for r in range(seq_lens.shape[0]):
        if query_start_loc[r + 1] - query_start_loc[r] <= max_tokens:
            owner[query_start_loc[r]:query_start_loc[r + 1]] = r
            max_len = max(max_len, seq_lens[r])
    counter[0] = 0
    for _ in prange(counter[1]):
        _claimed_pairs(q, k_cache, v_cache, positions, seq_lens, block_tables, scale, window, out,
                       owner, max_len, counter)
