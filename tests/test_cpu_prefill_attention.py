"""gpu/cpu/prefill_attention.py: the tiled attention of long prompt chunks is the paged
attention of gpu/cpu/attention.py's loop and of a float64 reference, for every CPU cache type,
GQA groups, sliding windows (never reading a block freed before a window) and mixed steps
(decodes, short chunks and long chunks at any offset in one step), as CpuOps runs them; and the
loop's driver CpuOps runs gives the same bits on one thread as on all and in tasks of one KV head
or a run of them (how many threads and heads a task takes depends on the batch: a token's result
must not), and the one-thread reference loop's values."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from paged_cases import free_before_windows, load_all, paged_layout, store_all
from ringserve.gpu.cpu.attention import RUN_KEY_PAIRS, paged_attention, paged_attention_parallel, plan_tasks
from ringserve.gpu.cpu.fma_tiles import KEYS, key_scores
from ringserve.gpu.cpu.kv_dtypes import KV_CACHE_DTYPES
from ringserve.gpu.cpu.prefill_attention import KEY_BLOCK, MIN_TOKENS, prefill_attention
from ringserve.gpu.cpu.tasks import task_counter

# (tokens cached before this step, new tokens): decodes, a short chunk, long chunks from the
# start and after a cached prefix, one ending mid key block and mid tile
MIXED = [(40, 1), (0, 5), (0, 150), (97, 1), (203, 77), (3, MIN_TOKENS), (0, 1)]


def reference(q, k, v, positions, qsl, seq_lens, tables, scale, window):
    """Float64 paged attention over the cache's float32 values k, v (widened)."""
    block_size = k.shape[1]
    group = q.shape[1] // k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for r in range(len(seq_lens)):
        for t in range(qsl[r], qsl[r + 1]):
            last = min(int(positions[t]) + 1, int(seq_lens[r]))
            j = np.arange(0 if window <= 0 else max(0, int(positions[t]) + 1 - window), last)
            blocks, rows = tables[r, j // block_size], j % block_size
            kk = np.repeat(k[blocks, rows].astype(np.float64), group, axis=1)  # [n, H, D]
            vv = np.repeat(v[blocks, rows].astype(np.float64), group, axis=1)
            s = np.einsum("hd,nhd->hn", q[t].astype(np.float64), kk) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[t] = np.einsum("hn,nhd->hd", p / p.sum(-1, keepdims=True), vv)
    return out


def _case(dtype, heads, kv_heads, window, requests=MIXED, block_size=16, head_dim=32, seed=0):
    rng = np.random.default_rng(seed)
    layout = paged_layout(rng, requests, block_size=block_size)
    shape = (layout["num_blocks"], block_size, kv_heads, head_dim)
    stored, wide = [], []
    for _ in range(2):  # k, v: stored in the cache's type, and the float32 values that holds
        x = np.empty(shape, KV_CACHE_DTYPES[dtype])
        store_all((rng.standard_normal(int(np.prod(shape))) * 2).astype(np.float32), x.reshape(-1))
        w = np.empty(shape, np.float32)
        load_all(x.reshape(-1), w.reshape(-1))
        stored.append(x)
        wide.append(w)
    tables = layout["block_tables"]
    spare = np.setdiff1d(np.arange(layout["num_blocks"]), tables)[0]
    for x in stored + wide:   # NOTE: a read of a block freed before a window shows as NaN
        x[spare] = _nan_of(x.dtype)
    if window:
        tables = free_before_windows(tables, requests, block_size=block_size, window=window, null=spare)
    q = rng.standard_normal((len(layout["positions"]), heads, head_dim)).astype(np.float32)
    args = (layout["positions"], layout["query_start_loc"], layout["seq_lens"], tables,
            np.float32(head_dim ** -0.5), window)
    return q, stored, wide, args


def _nan_of(dtype):
    return {np.float32: np.nan, np.uint16: 0x7FC0, np.int16: 0x7E00}[np.dtype(dtype).type]


def _as_ops_runs(q, k, v, args):
    """CpuOps.attention's two calls for a step with long chunks."""
    out = np.full_like(q, np.nan)
    prefill_attention(q, k, v, *args, out)
    paged_attention_parallel(q, k, v, *args, out, MIN_TOKENS - 1, task_counter(q.shape[0] * k.shape[2]))
    return out


@pytest.mark.parametrize("dtype", list(KV_CACHE_DTYPES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("window", [0, 1, KEY_BLOCK + 3])
def test_tiled_is_the_loop_and_the_float64_reference(dtype, heads, kv_heads, window):
    q, (k, v), (wide_k, wide_v), args = _case(dtype, heads, kv_heads, window)
    got = _as_ops_runs(q, k, v, args)
    loop = np.empty_like(q)
    paged_attention(q, k, v, *args, loop)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, loop, rtol=1e-5, atol=1e-5)
    want = reference(q, wide_k, wide_v, *args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_only_long_chunks_are_tiled_and_the_loop_leaves_them_alone():
    q, (k, v), _, args = _case("float32", 4, 2, 0)
    qsl = args[1]
    tiled = np.full_like(q, 7.0)
    prefill_attention(q, k, v, *args, tiled)
    looped = np.full_like(q, 7.0)
    paged_attention(q, k, v, *args, looped, MIN_TOKENS - 1)
    for r, (start, end) in enumerate(zip(qsl[:-1], qsl[1:], strict=True)):
        long_chunk = end - start >= MIN_TOKENS
        assert (tiled[start:end] == 7.0).all() != long_chunk, r
        assert (looped[start:end] == 7.0).all() == long_chunk, r


def test_a_large_logit_spread_and_one_request_over_many_key_blocks():
    """Scores far apart (the running max rises block after block, exp underflows) over a
    1,000-key context in 32-key blocks: still the reference."""
    q, (k, v), (wide_k, wide_v), args = _case("float32", 4, 1, 0, requests=[(900, 100)],
                                              block_size=32, seed=3)
    k *= np.linspace(0.1, 8, k.shape[0] * k.shape[1], dtype=np.float32).reshape(k.shape[:2])[..., None, None]
    got = _as_ops_runs(q, k, v, args)
    np.testing.assert_allclose(got, reference(q, k, v, *args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", list(KV_CACHE_DTYPES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (32, 8)])
@pytest.mark.parametrize("window", [0, 1, KEY_BLOCK + 3])
def test_the_loop_over_threads_is_the_loop(dtype, heads, kv_heads, window):
    # Llama-3.2-1B's heads and a batch of decodes at long contexts, where vectorized sums take
    # many vector steps
    requests = MIXED + [(191, 1)] * 16 + [(900, 1), (3999, 1), (1500, 3)]
    q, (k, v), _, args = _case(dtype, heads, kv_heads, window, requests=requests, head_dim=64)
    for max_tokens in (2**62, MIN_TOKENS - 1):  # every request; only decodes and short chunks
        one, loop = np.full_like(q, 7.0), np.full_like(q, 7.0)
        counter = task_counter(q.shape[0] * kv_heads)
        counter[1] = 1  # as CpuOps runs a small step: every token one task
        paged_attention_parallel(q, k, v, *args, one, max_tokens, counter)
        # 2 and 16 threads' plans (the 3,999-key decode split into its KV heads; at 16 more
        # tokens are), on as many threads as there are here
        for threads in (2, 16):
            many = np.full_like(q, 7.0)
            for _ in range(3):  # NOTE: a race (threads sharing scratch) shows in some runs only
                counter = task_counter(q.shape[0] * kv_heads)
                counter[1] = threads
                paged_attention_parallel(q, k, v, *args, many, max_tokens, counter)
                np.testing.assert_array_equal(many, one, err_msg=f"planned for {threads} threads")
        paged_attention(q, k, v, *args, loop, max_tokens)
        assert ((loop == 7.0) == (one == 7.0)).all()  # the same rows left alone
        np.testing.assert_allclose(one, loop, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 24, 48, 80, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(3, 1), (7, 1), (9, 3), (14, 2)])
def test_the_loop_takes_any_head_size_and_group(head_dim, heads, kv_heads):
    """The loop's micro-kernels take head_dim in whole vectors of 16 and query heads in runs of
    ROWS: a head size or a group that is not a multiple (rows and columns padded with zeros) is
    still the reference, with a window and over one and many KEYS runs."""
    for window in (0, KEY_BLOCK + 3):
        q, (k, v), (wide_k, wide_v), args = _case("float16", heads, kv_heads, window,
                                                  requests=MIXED[:2] + [(300, 1), (17, 15)],
                                                  head_dim=head_dim, seed=head_dim)
        out = np.full_like(q, np.nan)
        paged_attention_parallel(q, k, v, *args, out, 2**62, task_counter(q.shape[0] * kv_heads))
        np.testing.assert_allclose(out, reference(q, wide_k, wide_v, *args), rtol=2e-5, atol=2e-5)


def test_key_scores_sums_each_key_in_its_lane():
    """fma_tiles.key_scores: lane j of the written run is key j's dot product with the query
    row (a float64 check over head sizes of 1-4 vectors), and nothing past the run is written."""
    rng = np.random.default_rng(5)
    for head_dim in (16, 32, 64, 128):
        kb = rng.standard_normal((KEYS, head_dim)).astype(np.float32)
        qm = rng.standard_normal((3, head_dim)).astype(np.float32)
        st = np.full((2, 3 * KEYS), 7.0, np.float32)
        _scores_run(kb, qm, st, 2, 1, KEYS)
        np.testing.assert_allclose(st[1, KEYS:2 * KEYS], kb.astype(np.float64) @ qm[2], rtol=1e-5, atol=1e-5)
        assert (st[0] == 7.0).all() and (st[1, :KEYS] == 7.0).all() and (st[1, 2 * KEYS:] == 7.0).all()


@njit(cache=True)
def _scores_run(kb, qm, st, qrow, srow, o):  # pragma: no cover - compiled
    key_scores(kb, qm, st, qrow, srow, o)


def test_a_token_with_more_than_a_threads_share_of_keys_is_split_into_its_kv_heads_first():
    # decodes at 100, 3,000, 10 and 1,000 keys (4,110 in all); token 4 is no request's (-1)
    positions = np.array([99, 2999, 9, 999, 0], np.int64)
    seq_lens = np.array([100, 3000, 10, 1000], np.int32)
    owner = np.array([0, 1, 2, 3, -1], np.int64)
    whole = [[t, 1, 0, 4] for t in range(4)]  # (first token, tokens, first KV head, end KV head)
    assert plan_tasks(positions, seq_lens, 0, owner, 4, 1).tolist() == whole
    assert plan_tasks(positions, seq_lens, 0, owner, 4, 2).tolist() == (  # 3,000 x 2 > 4,110
        [[1, 1, h, h + 1] for h in range(4)] + [[0, 1, 0, 4], [2, 1, 0, 4], [3, 1, 0, 4]])
    assert plan_tasks(positions, seq_lens, 0, owner, 4, 5).tolist() == (  # 1,000 x 5 > 4,110 too
        [[1, 1, h, h + 1] for h in range(4)] + [[3, 1, h, h + 1] for h in range(4)]
        + [[0, 1, 0, 4], [2, 1, 0, 4]])
    # a window of 50 keys: every token reads 50 (token 2: 10) of 160; none has more than half
    assert plan_tasks(positions, seq_lens, 50, owner, 4, 2).tolist() == whole
    # one decode alone on 2 threads: its heads over them
    assert plan_tasks(positions[:1], seq_lens[:1], 0, owner[:1], 8, 2).tolist() == [
        [0, 1, h, h + 1] for h in range(8)]


def test_a_prompt_chunks_tokens_go_in_runs_of_adjacent_positions():
    """A chunk's tokens in runs of up to RUN_TOKENS (one request, adjacent positions, no window);
    decodes, a window, or a token past the run limit start a run of their own."""
    # request 0: a 40-token chunk at 100..139; request 1: a decode at 7; request 2: 3 tokens at 0..2
    positions = np.concatenate([np.arange(100, 140), [7], np.arange(3)]).astype(np.int64)
    seq_lens = np.array([140, 8, 3], np.int32)
    owner = np.array([0] * 40 + [1] + [2] * 3, np.int64)
    assert plan_tasks(positions, seq_lens, 0, owner, 2, 1, 16).tolist() == [
        [0, 16, 0, 2], [16, 16, 0, 2], [32, 8, 0, 2], [40, 1, 0, 2], [41, 3, 0, 2]]
    assert plan_tasks(positions, seq_lens, 0, owner, 2, 1, 1).tolist() == [[t, 1, 0, 2] for t in range(44)]
    assert plan_tasks(positions, seq_lens, 30, owner, 2, 1, 16).tolist() == [[t, 1, 0, 2] for t in range(44)]
    # a chunk deep in a long context: runs short enough that their scores stay small
    deep = np.arange(4000, 4040, dtype=np.int64)
    tasks = plan_tasks(deep, np.array([4040], np.int32), 0, np.zeros(40, np.int64), 2, 1, 16).tolist()
    assert [count for _, count, _, _ in tasks] == [2] * 20
    assert all((4000 + t + count) * count <= RUN_KEY_PAIRS for t, count, _, _ in tasks)
    # on 2 threads too, every token in exactly one task (with all its heads, or one a head)
    tasks = plan_tasks(positions, seq_lens, 0, owner, 2, 2, 16).tolist()
    assert sorted(u for t, count, h0, h1 in tasks for u in range(t, t + count) for _ in range(h0, h1)) == (
        sorted(list(range(44)) * 2))


def _a_request_a_token(positions, qsl, seq_lens, tables, scale, window):
    """The same step's tokens, each a request of its own (seeing what it saw: its keys through
    its request's table): every token then a task alone, no run."""
    owner = np.repeat(np.arange(len(seq_lens)), np.diff(qsl))
    return (positions, np.arange(len(positions) + 1, dtype=qsl.dtype),
            np.minimum(positions + 1, seq_lens[owner]).astype(seq_lens.dtype), tables[owner], scale, window)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (32, 8), (9, 3)])
def test_a_token_in_a_run_is_the_token_alone(dtype, heads, kv_heads):
    """Bit for bit: a chunk's tokens in runs (sharing each widened key) give what each token gives
    as a task alone, on one thread and on more: a prompt's numbers must not depend on how it
    was chunked or batched."""
    requests = MIXED + [(191, 40), (0, 17), (5, 33)]
    q, (k, v), _, args = _case(dtype, heads, kv_heads, 0, requests=requests, head_dim=64, seed=4)
    for threads in (1, 2):
        runs, alone = np.full_like(q, 7.0), np.full_like(q, 7.0)
        counter = task_counter(q.shape[0] * kv_heads)
        counter[1] = threads
        paged_attention_parallel(q, k, v, *args, runs, MIN_TOKENS - 1, counter)
        single = _a_request_a_token(*args)
        counter = task_counter(q.shape[0] * kv_heads)
        counter[1] = threads
        paged_attention_parallel(q, k, v, *single, alone, MIN_TOKENS - 1, counter)
        short = np.repeat(np.diff(args[1]) < MIN_TOKENS, np.diff(args[1]))  # the loop's tokens
        np.testing.assert_array_equal(runs[short], alone[short], err_msg=f"{threads} threads")


def test_a_rows_maximum_through_its_flipped_bits_is_numpys():
    """attention._row_max: the integer maximum of each float's bits flipped below the sign (a
    vector loop) is the float maximum, for rows of every length, sign and magnitude."""
    from ringserve.gpu.cpu.attention import _row_max

    @njit(cache=False)
    def row_max(row, n):
        return _row_max(row, n, np.empty(1, np.int32))

    rng = np.random.default_rng(9)
    for n in (1, 2, 15, 16, 17, 64, 161):
        for scale in (1e-30, 1.0, 1e30):
            for sign in (1.0, -1.0):
                row = (rng.standard_normal(n + 5) * scale).astype(np.float32)
                row = row if sign > 0 else -np.abs(row)
                assert row_max(row, n) == row[:n].max(), (n, scale, sign)
    row = np.array([-0.0, -1.0, -0.0, -3.0], np.float32)
    assert row_max(row, 4) == 0.0 and row_max(np.array([-2.0, -1.5], np.float32), 2) == -1.5
