"""``y = x @ W.T`` on the CPU for a weight kept in its GGUF type (a QuantWeight, gpu/loader/quant.py).

Three paths by the number of token rows T, as gpu/cpu/linear.py has for float weights, measured on
the 2-core Zen 5 VM (tools/bench_quant.py, docs/bench_quant.md):

- T <= STREAM_ROWS (decode): one pass over each weight row, dequantizing each sub-block in
  registers and dotting it with the token row. The inner loop runs over the weights of 4
  sub-blocks side by side and sums into one scalar that LLVM vectorizes: 21 G weights/s for Q8_0
  on one thread, 2.3x float32 sgemv (14.7 for Q4_K's nibbles). The same loop with a literal 32 as
  its bound is fully unrolled by LLVM and then not vectorized at all (3 G/s), so every inner bound
  here is an array dimension.
- T <= SMALL_ROWS: a tile of weight rows at a time is dequantized into a float32 scratch that
  stays in L2, then a register-tiled loop (4 weight rows x 4 tokens) runs over it: each weight
  block is still read from memory once, and the tile's arithmetic is float32 FMA with each load
  used 2-4 times (beat the fused loop from T = 2 on, when it reduced per sub-block: 7.2 vs 5.0 G
  w/s for Q4_K).
- beyond: dequantize up to WIDEN_FLOATS weights into a scratch and hand it to BLAS sgemm.

Products and sums are float32, like the float path; the weight is ``scale * q + offset``
as gguf-py computes it (FMA contraction may round that once instead of twice), so the result is
gguf-py's ``dequantize`` followed by a matmul, within float32 rounding. ``parallel`` splits the
weight rows over Numba's threads (BLAS threads for the sgemm path are the caller's setting).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ringserve.gpu.cpu.kernels import FASTMATH
from ringserve.gpu.cpu.linear import TASKS_PER_THREAD, linear, per_thread
from ringserve.gpu.loader.quant import QuantWeight

STREAM_ROWS = 1          # up to this many token rows: dequantize in registers, one pass per weight row
SMALL_ROWS = 64          # up to this many: dequantized tiles (65 G MAC/s vs sgemm's 49 at 64; even at 128)
TILE_FLOATS = 64 * 1024  # float32 scratch per task for the dequantized tile (256 KB: stays in L2)
WIDEN_FLOATS = 4 << 20   # weights dequantized per sgemm call (16 MB of float32)

_F16_SCALE = np.float32(2.0 ** 112)  # half bits << 13 read as float32, times 2^112 = the half's value


# ---- per-kind inner loops (chosen at compile time by the quants' dtype) --------------------------

def _stream(x, q, s, m, out, lo, hi):
    """out[:, lo:hi] = x @ W[lo:hi].T, dequantizing W in registers."""


def _dequant(q, s, m, lo, w):
    """w[r] = W[lo + r] as float32, for r < w.shape[0]."""


@njit(inline="always")
def _half(h):  # pragma: no cover - compiled
    """IEEE half bits (uint16) -> float32, exactly (normals, subnormals, inf, nan); vectorizes."""
    bits = np.uint32(np.uint32(h) & np.uint32(0x7FFF)) << np.uint32(13)
    f = np.uint32(bits).view(np.float32) * _F16_SCALE
    if (np.uint32(h) & np.uint32(0x7C00)) == np.uint32(0x7C00):  # inf / nan: keep the payload
        f = np.uint32(bits | np.uint32(0x7F800000)).view(np.float32)
    return -f if np.uint32(h) & np.uint32(0x8000) else f


@njit(inline="always")
def _i8_by_1(x3, q3, s, m, out, lo, hi):  # pragma: no cover - compiled
    for n in range(lo, hi):
        for t in range(x3.shape[0]):
            acc = np.float32(0.0)
            for b in range(q3.shape[1]):
                sb, mb = s[n, b], m[n, b]
                part = np.float32(0.0)
                for j in range(q3.shape[2]):
                    part += x3[t, b, j] * (sb * np.float32(q3[n, b, j]) + mb)
                acc += part
            out[t, n] = acc


@njit(inline="always")
def _i8_by_2(x4, q4, s, m, out, lo, hi):  # pragma: no cover - compiled
    for n in range(lo, hi):
        for t in range(x4.shape[0]):
            acc = np.float32(0.0)
            for g in range(q4.shape[1]):
                s0, s1, m0, m1 = s[n, 2 * g], s[n, 2 * g + 1], m[n, 2 * g], m[n, 2 * g + 1]
                part = np.float32(0.0)
                for j in range(q4.shape[3]):
                    part += (x4[t, g, 0, j] * (s0 * np.float32(q4[n, g, 0, j]) + m0)
                             + x4[t, g, 1, j] * (s1 * np.float32(q4[n, g, 1, j]) + m1))
                acc += part
            out[t, n] = acc


@njit(inline="always")
def _i8_by_4(x4, q4, s, m, out, lo, hi):  # pragma: no cover - compiled
    for n in range(lo, hi):
        for t in range(x4.shape[0]):
            acc = np.float32(0.0)
            for g in range(q4.shape[1]):
                b = 4 * g
                s0, s1, s2, s3 = s[n, b], s[n, b + 1], s[n, b + 2], s[n, b + 3]
                m0, m1, m2, m3 = m[n, b], m[n, b + 1], m[n, b + 2], m[n, b + 3]
                part = np.float32(0.0)
                for j in range(q4.shape[3]):
                    part += (x4[t, g, 0, j] * (s0 * np.float32(q4[n, g, 0, j]) + m0)
                             + x4[t, g, 1, j] * (s1 * np.float32(q4[n, g, 1, j]) + m1)
                             + x4[t, g, 2, j] * (s2 * np.float32(q4[n, g, 2, j]) + m2)
                             + x4[t, g, 3, j] * (s3 * np.float32(q4[n, g, 3, j]) + m3))
                acc += part
            out[t, n] = acc


def _stream_i8(x, q, s, m, out, lo, hi):  # pragma: no cover - compiled
    t_n, k = x.shape
    nb = s.shape[1]
    bs = k // nb  # NOTE: a runtime bound; a literal 32 gets the loop unrolled and never vectorized
    # PERF: the per-reduction cost, not the dequantization, bounds this loop: one vectorized
    # reduction per 4 sub-blocks of 32 (19.6 G w/s; per sub-block: 13.1), per 2 of 16 (12 vs 8.4;
    # per 4 of 16: 9.6). Constant indices on a 4-D view: an index like b + 1 keeps Numba's
    # negative-index check in the inner loop, which costs the vectorization.
    if bs >= 32 and nb % 4 == 0:
        _i8_by_4(x.reshape((t_n, nb // 4, 4, bs)), q.reshape((q.shape[0], nb // 4, 4, bs)), s, m, out, lo, hi)
    elif nb % 2 == 0:
        _i8_by_2(x.reshape((t_n, nb // 2, 2, bs)), q.reshape((q.shape[0], nb // 2, 2, bs)), s, m, out, lo, hi)
    else:
        _i8_by_1(x.reshape((t_n, nb, bs)), q.reshape((q.shape[0], nb, bs)), s, m, out, lo, hi)


@njit(inline="always")
def _u4_by_1(x4, p3, s, m, out, lo, hi):  # pragma: no cover - compiled
    for n in range(lo, hi):
        for t in range(x4.shape[0]):
            acc = np.float32(0.0)
            for g in range(p3.shape[1]):
                s0, s1, m0, m1 = s[n, 2 * g], s[n, 2 * g + 1], m[n, 2 * g], m[n, 2 * g + 1]
                part = np.float32(0.0)
                for j in range(p3.shape[2]):  # byte j: weight 64g + j (low nibble), 64g + 32 + j (high)
                    v = p3[n, g, j]
                    part += (x4[t, g, 0, j] * (s0 * np.float32(v & np.uint8(15)) + m0)
                             + x4[t, g, 1, j] * (s1 * np.float32(v >> np.uint8(4)) + m1))
                acc += part
            out[t, n] = acc


@njit(inline="always")
def _u4_by_2(x5, p4, s, m, out, lo, hi):  # pragma: no cover - compiled
    for n in range(lo, hi):
        for t in range(x5.shape[0]):
            acc = np.float32(0.0)
            for g in range(p4.shape[1]):
                b = 4 * g
                s0, s1, s2, s3 = s[n, b], s[n, b + 1], s[n, b + 2], s[n, b + 3]
                m0, m1, m2, m3 = m[n, b], m[n, b + 1], m[n, b + 2], m[n, b + 3]
                part = np.float32(0.0)
                for j in range(p4.shape[3]):
                    v, u = p4[n, g, 0, j], p4[n, g, 1, j]
                    part += (x5[t, g, 0, 0, j] * (s0 * np.float32(v & np.uint8(15)) + m0)
                             + x5[t, g, 0, 1, j] * (s1 * np.float32(v >> np.uint8(4)) + m1)
                             + x5[t, g, 1, 0, j] * (s2 * np.float32(u & np.uint8(15)) + m2)
                             + x5[t, g, 1, 1, j] * (s3 * np.float32(u >> np.uint8(4)) + m3))
                acc += part
            out[t, n] = acc


def _stream_u4(x, q, s, m, out, lo, hi):  # pragma: no cover - compiled
    t_n, k = x.shape
    ng = k // 64
    # PERF: two 64-weight groups per reduction when they pair up (13.3 G w/s; one: 10.9)
    if ng % 2 == 0:
        x5, p4 = x.reshape((t_n, ng // 2, 2, 2, 32)), q.reshape((q.shape[0], ng // 2, 2, 32))
        _u4_by_2(x5, p4, s, m, out, lo, hi)
    else:
        _u4_by_1(x.reshape((t_n, ng, 2, 32)), q.reshape((q.shape[0], ng, 32)), s, m, out, lo, hi)


def _stream_f16(x, q, s, m, out, lo, hi):  # pragma: no cover - compiled
    t_n, k = x.shape
    for n in range(lo, hi):
        for t in range(t_n):
            acc = np.float32(0.0)
            for j in range(k):
                acc += x[t, j] * _half(q[n, j])
            out[t, n] = acc


def _dequant_i8(q, s, m, lo, w):  # pragma: no cover - compiled
    nb = s.shape[1]
    bs = q.shape[1] // nb
    q3 = q.reshape((q.shape[0], nb, bs))
    w3 = w.reshape((w.shape[0], nb, bs))
    for r in range(w.shape[0]):
        n = lo + r
        for b in range(nb):
            sb, mb = s[n, b], m[n, b]
            for j in range(bs):
                w3[r, b, j] = sb * np.float32(q3[n, b, j]) + mb


def _dequant_u4(q, s, m, lo, w):  # pragma: no cover - compiled
    ng = w.shape[1] // 64
    p3 = q.reshape((q.shape[0], ng, 32))
    w4 = w.reshape((w.shape[0], ng, 2, 32))
    half = p3.shape[2]
    for r in range(w.shape[0]):
        n = lo + r
        for g in range(ng):
            s0, m0, s1, m1 = s[n, 2 * g], m[n, 2 * g], s[n, 2 * g + 1], m[n, 2 * g + 1]
            # PERF: low and high nibbles in two loops (12 G/s); one loop writing both: 4 G/s
            for j in range(half):
                w4[r, g, 0, j] = s0 * np.float32(p3[n, g, j] & np.uint8(15)) + m0
            for j in range(half):
                w4[r, g, 1, j] = s1 * np.float32(p3[n, g, j] >> np.uint8(4)) + m1


def _dequant_f16(q, s, m, lo, w):  # pragma: no cover - compiled
    for r in range(w.shape[0]):
        for j in range(w.shape[1]):
            w[r, j] = _half(q[lo + r, j])


_KINDS = {types.int8: (_stream_i8, _dequant_i8), types.uint8: (_stream_u4, _dequant_u4),
          types.uint16: (_stream_f16, _dequant_f16)}


@overload(_stream, inline="always")
def _stream_overload(x, q, s, m, out, lo, hi):
    return _KINDS[q.dtype][0]


@overload(_dequant, inline="always")
def _dequant_overload(q, s, m, lo, w):
    return _KINDS[q.dtype][1]


# ---- drivers, shared by every kind ---------------------------------------------------------------

@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def _tiles(x, w, out, rows):  # noqa: C901 - one fused loop nest on purpose  # pragma: no cover
    """out[:, :rows] = x @ w[:rows].T for a dequantized float32 tile w (L2-resident), in register
    tiles of 4 weight rows x 4 tokens (16 accumulators: 2 FMAs a load), then 4 x 2 and 4 x 1 for
    the tokens left over. (gpu/cpu/linear.py's 4 x 2 tiles: 4.5 against 6.1 G w/s at 8 tokens.)"""
    num_tokens, k_dim = x.shape
    n = 0
    while n + 4 <= rows:
        t = 0
        while t + 4 <= num_tokens:
            a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
            a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
            for k in range(k_dim):
                x0, x1, x2, x3 = x[t, k], x[t + 1, k], x[t + 2, k], x[t + 3, k]
                w0, w1, w2, w3 = w[n, k], w[n + 1, k], w[n + 2, k], w[n + 3, k]
                a00 += x0 * w0
                a01 += x0 * w1
                a02 += x0 * w2
                a03 += x0 * w3
                a10 += x1 * w0
                a11 += x1 * w1
                a12 += x1 * w2
                a13 += x1 * w3
                a20 += x2 * w0
                a21 += x2 * w1
                a22 += x2 * w2
                a23 += x2 * w3
                a30 += x3 * w0
                a31 += x3 * w1
                a32 += x3 * w2
                a33 += x3 * w3
            out[t, n], out[t, n + 1], out[t, n + 2], out[t, n + 3] = a00, a01, a02, a03
            out[t + 1, n], out[t + 1, n + 1], out[t + 1, n + 2], out[t + 1, n + 3] = a10, a11, a12, a13
            out[t + 2, n], out[t + 2, n + 1], out[t + 2, n + 2], out[t + 2, n + 3] = a20, a21, a22, a23
            out[t + 3, n], out[t + 3, n + 1], out[t + 3, n + 2], out[t + 3, n + 3] = a30, a31, a32, a33
            t += 4
        if t + 2 <= num_tokens:
            a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
            for k in range(k_dim):
                x0, x1 = x[t, k], x[t + 1, k]
                w0, w1, w2, w3 = w[n, k], w[n + 1, k], w[n + 2, k], w[n + 3, k]
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
            t += 2
        if t < num_tokens:
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for k in range(k_dim):
                x0 = x[t, k]
                a0 += x0 * w[n, k]
                a1 += x0 * w[n + 1, k]
                a2 += x0 * w[n + 2, k]
                a3 += x0 * w[n + 3, k]
            out[t, n], out[t, n + 1], out[t, n + 2], out[t, n + 3] = a0, a1, a2, a3
        n += 4
    for i in range(n, rows):  # fewer than 4 rows left: one at a time
        for t in range(num_tokens):
            acc = np.float32(0.0)
            for k in range(k_dim):
                acc += x[t, k] * w[i, k]
            out[t, i] = acc


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def _quant_rows(x, q, s, m, out, lo, hi, tile):  # pragma: no cover - compiled
    """out[:, lo:hi] for weight rows lo..hi; tile: this task's float32 scratch [rows, in]."""
    if x.shape[0] <= STREAM_ROWS:
        _stream(x, q, s, m, out, lo, hi)
        return
    r = tile.shape[0]
    for n0 in range(lo, hi, r):
        cnt = min(r, hi - n0)
        _dequant(q, s, m, n0, tile[:cnt])
        _tiles(x, tile, out[:, n0:n0 + cnt], cnt)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def _small(x, q, s, m, out, tiles):  # pragma: no cover - compiled
    _quant_rows(x, q, s, m, out, 0, out.shape[1], tiles[0])


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", parallel=True)
def _small_parallel(x, q, s, m, out, tiles):  # pragma: no cover - compiled
    n, tasks = out.shape[1], tiles.shape[0]
    for i in prange(tasks):
        _quant_rows(x, q, s, m, out, i * n // tasks, (i + 1) * n // tasks, tiles[i])


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def _widen(q, s, m, lo, w):  # pragma: no cover - compiled
    _dequant(q, s, m, lo, w)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", parallel=True)
def _widen_parallel(q, s, m, lo, w, tasks):  # pragma: no cover - compiled
    rows = w.shape[0]
    for i in prange(tasks):
        a, b = i * rows // tasks, (i + 1) * rows // tasks
        _dequant(q, s, m, lo + a, w[a:b])


# ---- entry point ---------------------------------------------------------------------------------

def _buffer(shape: tuple[int, ...]) -> np.ndarray:
    return per_thread(("quant float32", shape), lambda: np.empty(shape, dtype=np.float32))


_ZERO = np.zeros((1, 1), dtype=np.float32)


def _planes(w: QuantWeight) -> tuple[np.ndarray, np.ndarray]:
    """scale and offset (a stride-0 zero plane when the type has none: no branch in the loops,
    and + 0.0 is exact), as the kernels take them."""
    n = w.shape[0]
    nb = 1 if w.scale is None else w.scale.shape[1]
    zeros = np.broadcast_to(_ZERO, (n, nb))
    scale = zeros if w.scale is None else w.scale
    offset = zeros if w.offset is None else w.offset
    return scale, offset


def tile_rows(k: int) -> int:
    """Weight rows dequantized per tile: TILE_FLOATS in all, a multiple of 4 (cpu_linear's tiles)."""
    return max(4, min(64, TILE_FLOATS // k // 4 * 4))


def quant_linear(x: np.ndarray, w: QuantWeight, out: np.ndarray | None = None, *,
                 parallel: bool = False) -> np.ndarray:
    """x float32 [T, in] (C-contiguous), W packed [out, in] -> float32 [T, out] (``x @ W.T``)."""
    if w.kind in ("f32", "bf16"):
        return linear(x, w.q, out, parallel=parallel)
    x = np.ascontiguousarray(x)  # NOTE: the kernels reshape x into sub-blocks (a no-op when it is)
    t = x.shape[0]
    n, k = w.shape
    if out is None:
        out = np.empty((t, n), dtype=np.float32)
    scale, offset = _planes(w)
    tasks = TASKS_PER_THREAD * numba.get_num_threads() if parallel else 1
    if t <= SMALL_ROWS:
        tiles = _buffer((tasks, tile_rows(k), k))
        if parallel:
            _small_parallel(x, w.q, scale, offset, out, tiles)
        else:
            _small(x, w.q, scale, offset, out, tiles)
        return out
    chunk = max(64, WIDEN_FLOATS // k)
    scratch = _buffer((min(chunk, n), k))
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        wide = scratch[:hi - lo]
        if parallel:
            _widen_parallel(w.q, scale, offset, lo, wide, tasks)
        else:
            _widen(w.q, scale, offset, lo, wide)
        np.matmul(x, wide.T, out=out[:, lo:hi])
    return out
