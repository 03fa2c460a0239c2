"""Linear layers on the CPU: ``y = x @ W.T`` for a weight W [out, in] kept float32 or bfloat16.

A decode step multiplies a handful of token rows by every weight of the model: it is bound by
the bandwidth at which W streams from memory, not by arithmetic. OpenBLAS's sgemv reaches about
half the machine's read bandwidth there, and its sgemm with 2..64 rows is slower still (measured
on the 2-core Zen 5 VM: 30 layers of gate_up with 8 rows, 56 ms vs 27 ms here). So up to
STREAM_ROWS rows a Numba loop streams each weight row once, dotting it with every token row while
it sits in L1; up to SMALL_ROWS it works in 4-row x 2-token tiles; beyond, BLAS sgemm.

bfloat16 weights (an option; float32 is the default) are stored as their upper 16 bits in
uint16 and widened on the fly (``bits << 16`` is exact), halving the bytes a decode step reads;
products and sums stay float32. For many rows, bf16 weights are widened a chunk at a time into a
float32 scratch and handed to sgemm.
"""
from __future__ import annotations

import threading
from typing import Callable, Hashable, TypeVar

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ringserve.gpu.bfloat16 import widen_bfloat16
from ringserve.gpu.cpu.kernels import FASTMATH

STREAM_ROWS = 4       # up to this many token rows: one pass per weight row
SMALL_ROWS = 64       # up to this many: 4-row x 2-token tiles (faster than sgemm here); beyond: BLAS
TASKS_PER_THREAD = 4  # weight-row ranges per thread: evens out a thread that starts late
WIDEN_ROWS = 4096     # bf16 weight rows widened per sgemm call (scratch of WIDEN_ROWS * in floats)

_T = TypeVar("_T")
_per_thread = threading.local()


def per_thread(key: Hashable, make: Callable[[], _T]) -> _T:
    """The calling thread's scratch for key, made once and reused by every later call: a fresh
    array per call would page-fault on every step (the kernels' tiles). A key must come from a
    bounded set (weight shapes); scratch that scales with a step's token rows is per_thread_rows'."""
    cache = _per_thread.__dict__.setdefault("scratch", {})
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
    return value


def per_thread_rows(key: Hashable, rows: int, make: Callable[[int], _T], size: Callable[[_T], int],
                    head: Callable[[_T, int], _T]) -> _T:
    """head(scratch, rows): the first `rows` token rows of the calling thread's scratch for key,
    which is made anew only when a step brings more rows than any before it.
    NOTE: one per key, not one per row count: a server runs steps of every count up to
    max_num_batched_tokens, and a scratch kept for each (int8 rows, keyed by T) grew by ~2 GB
    on the 1B shape's two widths (tests/test_int8_kernels.py). PERF: the last head is kept (a
    decode step asks for the same rows ~70 times; slicing four arrays was ~1/3 of a batch-1
    linear's Python time), and dropped with the scratch it views."""
    cache = _per_thread.__dict__.setdefault("scratch", {})
    entry = cache.get(key)
    if entry is None or size(entry[0]) < rows:
        scratch = make(rows)
        entry = cache[key] = [scratch, rows, head(scratch, rows)]
    elif entry[1] != rows:
        entry[1], entry[2] = rows, head(entry[0], rows)
    return entry[2]




def _load(w, n, k):
    """Weight w[n, k] as float32 (compiled per weight dtype by the overload below)."""


@overload(_load, inline="always")
def _load_overload(w, n, k):
    if w.dtype == types.uint16:  # bfloat16 bits: the upper half of a float32
        return lambda w, n, k: np.uint32(np.uint32(w[n, k]) << 16).view(np.float32)
    return lambda w, n, k: w[n, k]


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def _rows(x, w, out, lo, hi):  # noqa: C901  # pragma: no cover - compiled
    """out[:, lo:hi] for weight rows lo..hi."""
    num_tokens, k_dim = x.shape
    n = lo
    if num_tokens > STREAM_ROWS:
        # Tiles of 4 weight rows x 2 tokens: 8 accumulators, each loaded value used 2-4 times,
        # so that more tokens stay cheaper than BLAS's small-matrix path (measured to 64 rows).
        while n + 4 <= hi:
            for t in range(0, num_tokens - 1, 2):
                a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
                for k in range(k_dim):
                    x0, x1 = x[t, k], x[t + 1, k]
                    w0, w1 = _load(w, n, k), _load(w, n + 1, k)
                    w2, w3 = _load(w, n + 2, k), _load(w, n + 3, k)
                    a00 += x0 * w0
                    a01 += x0 * w1
                    a02 += x0 * w2
                    a03 += x0 * w3
                    a10 += x1 * w0
                    a11 += x1 * w1
                    a12 += x1 * w2
                    a13 += x1 * w3
                out[t, n], out[t, n + 1], out[t, n + 2], out[t, n + 3] = a00, a01, a02, a03
                out[t + 1, n], out[t + 1, n + 1], out[t + 1, n + 2], out[t + 1, n + 3] = a10, a11, a12, a13
            if num_tokens % 2:
                t = num_tokens - 1
                for i in range(n, n + 4):
                    acc = np.float32(0.0)
                    for k in range(k_dim):
                        acc += x[t, k] * _load(w, i, k)
                    out[t, i] = acc
            n += 4
    # Few tokens (and leftover rows): stream each weight row once, dotting it with every token.
    for i in range(n, hi):
        for t in range(num_tokens):
            acc = np.float32(0.0)
            for k in range(k_dim):
                acc += x[t, k] * _load(w, i, k)
            out[t, i] = acc


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def _small(x, w, out):  # pragma: no cover - compiled
    _rows(x, w, out, 0, w.shape[0])


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", parallel=True)
def _small_parallel(x, w, out, tasks):  # pragma: no cover - compiled
    n = w.shape[0]
    for i in prange(tasks):
        _rows(x, w, out, i * n // tasks, (i + 1) * n // tasks)


def linear(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None, *,
           parallel: bool = False) -> np.ndarray:
    """x float32 [T, in] (C-contiguous), w float32 or bf16 bits [out, in] -> float32 [T, out].

    parallel: split the streaming kernel over Numba's threads (BLAS threads for many rows
    are set apart, by the caller)."""
    t = x.shape[0]
    if out is None:
        out = np.empty((t, w.shape[0]), dtype=np.float32)
    bf16 = w.dtype == np.uint16
    if t <= SMALL_ROWS:
        if parallel:
            _small_parallel(x, w, out, TASKS_PER_THREAD * numba.get_num_threads())
        else:
            _small(x, w, out)
    elif not bf16:
        np.matmul(x, w.T, out=out)
    else:
        for lo in range(0, w.shape[0], WIDEN_ROWS):
            hi = min(w.shape[0], lo + WIDEN_ROWS)
            out[:, lo:hi] = x @ widen_bfloat16(np, w[lo:hi]).T
    return out
