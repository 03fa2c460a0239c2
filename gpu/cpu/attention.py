"""Paged attention on the CPU: a Numba kernel over the whole super-sequence.

Each query token of request r at position p attends to keys 0..p of r (a sliding window w:
keys p - w < k <= p), read through r's block table (key j lives at block_tables[r, j //
block_size], row j % block_size), so attention is causal within a request and blind across
requests. A window reads no block wholly before it: engine/kv_cache.py frees those (their table
entries then name a placeholder block), and the cost per token is O(w), not O(p). One compiled loop for the
whole step instead of a dozen numpy calls per request and layer, which dominated decode
steps with many requests. Softmax in float32 with the max subtracted.

Two drivers of the same body (a token and a run of adjacent KV heads): `paged_attention`, the
readable one-thread reference (tests, the CUDA reference), a token's heads in one run, and
`paged_attention_parallel`, which CpuOps runs for every step: its tasks over Numba's threads for
a step whose tokens read many keys (4,000 keys x 8 KV heads are ~1 ms a layer on one thread), on
one thread otherwise. The body scores and sums 16 keys at a time in gpu/cpu/fma_tiles.py's
register-held micro-kernels, and asks for the next block's rows while it reads a block's (the
blocks of a request lie anywhere in the pool). A task is a whole token (a cache row [KV heads,
head_dim] read in one sweep, not one head's slice of every row), a run of a prompt chunk's
adjacent tokens (each row widened once for the run), or one KV head of a token that has more
than a thread's share of the step's keys (`plan_tasks`: a decode alone, a long context among
short ones). NOTE: one driver in the engine, because the two drivers' copies of `_attend` are
optimized apart (LLVM inlines it into each, and a driver loaded from Numba's cache was compiled
in another process): they agree within float32 rounding, not bit for bit, and a token's result
must not depend on the batch it ran in.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ringserve.gpu.cpu.fma_tiles import KEYS, ROWS, accumulate_rows, key_scores, prefetch_heads
from ringserve.gpu.cpu.kernels import FASTMATH, fast_exp
from ringserve.gpu.cpu.kv_dtypes import kv_load
from ringserve.gpu.cpu.tasks import claim

# NOTE: kv_load and fma_tiles' micro-kernels are compiled into these kernels, and Numba's cache keys
# on this file alone: a change to gpu/cpu/kv_dtypes.py or gpu/cpu/fma_tiles.py (2026-12-07: the
# 16-key micro-kernels, two update kernels) comes with an edit here, or old caches stay

# A step whose per-token loop reads at least this many (key, token) pairs takes the parallel driver
# (~30 ns a key and KV head on one thread; a TBB fork and join is ~10-20 us): one decode at 256
# keys of the 1B shape, 0.09 -> 0.05 ms a layer (docs/bench_forward.md)
PARALLEL_KEY_READS = 256
# Adjacent tokens of one prompt chunk a task takes together (plan_tasks), sharing each widened key
# and value row: a chunk under the tiled kernel's SERVED_MIN_TOKENS reads its keys once a run,
# not once a token (docs/bench_forward.md, "Runs of a prompt's tokens in the per-token attention")
RUN_TOKENS = 16
# ... and no more (token, key) pairs than this a run: its scores and probabilities (tokens x query
# heads x keys, twice) stay in L2 (16 tokens at 512 keys, 2 at 4,000), as one token's do
RUN_KEY_PAIRS = 8192


@njit(cache=True, nogil=True, error_model="numpy")
def attention_scratch(num_heads, num_kv_heads, head_dim, max_len, tokens=1):  # pragma: no cover - compiled
    """One thread's scratch for _attend of up to `tokens` tokens: (qs, scores, totals, acc, kb, vb,
    top). Token u's KV head i's query heads are rows u * R + i * gpad + g, g < group, R =
    num_kv_heads * gpad (the group rounded up to ROWS: _attend gives the rows past the group
    probabilities 0; the columns past head_dim stay zero: the micro-kernels take whole steps of
    ROWS rows and 16 columns). PERF: the scores [rows, keys] are not zeroed (a long context's are
    MBs, allocated every layer)."""
    group = num_heads // num_kv_heads
    gpad = (group + ROWS - 1) // ROWS * ROWS
    dpad = (head_dim + 15) // 16 * 16
    rows, keys = tokens * num_kv_heads * gpad, max_len + KEYS
    # PERF: scores' rows an odd number of cache lines apart (the columns past keys are never
    # read): accumulate_rows reads a key's probabilities from ROWS rows at once, which a power of
    # two apart put into a few L1 sets (4 x 128 prompt tokens, 16 layers: 57 -> 47 ms, when they
    # were a transposed copy). kb and vb get a spare row a KV head for the same reason: 16 rows
    # of 64 floats put each head 4 KB after the last, and a cache row's 8 heads into the same L1
    # sets (16 decodes at 160 keys, 16 layers: 6.2-6.3 -> 5.8 ms)
    scores = np.empty((rows, _odd_lines(keys)), np.float32)
    return (np.zeros((rows, dpad), np.float32), scores, np.empty(rows, np.float32),
            np.zeros((rows, dpad), np.float32), np.zeros((num_kv_heads, KEYS + 1, dpad), np.float32),
            np.zeros((num_kv_heads, KEYS + 1, dpad), np.float32), np.empty(1, np.int32))


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _odd_lines(n):  # pragma: no cover - compiled
    """n float32 rounded up to a whole, odd number of 64-byte cache lines."""
    lines = (n + 15) // 16
    return (lines + 1 - lines % 2) * 16


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def _row_max(row, n, top):  # pragma: no cover - compiled
    """max(row[:n]), n >= 1 (top: an int32 scratch of one). PERF: a float max without fast-math's
    no-NaNs stays one chain of dependent compares; the bits of a float flipped below its sign
    (b ^ (b >> 31 & 0x7FFFFFFF)) order as its value, and an integer max is a vector loop: 160
    keys 57 -> 19 ns a row, 64 keys 19 -> 13 (-0.0 orders below 0.0: either is the maximum's
    value, and the differences from it the same)."""
    bits = row[:n].view(np.int32)
    key = np.int32(-2**31)
    for j in range(n):
        b = bits[j]
        key = max(key, b ^ ((b >> 31) & np.int32(0x7FFFFFFF)))
    top[0] = key ^ ((key >> 31) & np.int32(0x7FFFFFFF))  # NOTE: the same flip undoes itself
    return top.view(np.float32)[0]


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def _gather_keys(cache, block, row, kvh0, kvh1, fill, dst):  # pragma: no cover - compiled
    """Cache row [block, row]'s KV heads kvh0..kvh1-1 widened into dst[:kvh1 - kvh0, fill] (one
    sweep of the row's bytes)."""
    for i in range(kvh1 - kvh0):
        for d in range(cache.shape[3]):
            dst[i, fill, d] = kv_load(cache[block, row, kvh0 + i, d])


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def _attend(q, k_cache, v_cache, t, count, kvh0, kvh1, num_keys, first, block_table, scale,  # noqa: C901
            scratch, out):  # pragma: no cover - compiled
    """Tokens t..t + count - 1 of one request (adjacent positions: token t + u sees keys
    first..num_keys + u - 1; a run of more than one only where first is 0), their query heads of
    KV heads kvh0..kvh1-1 -> out[t + u, heads]. Scores KEYS keys at a time (fma_tiles.key_scores:
    head_dim in the lanes, a fixed tree to one lane a key), an exact softmax over each token's
    keys, then the values KEYS keys at a time into register-held accumulators (accumulate_rows).
    PERF: the keys and values are widened KEYS cache rows at a time, each row's KV heads in one
    sweep (contiguous bytes the hardware prefetcher follows), once for the whole run; the query
    heads of a KV head, and the run's tokens, share each widened key. A token takes the same
    calls on the same operands whatever the run (lanes past its own keys in a run's last vector
    are other keys, not zeros: each lane's score is its key's alone, and past the token's keys
    nothing reads them): its result is the same bits alone, in any run, batch or thread."""
    qs, scores, totals, acc, kb, vb, top = scratch
    head_dim, block_size = q.shape[2], k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    gpad = (group + ROWS - 1) // ROWS * ROWS
    nk = kvh1 - kvh0
    R = nk * gpad  # rows a token
    last_key = num_keys + count - 1  # the last token's key count: every key the run reads ends here
    n_all = last_key - first
    for u in range(count):  # the queries, scaled, in zero-padded rows
        for i in range(nk):
            for g in range(group):
                for d in range(head_dim):
                    qs[u * R + i * gpad + g, d] = q[t + u, (kvh0 + i) * group + g, d] * scale
    start = first - first % block_size  # NOTE: from the window's first block, never before it
    fill, o = 0, 0
    for j0 in range(start, last_key, block_size):  # block by block: no division per key
        block = block_table[j0 // block_size]
        last = j0 + block_size >= last_key  # then the values' first block is the one to ask for
        ahead = block_table[start // block_size] if last else block_table[j0 // block_size + 1]
        for row in range(max(0, first - j0), min(block_size, last_key - j0)):
            prefetch_heads(v_cache if last else k_cache, np.int64(ahead), np.int64(row), np.int64(kvh0),
                           np.int64(kvh1))
            _gather_keys(k_cache, block, row, kvh0, kvh1, fill, kb)
            fill += 1
            if fill == KEYS or o + fill == n_all:
                for i in range(nk):
                    kb[i, fill:, :] = 0.0  # a last, partial run: finite lanes, ignored below
                for u in range(count):
                    if o < num_keys + u - first:  # the token has keys in this run
                        for i in range(nk):
                            for g in range(group):
                                r = u * R + i * gpad + g
                                key_scores(kb[i], qs, scores, r, r, o)
                o += fill
                fill = 0
    for u in range(count):
        n = num_keys + u - first
        for i in range(nk):
            for g in range(group):
                r = u * R + i * gpad + g
                row = scores[r]  # NOTE: a 1-D row indexed from 0: LLVM vectorizes what [r, j] kept scalar
                m = _row_max(row, n, top)
                total = np.float32(0.0)
                for j in range(n):
                    e = fast_exp(row[j] - m)
                    row[j] = e
                    total += e
                totals[r] = total
            for r in range(u * R + i * gpad + group, u * R + (i + 1) * gpad):  # padding: probabilities 0
                scores[r, :n] = 0.0
    acc[:count * R, :] = 0.0
    fill, o = 0, 0
    for j0 in range(start, last_key, block_size):
        block = block_table[j0 // block_size]
        ahead = block_table[j0 // block_size + 1] if j0 + block_size < last_key else block
        for row in range(max(0, first - j0), min(block_size, last_key - j0)):
            prefetch_heads(v_cache, np.int64(ahead), np.int64(row), np.int64(kvh0), np.int64(kvh1))
            _gather_keys(v_cache, block, row, kvh0, kvh1, fill, vb)
            fill += 1
            if fill == KEYS or o + fill == n_all:
                for u in range(count):
                    mine = min(fill, num_keys + u - first - o)  # the token's keys in this run
                    if mine > 0:
                        for i in range(nk):
                            rows = slice(u * R + i * gpad, u * R + (i + 1) * gpad)
                            accumulate_rows(scores[rows, o:o + mine], vb[i, :mine], acc[rows])
                o += fill
                fill = 0
    for u in range(count):
        for i in range(nk):
            for g in range(group):
                r = u * R + i * gpad + g
                inv = np.float32(1.0) / totals[r]
                for d in range(head_dim):
                    out[t + u, (kvh0 + i) * group + g, d] = acc[r, d] * inv


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
    num_reqs = seq_lens.shape[0]
    max_len = 1
    for r in range(num_reqs):
        max_len = max(max_len, seq_lens[r])
    scratch = attention_scratch(q.shape[1], num_kv_heads, head_dim, max_len)
    for r in range(num_reqs):
        if query_start_loc[r + 1] - query_start_loc[r] > max_tokens:
            continue
        for t in range(query_start_loc[r], query_start_loc[r + 1]):
            num_keys, first = _key_range(positions, seq_lens[r], window, t)
            if num_keys <= first:
                out[t, :, :] = 0.0
                continue
            _attend(q, k_cache, v_cache, t, 1, 0, num_kv_heads, num_keys, first, block_tables[r],
                    scale, scratch, out)


@njit(cache=True, nogil=True, error_model="numpy")
def plan_tasks(positions, seq_lens, window, owner, num_kv_heads, threads,
               run_tokens=RUN_TOKENS):  # pragma: no cover - compiled
    """The step's tasks [n, 4] (first token, tokens, first KV head, end KV head), heaviest first: a
    token whose keys are more than a thread's share of the step's (a decode alone, a long context
    among short ones) one task per KV head, so its heads spread over the threads; every other
    token with all its heads, in runs of up to run_tokens adjacent tokens of one request (a
    prompt chunk's; with no window: they share the first key, and each widened key; at most
    RUN_KEY_PAIRS tokens x keys) or alone.
    NOTE: never a token's heads in runs swept side by side: two threads sweeping halves of the
    same rows took 2.5x as long as one sweeping them whole (docs/bench_forward.md)."""
    total = 0
    for t in range(owner.shape[0]):
        if owner[t] >= 0:
            num_keys, first = _key_range(positions, seq_lens[owner[t]], window, t)
            total += max(num_keys - first, 0)
    tasks = np.empty((owner.shape[0] * num_kv_heads, 4), np.int64)
    n = 0
    for t in range(owner.shape[0]):  # the split tokens first
        if owner[t] < 0:
            continue
        num_keys, first = _key_range(positions, seq_lens[owner[t]], window, t)
        if (num_keys - first) * threads > total:
            for kvh0 in range(num_kv_heads):
                tasks[n, 0], tasks[n, 1], tasks[n, 2], tasks[n, 3] = t, 1, kvh0, kvh0 + 1
                n += 1
    t = 0
    while t < owner.shape[0]:
        num_keys, first = (0, 0) if owner[t] < 0 else _key_range(positions, seq_lens[owner[t]], window, t)
        if owner[t] < 0 or (num_keys - first) * threads > total:
            t += 1
            continue
        count = 1
        while (window <= 0 and count < run_tokens and t + count < owner.shape[0]
               and owner[t + count] == owner[t] and positions[t + count] == positions[t] + count
               and positions[t + count] < seq_lens[owner[t]]
               and (num_keys + count) * threads <= total
               and (num_keys + count) * (count + 1) <= RUN_KEY_PAIRS):
            count += 1
        tasks[n, 0], tasks[n, 1], tasks[n, 2], tasks[n, 3] = t, count, 0, num_kv_heads
        n += 1
        t += count
    return tasks[:n]


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def _claimed_tasks(q, k_cache, v_cache, positions, seq_lens, block_tables, scale, window, out,
                   owner, max_len, run, tasks, counter):  # pragma: no cover - compiled
    """One thread's share of paged_attention_parallel: tasks claimed until none is left, with
    scratch of its own. NOTE: a function of its own, not the prange body, so that the scratch is
    per thread by construction, whatever Numba's parfor pass decides to hoist out of a loop."""
    group = q.shape[1] // k_cache.shape[2]
    scratch = attention_scratch(q.shape[1], k_cache.shape[2], q.shape[2], max_len, run)
    w = claim(counter)
    while w < tasks.shape[0]:
        t, count, kvh0, kvh1 = tasks[w, 0], tasks[w, 1], tasks[w, 2], tasks[w, 3]
        r = owner[t]
        num_keys, first = _key_range(positions, seq_lens[r], window, t)
        if num_keys <= first:  # NOTE: a window's empty range: alone (a run has first == 0)
            out[t, kvh0 * group:kvh1 * group, :] = 0.0
        else:
            _attend(q, k_cache, v_cache, t, count, kvh0, kvh1, num_keys, first, block_tables[r],
                    scale, scratch, out)
        w = claim(counter)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", parallel=True)
def paged_attention_parallel(q, k_cache, v_cache, positions, query_start_loc, seq_lens,
                             block_tables, scale, window, out, max_tokens,
                             counter):  # pragma: no cover - compiled
    """paged_attention with its tasks (plan_tasks: a token, or one KV head of a token that has
    more than a thread's share of the keys) claimed by Numba's threads one at a time
    (gpu/cpu/tasks.py: a descheduled thread holds back one task, not half the step; counter:
    task_counter(tokens x KV heads); counter[1] = 1: on the calling thread alone, every token
    whole), each thread its own scratch: the same result bit for bit whatever the threads and
    however a token's heads were split."""
    owner = np.full(q.shape[0], -1, np.int64)  # each token's request; -1: not this kernel's
    max_len = 1
    for r in range(seq_lens.shape[0]):
        if query_start_loc[r + 1] - query_start_loc[r] <= max_tokens:
            owner[query_start_loc[r]:query_start_loc[r + 1]] = r
            max_len = max(max_len, seq_lens[r])
    tasks = plan_tasks(positions, seq_lens, window, owner, k_cache.shape[2], counter[1])
    run = 1  # the longest run: each thread's scratch holds its rows
    for w in range(tasks.shape[0]):
        run = max(run, tasks[w, 1])
    counter[0] = 0
    for _ in prange(counter[1]):
        _claimed_tasks(q, k_cache, v_cache, positions, seq_lens, block_tables, scale, window, out,
                       owner, max_len, run, tasks, counter)
