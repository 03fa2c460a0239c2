"""Paged attention for long prefill chunks on the CPU: query tiles against key blocks, online
softmax (flash-attention's order), in Numba.

gpu/cpu/attention.py's loop reads every key once per query token and dots it with one head's
query at a time: right for a decode (one query), but a 512-token chunk against 4,000 keys reads
each key 512 times. Here a tile of up to TILE_ROWS query rows (query tokens x the query heads
that share one KV head) meets a block of KEY_BLOCK keys at once: the block's keys and values are
read from the paged cache (and widened from a 16-bit cache) once per tile into float32 scratch;
the scores Q K^T and the update P V are small products in 2-row x 4-key register steps,
vectorized over head_dim. A running max and sum per row rescale the accumulator when a later
block raises the max, so no [rows, keys] score matrix is kept and nothing is gathered beyond
one block. Tiles are independent: a parallel region splits them over the step's threads.

The keys a query sees are attention.py's: keys first..last-1 of its request (causal; a sliding
window's first key), and a tile reads no row before its earliest query's window nor after its
latest query (rows a block holds beyond them may be a freed block's or not yet written).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ringserve.gpu.cpu.fma_tiles import SCORE_KEYS, SCORE_ROWS, scores_tile, update_tile
from ringserve.gpu.cpu.kernels import FASTMATH, fast_exp
from ringserve.gpu.cpu.kv_dtypes import kv_load

# NOTE: kv_load and fma_tiles' micro-kernels are compiled into these kernels, and Numba's cache keys
# on this file alone: a change to gpu/cpu/kv_dtypes.py or gpu/cpu/fma_tiles.py (2026-12-07: new
# kernels beside this file's) comes with an edit here, or old caches stay

# The fewest query tokens of a request's chunk the kernel takes by default (fewer: attention.py's
# loop, which a decode step's single queries need and which the tile would only pad).
MIN_TOKENS = 16
# The CPU runner sends a request's chunk here only from this many query tokens; below, the
# per-token loop (attention.py), whose numbers do not depend on how a prompt is chunked or
# prefix-cached. This kernel's blockwise sums round differently, so a prompt computed here and
# the same prompt's tail recomputed after a prefix-cache hit can differ at a near-tie: kept to
# the long chunks where its speed pays (docs/bench_forward.md).
SERVED_MIN_TOKENS = 256
TILE_ROWS = 128  # query rows (tokens x grouped heads) of a tile
KEY_BLOCK = 32   # keys a tile reads at once
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the head sizes it takes (_accumulate's literal kernels)
_NEG_INF = np.float32(-np.inf)
# A probability below e^-64 (~1.6e-28 of the row's largest, whose is 1) is 0 here: it cannot move a
# float32 sum, and its products with the values were subnormal numbers, which cost Intel cores a
# microcode assist each (one layer of a random 1B took 270 ms a chunk instead of 70)
_NEGLIGIBLE = np.float32(-64.0)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def _tiles(query_start_loc, group, min_tokens):  # pragma: no cover - compiled
    """[n, 3] (request, first query token, tokens) of every tile of the step's long chunks; each
    tile is run once per KV head."""
    tokens_per_tile = max(1, TILE_ROWS // group)
    n = 0
    for r in range(query_start_loc.shape[0] - 1):
        q_len = query_start_loc[r + 1] - query_start_loc[r]
        if q_len >= min_tokens:
            n += (q_len + tokens_per_tile - 1) // tokens_per_tile
    tiles = np.empty((n, 3), np.int64)
    i = 0
    for r in range(query_start_loc.shape[0] - 1):
        if query_start_loc[r + 1] - query_start_loc[r] < min_tokens:
            continue
        for t0 in range(query_start_loc[r], query_start_loc[r + 1], tokens_per_tile):
            tiles[i, 0], tiles[i, 1] = r, t0
            tiles[i, 2] = min(tokens_per_tile, query_start_loc[r + 1] - t0)
            i += 1
    return tiles


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def _load_block(k_cache, v_cache, block_table, kvh, j0, nk, kb, vb):  # pragma: no cover - compiled
    """Keys j0..j0+nk-1 of one KV head as float32 rows of kb, vb [KEY_BLOCK, D]; the rows past
    nk are zero."""
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    for jj in range(nk):
        j = j0 + jj
        block, row = block_table[j // block_size], j % block_size
        for d in range(head_dim):
            kb[jj, d] = kv_load(k_cache[block, row, kvh, d])
            vb[jj, d] = kv_load(v_cache[block, row, kvh, d])
    for jj in range(nk, KEY_BLOCK):
        for d in range(head_dim):
            kb[jj, d] = 0.0
            vb[jj, d] = 0.0


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _scores(kb, qt, st):  # pragma: no cover - compiled
    """st = kb @ qt: the block's scores, a key a row, the tile's query rows along it
    (gpu/cpu/fma_tiles.py: SCORE_KEYS keys x SCORE_ROWS rows a step)."""
    for j0 in range(0, KEY_BLOCK, SCORE_KEYS):
        for i0 in range(0, qt.shape[1], SCORE_ROWS):
            scores_tile(kb, qt, st, j0, i0)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _accumulate(s, vb, acc):  # noqa: C901 - one literal kernel a head size  # pragma: no cover - compiled
    """acc += s @ vb (gpu/cpu/fma_tiles.py): as many rows a step as 16 vectors hold at head_dim
    / 16 vectors a row, at most SCORE_ROWS (one literal kernel per head size of HEAD_DIMS)."""
    vectors, n = vb.shape[1] // 16, acc.shape[0]
    if vectors == 4:
        for i in range(0, n, 4):
            update_tile(s, vb, acc, i, 4, 4)
    elif vectors == 8:
        for i in range(0, n, 2):
            update_tile(s, vb, acc, i, 2, 8)
    elif vectors == 2:
        for i in range(0, n, 4):
            update_tile(s, vb, acc, i, 4, 2)
    elif vectors == 16:
        for i in range(n):
            update_tile(s, vb, acc, i, 1, 16)
    elif vectors == 6:
        for i in range(0, n, 2):
            update_tile(s, vb, acc, i, 2, 6)
    elif vectors == 5:
        for i in range(0, n, 2):
            update_tile(s, vb, acc, i, 2, 5)
    else:  # 1: head_dim 16
        for i in range(0, n, 4):
            update_tile(s, vb, acc, i, 4, 1)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def _softmax_block(st, lo, hi, masked, row_max, row_sum, alpha):  # pragma: no cover - compiled
    """The block's scores st [KEY_BLOCK, P] -> probabilities against each row's running max, in
    place (below _NEGLIGIBLE: 0); the running sums rescaled and alpha[i] the factor the row's
    accumulator must take (1 where its max did not rise). Row i sees keys lo[i]..hi[i]-1 of the
    block (masked: some row does not see them all); a key it does not see gets probability 0.
    Every loop runs along the rows: vectors of 16 rows, no horizontal sums."""
    n = st.shape[1]
    if masked:
        for jj in range(KEY_BLOCK):
            for i in range(n):
                if jj < lo[i] or jj >= hi[i]:
                    st[jj, i] = _NEG_INF
    m_new = row_max.copy()
    for jj in range(KEY_BLOCK):
        for i in range(n):
            m_new[i] = max(m_new[i], st[jj, i])
    # NOTE: a row that has seen no key yet keeps max -inf: subtract 0 from its -inf scores, not -inf
    base = np.where(m_new > _NEG_INF, m_new, np.float32(0.0))
    total = np.zeros(n, np.float32)
    for jj in range(KEY_BLOCK):
        for i in range(n):
            x = st[jj, i] - base[i]  # a masked key: -inf
            p = fast_exp(x) if x > _NEGLIGIBLE else np.float32(0.0)
            st[jj, i] = p
            total[i] += p
    for i in range(n):
        x = row_max[i] - base[i]  # a first block's: -inf (its sum and accumulator are 0)
        rose = m_new[i] > row_max[i]
        alpha[i] = (fast_exp(x) if x > _NEGLIGIBLE else np.float32(0.0)) if rose else np.float32(1.0)
        row_sum[i] = row_sum[i] * alpha[i] + total[i]
        row_max[i] = m_new[i]


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def _tile(q, k_cache, v_cache, positions, seq_len, block_table, scale, window, kvh, t0, n_tok,
          out):  # pragma: no cover - compiled
    """One tile: query tokens t0..t0+n_tok-1 of one request, the query heads of KV head kvh."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    h0, rows = kvh * group, n_tok * group
    # whole steps of _scores and _accumulate (SCORE_ROWS); a padding row sees no key
    padded = (rows + SCORE_ROWS - 1) // SCORE_ROWS * SCORE_ROWS
    qt = np.zeros((head_dim, padded), np.float32)  # the queries transposed: a row along a vector
    first = np.zeros(padded, np.int64)  # per row: its query's first key ...
    last = np.zeros(padded, np.int64)   # ... and one past its last (a padding row: none)
    for i in range(rows):
        t = t0 + i // group
        last[i] = min(positions[t] + 1, seq_len)
        first[i] = 0 if window <= 0 else max(0, positions[t] + 1 - window)
        for d in range(head_dim):
            qt[d, i] = q[t, h0 + i % group, d] * scale
    lo_key, hi_key = first[:rows].min(), last[:rows].max()
    first_max, last_min = first[:rows].max(), last[:rows].min()
    row_max = np.full(padded, _NEG_INF, np.float32)
    row_sum = np.zeros(padded, np.float32)
    alpha = np.ones(padded, np.float32)
    acc = np.zeros((padded, head_dim), np.float32)
    kb = np.empty((KEY_BLOCK, head_dim), np.float32)
    vb = np.empty((KEY_BLOCK, head_dim), np.float32)
    st = np.empty((KEY_BLOCK, padded), np.float32)
    for j0 in range(lo_key, hi_key, KEY_BLOCK):
        _load_block(k_cache, v_cache, block_table, kvh, j0, min(KEY_BLOCK, hi_key - j0), kb, vb)
        _scores(kb, qt, st)
        # NOTE: only the blocks at the tile's causal edge (or window edge) have masked keys
        masked = j0 + KEY_BLOCK > last_min or j0 < first_max
        _softmax_block(st, first - j0, last - j0, masked, row_max, row_sum, alpha)
        for i in range(padded):
            if alpha[i] != 1:
                for d in range(head_dim):
                    acc[i, d] *= alpha[i]
        _accumulate(st, vb, acc)
    for i in range(rows):
        inv = np.float32(1.0) / row_sum[i] if row_sum[i] > 0 else np.float32(0.0)
        for d in range(head_dim):
            out[t0 + i // group, h0 + i % group, d] = acc[i, d] * inv


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", parallel=True)
def prefill_attention(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
                      scale, window, out, min_tokens=MIN_TOKENS):  # pragma: no cover - compiled
    """attention.py's paged_attention for the requests with min_tokens (MIN_TOKENS) or more query tokens in
    this step (the others' rows of out are left alone), its tiles split over Numba's threads."""
    num_kv_heads = k_cache.shape[2]
    tiles = _tiles(query_start_loc, q.shape[1] // num_kv_heads, min_tokens)
    for w in prange(tiles.shape[0] * num_kv_heads):
        tile, kvh = w // num_kv_heads, w % num_kv_heads
        r = tiles[tile, 0]
        _tile(q, k_cache, v_cache, positions, seq_lens[r], block_tables[r], scale, window, kvh,
              tiles[tile, 1], tiles[tile, 2], out)
