"""The layout of a paged-attention test case: requests of (tokens already cached, new tokens)
packed into one super-sequence, their blocks shuffled over the pool; shared by the kernel tests
(tests/test_cuda_sim.py, tests/test_cuda_host.py, the CPU ones); and a CPU cache's values moved
into and out of its storage type (gpu/cpu/kv_dtypes.py)."""
from __future__ import annotations

import numpy as np
from numba import njit

from ringserve.gpu.cpu.kv_dtypes import kv_load, kv_store


@njit
def store_all(values, out):  # pragma: no cover - compiled
    """float32 values -> out, flat, in out's storage type (as the CPU kernels store K/V)."""
    for i in range(values.shape[0]):
        out[i] = kv_store(values[i], out)


@njit
def load_all(stored, out):  # pragma: no cover - compiled
    """Stored values (flat) -> float32 out, widened as the CPU kernels read them."""
    for i in range(stored.shape[0]):
        out[i] = kv_load(stored[i])


def paged_layout(rng, requests: list[tuple[int, int]], *, block_size: int,
                 num_blocks: int | None = None, pad: int = 0) -> dict:
    """seq_lens, block_tables (-1 past each request's blocks), positions, query_start_loc and
    slots (slot_mapping) of the requests, then `pad` graph padding rows (one token, seq_len 0,
    slot -1, table -1). num_blocks: the pool (default: what the requests hold, plus 5 spare)."""
    seq_lens = np.array([c + n for c, n in requests] + [0] * pad, np.int32)
    new = [n for _, n in requests] + [1] * pad
    if num_blocks is None:
        num_blocks = sum(-(-int(s) // block_size) for s in seq_lens) + 5
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(seq_lens), max(1, -(-int(seq_lens.max()) // block_size))), -1, np.int32)
    used = 0
    for r, s in enumerate(seq_lens):
        nb = -(-int(s) // block_size)
        tables[r, :nb] = perm[used:used + nb]
        used += nb
    positions = np.concatenate([np.arange(c, c + n) for c, n in requests]
                               + [np.zeros(pad)]).astype(np.int32)
    req = np.repeat(np.arange(len(seq_lens)), new)
    slots = np.where(seq_lens[req] > 0, tables[req, positions // block_size] * block_size
                     + positions % block_size, -1).astype(np.int32)
    return dict(seq_lens=seq_lens, block_tables=tables, positions=positions,
                query_start_loc=np.concatenate([[0], np.cumsum(new)]).astype(np.int32),
                slots=slots, num_blocks=num_blocks)


def free_before_windows(block_tables, requests: list[tuple[int, int]], *, block_size: int,
                        window: int, null: int = -1):
    """A copy of block_tables with each request's blocks wholly before its first new token's
    sliding window set to `null`, as engine/kv_cache.py frees them: a kernel must never read
    them (the tests make a read show: -1 reads a NaN guard, or null names a NaN block)."""
    tables = block_tables.copy()
    for r, (cached, _) in enumerate(requests):
        first_key = max(0, cached + 1 - window)
        tables[r, :first_key // block_size] = null
    return tables
