"""gpu/cpu_attention.py: the BLAS path for long prefill chunks computes what the Numba loop
computes, for every request shape a step can hold, and `attention` sends each request to one."""
from __future__ import annotations

import numpy as np
import pytest

from ringserve.gpu import cpu_attention as ca
from ringserve.gpu.cpu_kv_dtypes import KV_CACHE_DTYPES
from test_kv_cache_dtypes import _load_all, _store_all

BLOCK = 16


def _step(rng, requests, heads=9, kv_heads=3, dim=64, dtype="float32"):
    """A step of (cached, new) requests over a shuffled paged cache: attention's arguments,
    with the cache in `dtype` storage and its float32 values."""
    blocks_per = [-(-(c + n) // BLOCK) for c, n in requests]
    num_blocks = sum(blocks_per) + 3
    wide = [rng.standard_normal((num_blocks, BLOCK, kv_heads, dim)).astype(np.float32) for _ in "kv"]
    stored = []
    for w in wide:
        s = np.empty(w.shape, KV_CACHE_DTYPES[dtype])
        if dtype == "float32":
            s[...] = w
        else:  # rounded to the storage type; `wide` then holds the values it reads back
            _store_all(w.ravel(), s.reshape(-1))
            _load_all(s.reshape(-1), w.reshape(-1))
        stored.append(s)
    order = rng.permutation(num_blocks)
    tables = np.zeros((len(requests), max(blocks_per)), np.int32)
    at = 0
    for r, n in enumerate(blocks_per):
        tables[r, :n] = order[at:at + n]
        at += n
    positions = np.concatenate([np.arange(c, c + n) for c, n in requests]).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in requests])]).astype(np.int32)
    seq_lens = np.array([c + n for c, n in requests], np.int32)
    q = rng.standard_normal((len(positions), heads, dim)).astype(np.float32)
    return q, stored, wide, positions, qsl, seq_lens, tables


def _numba_only(q, k, v, positions, qsl, seq_lens, tables, scale):
    out = np.full_like(q, np.nan)
    skip_none = np.zeros(len(seq_lens), np.bool_)
    ca.paged_attention(q, k, v, positions, qsl, seq_lens, tables, scale, out, skip_none)
    return out


# (cached tokens, new tokens) per request: a long prompt's chunk after a cached prefix, across
# two query tiles (300 > 256), beside decodes and a short prefill the Numba loop keeps
CASES = {"chunk after prefix": [(700, 300)], "first chunk": [(0, 512)],
         "mixed step": [(37, 1), (0, 40), (1500, 100), (5, 1), (90, 400)]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES)
def test_blas_path_matches_the_numba_loop(case, dtype):
    _matches_the_numba_loop(case, dtype)


def test_small_score_budgets_tile_a_chunk_finely(monkeypatch):
    """At long contexts a tile holds fewer query tokens (ca.SCORES_BUDGET): tiles of 1 and 7."""
    for budget in (3 * 1000, 7 * 3 * 1000):
        monkeypatch.setattr(ca, "SCORES_BUDGET", budget)
        _matches_the_numba_loop("chunk after prefix", "float32")


def _matches_the_numba_loop(case, dtype):
    rng = np.random.default_rng(len(case))
    q, (k, v), _, positions, qsl, seq_lens, tables = _step(rng, CASES[case], dtype=dtype)
    scale = np.float32(0.125)
    want = _numba_only(q, k, v, positions, qsl, seq_lens, tables, scale)
    got = np.full_like(q, np.nan)
    ca.attention(q, k, v, positions, qsl, seq_lens, tables, scale, got)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_attention_sends_long_chunks_to_blas_and_the_rest_to_numba(monkeypatch):
    """Which request takes which path: a long chunk BLAS, decodes and short prefills Numba
    (the rows each path leaves alone stay NaN when the other is disabled)."""
    rng = np.random.default_rng(0)
    q, (k, v), _, positions, qsl, seq_lens, tables = _step(rng, CASES["mixed step"])
    out = np.full_like(q, np.nan)
    monkeypatch.setattr(ca, "blas_attention", lambda *a, **kw: None)
    ca.attention(q, k, v, positions, qsl, seq_lens, tables, np.float32(0.125), out)
    done = ~np.isnan(out).any(axis=(1, 2))
    per_request = [bool(done[a:b].all()) for a, b in zip(qsl[:-1], qsl[1:], strict=True)]
    assert per_request == [True, True, False, True, False]  # (1500, 100) and (90, 400) are BLAS's
    assert not done[qsl[2]:qsl[3]].any() and not done[qsl[4]:qsl[5]].any()


def test_blas_path_is_causal_and_reads_only_the_requests_blocks():
    """Against attention written out in float64 from the unpaged keys: each query sees keys up
    to its own position, through its own block table only."""
    rng = np.random.default_rng(7)
    cached, new = 200, 100
    q, (k, v), _, positions, qsl, seq_lens, tables = _step(rng, [(cached, new), (0, 50)])
    scale = np.float32(0.125)
    got = np.full_like(q, np.nan)
    ca.attention(q, k, v, positions, qsl, seq_lens, tables, scale, got)
    L = cached + new
    rows = np.arange(L)
    keys = k[tables[0, rows // BLOCK], rows % BLOCK].astype(np.float64)    # [L, KVH, D]
    values = v[tables[0, rows // BLOCK], rows % BLOCK].astype(np.float64)
    for t in range(new):
        p = cached + t
        for h in range(q.shape[1]):
            s = keys[:p + 1, h // 3] @ q[t, h].astype(np.float64) * float(scale)
            w = np.exp(s - s.max())
            want = (w / w.sum()) @ values[:p + 1, h // 3]
            np.testing.assert_allclose(got[t, h], want, rtol=1e-4, atol=1e-5)
