"""``y = x @ W.T`` with int8 activations and AVX-512 VNNI integer dot products (llama.cpp's CPU path).

gpu/cpu/quant_kernels.py dequantizes each weight to float32 and multiplies in float32: 16
multiply-adds an instruction, so its kernels are bound by arithmetic (12-21 G weights/s a thread
at batch 1, ~50-65 G multiply-adds/s at batch 16-64), not by memory. Here each token row is
quantized to int8 in blocks of 32 (one float32 scale a block, as llama.cpp's q8 activations),
and ``vpdpbusd`` multiplies 64 unsigned weight bytes by 64 signed activation bytes into 16 int32
sums in one instruction.

The weights are gpu/loader/quant.py's planes, moved once at load into tiles of 16 rows (Int8Weight):
one 512-bit vector holds 4 weights of each of 16 rows, so one ``vpdpbusd`` against 4 activation
bytes broadcast to every lane advances all 16 rows, and a sub-block's vectors sum in int32 with
no float work in between. The float work (one convert, a scale multiply, two multiply-adds) is
then per 16 rows and sub-block, a sixteenth of a per-row kernel's. The quants are unsigned:

- ``u4`` (nibbles in 64-weight groups): an AND each takes a vector of bytes' low nibbles (the
  weights 0..15) and its high ones in place (16 times the weights: their sub-block's scale is
  taken a sixteenth, _second_half_scale);
- ``i8`` (centred int8): stored as ``q + 128`` (0..255); the ``-128 * sum(x)`` this adds is folded
  into the sub-block's offset term below;
- ``u6`` (6-bit quants, ``q + 32``: 0..63; Q6_K and the other types whose quants fit 6 bits): the
  low 4 bits as a ``u4`` nibble plane and the high 2 as a plane of 2-bit fields, unpacked by
  ``_u6_vectors`` (a shift and an AND-OR a vector) to bytes 0..63: 0.75 bytes a weight, not 1.

For a sub-block of ``b`` weights (16 or 32) with weight = ``s * (u - z) + m`` (z = 128 for i8, 32
for u6, 0 for u4) and an activation block ``x = dx * xq``::

    sum(w * x) = s * dx * sum(u * xq) + (m - z * s) * (dx * sum(xq))

The integer sums are exact; so the result equals ``dequantize(W) @ (dx * xq).T`` within float32
rounding (tests/test_int8_kernels.py checks it in float64), and differs from the float32 path
by the activations' int8 rounding, as llama.cpp's does. DeviceConfig ``cpu_activation_dtype``
chooses the path (docs/bench_quant.md has the measurements).

Q4_K, Q5_K and Q6_K (int8 sub-block factors under a float d and dmin per 256 weights) take
activations in blocks of 256 instead (SuperRows, llama.cpp's q8_K): the factors then multiply the exact
integer sums and the float work is once per 256 weights and token (_super_codegen): Q6_K's tiles
23-28 % faster at 16-512 token rows on two threads, Q4_K's 5-16 % (docs/bench_quant.md). The rounding is
llama.cpp's for those types (docs/quality.md measures what it costs).

The kernel is LLVM IR written here (a Numba ``@intrinsic``): LLVM does not form ``vpdpbusd``
from a Numba loop. It exists only on a CPU with AVX-512 VNNI (``has_vnni``); elsewhere the
float kernels run. On a CPU with AMX-INT8, gpu/cpu/amx_kernels.py multiplies the same tiles for
many token rows with ``tdpbsud`` and this module's float epilogue (``float_terms``): the same
result, bit for bit (its ``tiles_linear`` is what the model calls).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ringserve.gpu.cpu.linear import per_thread_rows
from ringserve.gpu.cpu.tasks import claim, linear_tasks
from ringserve.gpu.loader.quant import QK_K, QuantWeight

TILE_ROWS = 16           # weight rows a tile: one int32 lane each in a 512-bit register
ACT_BLOCK = 32           # activation weights per int8 scale (llama.cpp's q8_0 / q8_1)
STEP = 64                # weights of a row per loop step (16 vectors of int8, 8 of nibbles)
TOKEN_TILE = 8           # token rows sharing each loaded weight vector (then 4, then 1-3 left over)
# The int8 token rows a block of TOKEN_TILE tiles holds (_run): the row tiles then stream past
# activations in L2, not L3 (512 rows of the 1B shape's 2,048 are 1 MB, of 8,192 4 MB). PERF:
# the 1B shape's linears at 512 rows, two threads: 373-375 -> 359-363 ms for 4 layers (gate_up
# -5 %; blocks of 64 or 128 KB alike), docs/bench_forward.md
TOKEN_BLOCK_BYTES = 256 << 10
# A parallel driver quantizes its activations over the threads from this many values (a prompt
# step's: 128 rows of 2,048 are ~80 us on one thread, 0.3 ns a value; a fork and join is 10-20 us)
PARALLEL_QUANTIZE_VALUES = 1 << 18


class Prefetch(NamedTuple):
    """Software prefetches for a kind's weight lines: one for every `every`-th 64-byte vector the
    kernel loads, `ahead` bytes past it, with llvm.prefetch's `locality` (3: prefetcht0, into L1;
    2: prefetcht1, into L2)."""
    every: int
    ahead: int
    locality: int


# The prefetches each kind's weight loads carry (_prefetch): PREFETCHES in every kernel but the
# few-token ones of a streaming driver (a large matrix at batch 1-4: int8_linear), which take
# STREAM_PREFETCHES[kind] = (most token rows, prefetches) where a kind has one. PERF, AMD EPYC
# Zen 4 VM, two threads, the matrices from DRAM against a plain read of the same bytes in the same
# minute (docs/bench_forward.md, "Prefetches for a streamed matrix"): with one prefetch a line
# 8 KB ahead the 1B shape's Q4_K matrices at one token read 19-31 GB/s where the plain read took
# 25-52, its Q6_K 15-31 against 26-57. The kernel's unpacking and sums keep the core's own window
# of loads short, so the loads do not overlap the work unless asked for early: u4 reads +15-40 %
# faster with one prefetcht1 every fourth line 16 KB ahead (the hardware prefetchers fill the
# rest; lost at 2-4 tokens), u6 +10-35 % at 1-4 tokens with every line into L2 16 KB ahead and
# into L1 1 KB ahead. Small matrices (the default model's, 0.3-1 MB) keep PREFETCHES: their
# claimed tasks of 20-70 KB start mostly inside the first 16 KB the far prefetches skip, and the
# default model's batch-1 step went 5.6 -> 6.1 ms with them. Tiles of TOKEN_TILE tokens (batch
# 16, prefill) are bound by their arithmetic.
PREFETCHES = {"i8": (Prefetch(1, 8192, 3),), "u6": (Prefetch(1, 8192, 2),), "u4": (Prefetch(1, 8192, 3),)}
STREAM_PREFETCHES = {"u6": (4, (Prefetch(1, 16384, 2), Prefetch(1, 1024, 3))),
                     "u4": (1, (Prefetch(4, 16384, 2),))}
STREAM_MIN_BYTES = 2 << 20   # a matrix this large or larger streams (int8_linear, parallel only)
INT8_KINDS = ("i8", "u4")
# Types whose quants all fit 6 bits (-32..31 centred, or 0..31): tiled as u6, 0.75 B/weight, not 1
U6_TYPES = ("Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q3_K", "Q2_K")
U6_CENTRE = 32           # the u6 bytes hold q + 32
ZERO_POINTS = {"i8": 128, "u6": U6_CENTRE, "u4": 0}       # the tile's byte = q + zero point
VECTORS = {"i8": 16, "u6": 12, "u4": 8}                   # 64-byte vectors a 64-weight step
# K-quants whose tiles take activations in blocks of 256 (SuperRows, _super_codegen): the types of
# the Q4_K_M / Q5_K_M / Q6_K files people run. Int8 activations cost their perplexity 0.37-0.49 %
# that way (0.25-0.39 % in blocks of 32; llama.cpp's own on the Q4_K file 0.46 %); Q3_K's and
# Q2_K's 0.78 % and 1.80 % (0.42 %, 0.92 %), so those keep blocks of 32 (docs/quality.md).
SUPER_BLOCK_TYPES = ("Q4_K", "Q5_K", "Q6_K")

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


@functools.cache
def has_vnni() -> bool:
    """This CPU runs AVX-512 VNNI (and BW for the byte shuffles): the only place these kernels exist."""
    import llvmlite.binding as llvm
    features = set(llvm.get_host_cpu_features().flatten().split(","))
    return {"+avx512vnni", "+avx512bw", "+avx512f"} <= features


def supports(w: QuantWeight) -> bool:
    """A weight these kernels multiply: an integer kind in whole 16-row tiles of 64-weight steps."""
    return (w.kind in INT8_KINDS and w.shape[0] % TILE_ROWS == 0 and w.shape[1] % STEP == 0
            and w.block in (16, 32))


# ---- activations ---------------------------------------------------------------------------------

class Int8Rows(NamedTuple):
    """Token rows x [T, K] as int8 blocks of 32: x ~= scale * q, blockwise."""
    q: np.ndarray       # int8 [T, K]
    scale: np.ndarray   # float32 [T, K / 32]: dx = max|x| / 127 of the block
    sum16: np.ndarray   # float32 [T, K / 16]: dx * sum(q) over each 16 (offset terms of 16-weight sub-blocks)
    sum32: np.ndarray   # float32 [T, K / 32]: the same over each 32

    def head(self, t: int) -> Int8Rows:
        """The first t token rows (views: C-contiguous, as the kernels take them)."""
        return Int8Rows(*(a[:t] for a in self))


def scratch_rows(t: int, k: int) -> Int8Rows:
    """The calling thread's Int8Rows for t token rows of width k (reused across steps)."""
    return per_thread_rows(("int8 rows", k), t, lambda n: _empty_rows(n, k), lambda r: len(r.q),
                           Int8Rows.head)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _amax(bits, top):  # pragma: no cover - compiled
    """max |x| of a block of float32 read as its int32 bits (x.view(np.int32)); top: an int32
    scratch of one. PERF: the sign bit cleared, the bits of non-negative floats order as their
    values, and an integer max is a vector loop, where a float max (no fast-math: NaN) stayed a
    scalar chain. With 1-D slices for the loops (below), blocks of 256 took 1.1 -> 0.3 ns a value
    on Zen 4, blocks of 32 0.95 -> 0.8 (the same int8 values and scales, bit for bit)."""
    m = np.int32(0)
    for j in range(bits.shape[0]):
        m = max(m, bits[j] & np.int32(0x7FFFFFFF))
    top[0] = m
    return top.view(np.float32)[0]


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _quantize(x, q, scale, sum16, sum32):  # pragma: no cover - compiled
    bits, top = x.view(np.int32), np.empty(1, np.int32)
    divs = np.empty(x.shape[1], np.float32)  # each value's block divisor: one flat loop a row
    for t in range(x.shape[0]):
        xr, qr = x[t], q[t]  # NOTE: 1-D rows indexed from 0: LLVM vectorizes what x[t, j] kept scalar
        for b in range(scale.shape[1]):
            d = _amax(bits[t, b * ACT_BLOCK:(b + 1) * ACT_BLOCK], top) / np.float32(127.0)
            scale[t, b] = d
            # NOTE: a division, not a multiply by 1 / d: that overflows to inf for a subnormal d
            div = d if d > 0 else np.float32(1.0)
            for j in range(b * ACT_BLOCK, (b + 1) * ACT_BLOCK):  # NOTE: a loop, not a slice
                divs[j] = div  # assignment, which the parallel drivers' parfor pass would split
        for j in range(xr.shape[0]):
            v = xr[j] / divs[j]
            # NOTE: round half away from zero, as llama.cpp's roundf (|v| <= 127: no overflow)
            qr[j] = np.int32(v + np.copysign(np.float32(0.5), v))
        for b in range(scale.shape[1]):
            s0 = s1 = np.int32(0)
            for j in range(16):
                s0 += np.int32(qr[b * ACT_BLOCK + j])
                s1 += np.int32(qr[b * ACT_BLOCK + 16 + j])
            d = scale[t, b]
            sum16[t, 2 * b] = d * np.float32(s0)
            sum16[t, 2 * b + 1] = d * np.float32(s1)
            sum32[t, b] = d * np.float32(s0 + s1)


class SuperRows(NamedTuple):
    """Token rows x [T, K] as int8 blocks of 256 (llama.cpp's q8_K, what its K-quant kernels
    take): x ~= scale * q, one scale per 256 weights, so the K-quants' integer sub-block factors
    apply to the int32 sums and the float work is one step per 256 weights and token (_super_codegen).
    sums: int32 [T, 3 K / (2 sub)] for the weight's sub-blocks of `sub` weights: the first K / sub
    hold -z * sum(q) over each (z the tile's zero point: the sums' starting value); after them
    sum(q) of each as int16 (``half_sums``, the same bytes: int16 [T, 3 K / sub], from 2 K / sub),
    two sub-blocks a 32-bit word, what `vpdpwssd` multiplies by the minimums' factors."""
    q: np.ndarray          # int8 [T, K]
    scale: np.ndarray      # float32 [T, K / 256]
    sums: np.ndarray       # int32 [T, 3 K / (2 sub)]
    half_sums: np.ndarray  # sums' bytes as int16

    def head(self, t: int) -> SuperRows:
        return SuperRows(*(a[:t] for a in self))


def super_scratch_rows(t: int, k: int, sub: int) -> SuperRows:
    """The calling thread's SuperRows for t token rows of width k, sub-blocks of sub."""
    return per_thread_rows(("super rows", k, sub), t, lambda n: _empty_super_rows(n, k, sub),
                           lambda r: len(r.q), SuperRows.head)


def _empty_super_rows(t: int, k: int, sub: int) -> SuperRows:
    sums = np.empty((t, k // sub + k // (2 * sub)), np.int32)
    return SuperRows(np.empty((t, k), np.int8), np.empty((t, k // QK_K), np.float32), sums,
                     sums.view(np.int16))


def quantize_super_rows(x: np.ndarray, sub: int, zero_point: int) -> SuperRows:
    """float32 [T, K] (K a multiple of 256) -> its int8 blocks of 256 (what int8_linear multiplies
    K-quant tiles by)."""
    t, k = x.shape
    rows = _empty_super_rows(t, k, sub)
    _quantize_super(np.ascontiguousarray(x, dtype=np.float32), *rows, sub, zero_point)
    return rows


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _quantize_super(x, q, scale, sums, half_sums, sub, zero_point):  # pragma: no cover - compiled
    halves = 2 * (x.shape[1] // sub)  # where sum(q) begins in half_sums (int16) units
    bits, top = x.view(np.int32), np.empty(1, np.int32)
    for t in range(x.shape[0]):
        for b in range(scale.shape[1]):
            lo = b * QK_K
            xb, qb = x[t, lo:lo + QK_K], q[t, lo:lo + QK_K]  # NOTE: 1-D slices, as _quantize's
            d = _amax(bits[t, lo:lo + QK_K], top) / np.float32(127.0)
            div = d if d > 0 else np.float32(1.0)  # NOTE: a division, as _quantize's
            # PERF: one flat loop (vectorized), then the sub-blocks' sums from q (in L1): the sums
            # inside it made it a loop of sub-blocks, twice the time
            for j in range(QK_K):
                v = xb[j] / div  # NOTE: round half away from zero, as _quantize's
                qb[j] = np.int32(v + np.copysign(np.float32(0.5), v))
            for i in range(QK_K // sub):
                total = np.int32(0)
                for j in range(sub):
                    total += np.int32(qb[i * sub + j])
                sums[t, lo // sub + i] = -zero_point * total
                half_sums[t, halves + lo // sub + i] = np.int16(total)  # |total| <= 256 * 127: an int16
            scale[t, b] = d


@njit(inline="always")
def _quantize_split(x, q, scale, sum16, sum32, counter):  # pragma: no cover - compiled
    """_quantize in a parallel driver: its rows over counter[1] threads where x holds
    PARALLEL_QUANTIZE_VALUES or more (else on the calling thread, as every row's own)."""
    if x.size < PARALLEL_QUANTIZE_VALUES or counter[1] < 2:
        _quantize(x, q, scale, sum16, sum32)
        return
    n, parts = x.shape[0], counter[1]
    for i in prange(parts):
        lo, hi = i * n // parts, (i + 1) * n // parts
        _quantize(x[lo:hi], q[lo:hi], scale[lo:hi], sum16[lo:hi], sum32[lo:hi])


@njit(inline="always")
def _quantize_super_split(x, q, scale, sums, half_sums, sub, zero_point, counter):  # pragma: no cover
    """_quantize_super in a parallel driver, as _quantize_split."""
    if x.size < PARALLEL_QUANTIZE_VALUES or counter[1] < 2:
        _quantize_super(x, q, scale, sums, half_sums, sub, zero_point)
        return
    n, parts = x.shape[0], counter[1]
    for i in prange(parts):
        lo, hi = i * n // parts, (i + 1) * n // parts
        _quantize_super(x[lo:hi], q[lo:hi], scale[lo:hi], sums[lo:hi], half_sums[lo:hi], sub, zero_point)


def _empty_rows(t: int, k: int) -> Int8Rows:
    return Int8Rows(np.empty((t, k), np.int8), np.empty((t, k // ACT_BLOCK), np.float32),
                    np.empty((t, k // 16), np.float32), np.empty((t, k // ACT_BLOCK), np.float32))


def quantize_rows(x: np.ndarray) -> Int8Rows:
    """float32 [T, K] (K a multiple of 32) -> its int8 blocks (what int8_linear multiplies)."""
    rows = _empty_rows(*x.shape)
    _quantize(np.ascontiguousarray(x, dtype=np.float32), *rows)
    return rows


# ---- weights in 16-row tiles ---------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Int8Weight:
    """A QuantWeight of an integer kind laid out for ``vpdpbusd``: 16 weight rows side by side.

    ``q`` is uint8 [out / 16, in / 64 * V * 64] (held 2-D, one tile a row: what the kernel takes),
    read as [out / 16, in / 64, V, 16, 4]: tile r, 64-weight step g, vector v holds 4
    bytes of each of the tile's 16 rows (one int32 lane a row), so one ``vpdpbusd`` against 4
    activation bytes broadcast to every lane advances 16 rows by 4 weights, and a sub-block's
    vectors sum in int32 before any float work: one convert and two multiply-adds per 16 rows
    and sub-block, not per row. ``i8``: V = 16, byte = q + 128 (unsigned); ``u4``: V = 8, each
    byte's low nibble is weight 64g + 4v + j and its high nibble weight 64g + 32 + 4v + j (the
    u4 plane's bytes, moved); ``u6``: V = 12, bytes q + 32 (0..63) split as vectors 0-7 the low 4
    bits in the u4 layout and vectors 8-11 the high 2 bits (u6_step_vectors, unpack_u6).
    ``scale`` / ``offset``: [out / 16, in / block * 16], read as [out / 16, in / block, 16],
    float32 or, where every value is one exactly (the legacy types'
    scales are GGUF f16 fields), IEEE half bits (uint16): 1/16 byte a weight instead of 1/8 for
    each plane, widened in the kernel (``vcvtph2ps``, exact); or, for the K-quants, their int8
    sub-block factors (sc; m) with ``scale_super`` / ``offset_super`` [out / 16, in / 256, 16]
    (d; -dmin) as half bits (GGUF's own f16 fields: always exact; float32 where one is not):
    llama.cpp's compact form, 1/32 (Q4_K) or 1/16 (Q6_K) byte a weight a plane plus one half
    per 256 weights, and the same float32 values (``factor * super`` is gpu/loader/quant.py's
    exact ``d * sc``)."""

    qtype: str
    shape: tuple[int, int]
    kind: str                    # "i8" | "u4" | "u6": how the bytes hold the quants
    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    block: int
    scale_super: np.ndarray | None = None    # [out / 16, in / 256 * 16] half bits or float32: K-quants' d
    offset_super: np.ndarray | None = None   # their -dmin

    @functools.cached_property
    def nbytes(self) -> int:  # NOTE: cached: int8_linear asks on every call (the planes never change)
        return sum(a.nbytes for a in self.planes() if a is not None)

    def planes(self) -> tuple:
        return self.q, self.scale, self.offset, self.scale_super, self.offset_super

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def rows(self, index: np.ndarray) -> QuantWeight:
        """W[index] back in gpu/loader/quant.py's layout (an embedding lookup of a tied table)."""
        tile, lane = np.divmod(np.asarray(index), TILE_ROWS)
        steps = self.q.reshape(len(self.q), -1, VECTORS[self.kind], TILE_ROWS, 4)
        q = steps[tile, :, :, lane]   # [len, in / 64, V, 4]: each row's step vectors
        kind = "u4" if self.kind == "u4" else "i8"
        if self.kind == "u6":  # NOTE: back as centred int8 (gpu/loader/quant.py's own u6 is another order)
            q = (unpack_u6(q).astype(np.int16) - U6_CENTRE).astype(np.int8)
        elif self.kind == "i8":
            q = (q ^ np.uint8(0x80)).view(np.int8)
        q = q.reshape(len(tile), -1)

        def plane(a: np.ndarray) -> np.ndarray:
            values = a.reshape(len(a), -1, TILE_ROWS)[tile, :, lane]
            return values.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else values
        scale, offset, scale_super, offset_super = (None if a is None else plane(a)
                                                    for a in self.planes()[1:])
        return QuantWeight(self.qtype, (len(tile), self.shape[1]), kind, np.ascontiguousarray(q),
                           scale, offset, self.block, scale_super, offset_super)


def u6_step_vectors(q: np.ndarray) -> np.ndarray:
    """int8 quants that fit 6 bits [rows, in] -> each row's u6 step vectors [rows, in / 64, 12, 4]:
    with u = q + 32 (0..63) and weight 64 g + 4 i + j at [g, i, j] (i = 0..15), vector v < 8
    byte j holds u[v, j] & 15 in its low nibble and u[8 + v, j] & 15 in its high one (the u4
    layout), and vector 8 + h byte j the high 2 bits of u[4 c + h, j] at bits 2c, c = 0..3."""
    n, k = q.shape
    u = (q.astype(np.int16) + U6_CENTRE).astype(np.uint8).reshape(n, k // STEP, 16, 4)
    nibbles = (u[:, :, :8] & 15) | ((u[:, :, 8:] & 15) << 4)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1, 1)
    high = np.bitwise_or.reduce((u >> 4).reshape(n, k // STEP, 4, 4, 4) << shifts, axis=2)
    return np.concatenate([nibbles, high], axis=2)


def unpack_u6(vectors: np.ndarray) -> np.ndarray:
    """u6 step vectors [..., 12, 4] -> the step's bytes 0..63 [..., 16, 4] (u6_step_vectors
    undone: what _u6_vectors does in the kernel, in numpy)."""
    nibbles, high = vectors[..., :8, :], vectors[..., 8:, :]
    low = np.concatenate([nibbles & 15, nibbles >> 4], axis=-2)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1, 1)
    top = (high[..., None, :, :] >> shifts) & 3                    # [..., c, h, 4]: vector 4 c + h
    return low | (top.reshape(low.shape) << 4)


def tiles(w: QuantWeight, *, six_bit: bool = True) -> Int8Weight:
    """w's planes in 16-row tiles (supports(w)); six_bit: U6_TYPES as u6 (else int8 bytes)."""
    assert supports(w) and w.scale is not None
    n, k = w.shape
    kind = "u6" if six_bit and w.kind == "i8" and w.qtype in U6_TYPES else w.kind
    if kind == "u6":
        q = u6_step_vectors(w.q)
    elif kind == "i8":
        q = w.q.view(np.uint8) ^ np.uint8(0x80)
    else:
        q = w.q
    q = q.reshape(n // TILE_ROWS, TILE_ROWS, k // STEP, VECTORS[kind], 4)

    # NOTE: both planes in one dtype (the kernel reads them alike); half only where it is exact
    # (never int8 factors: they stay bytes)
    half = w.scale_super is None and all(_exact_half(a) for a in (w.scale, w.offset) if a is not None)

    # the super planes (d; -dmin: GGUF f16 fields, so always exact) likewise, on their own
    half_super = all(_exact_half(a) for a in (w.scale_super, w.offset_super) if a is not None)

    def planes(a: np.ndarray | None, as_half: bool) -> np.ndarray | None:
        if a is None:
            return None
        a = a.astype(np.float16).view(np.uint16) if as_half else a
        tiled = a.reshape(n // TILE_ROWS, TILE_ROWS, -1).transpose(0, 2, 1)
        return np.ascontiguousarray(tiled).reshape(n // TILE_ROWS, -1)
    scale = planes(w.scale, half)
    assert scale is not None
    q = np.ascontiguousarray(q.transpose(0, 2, 3, 1, 4)).reshape(n // TILE_ROWS, -1)
    return Int8Weight(w.qtype, w.shape, kind, q, scale, planes(w.offset, half), w.block,
                      planes(w.scale_super, half_super), planes(w.offset_super, half_super))


def _exact_half(a: np.ndarray) -> bool:
    with np.errstate(over="ignore"):  # NOTE: past 65504 a half is inf: inexact, so kept float32
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


# ---- the tile kernel, in LLVM IR -----------------------------------------------------------------

def _vec(ty: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(ty, n)


def _row_ptr(context, builder, aty, val, row):
    """Byte pointer to element [row, 0] of a 2-D array (its strides are in bytes)."""
    ary = context.make_array(aty)(context, builder, val)
    stride = builder.extract_value(ary.strides, 0)
    return builder.gep(builder.bitcast(ary.data, _I8.as_pointer()), [builder.mul(row, stride)])


def _load(builder, ptr, index, ty: ir.Type):
    """The index-th ty after a byte pointer (unaligned)."""
    return builder.load(builder.gep(builder.bitcast(ptr, ty.as_pointer()), [index]), align=1)


def _splat(builder, value, n: int):
    v = builder.insert_element(ir.Constant(_vec(value.type, n), ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), [0] * n))


def _const(builder, index: int):
    return ir.Constant(_I64, index)


def _function(builder, name: str, fnty: ir.FunctionType):
    fn = builder.module.globals.get(name)
    return fn if fn is not None else ir.Function(builder.module, fnty, name)


def _prefetch(builder, ptr, index, ty: ir.Type, kind: str, vector: int, tokens: int, stream: bool) -> None:
    """The prefetches of the index-th ty after ptr, the step's vector-th weight vector, in a
    kernel of `tokens` token rows (llvm.prefetch, read): PREFETCHES[kind], or in a streaming
    driver's kernel STREAM_PREFETCHES[kind] up to its token count. A weight streams once, in
    order: the hardware prefetchers ramp up anew for every matrix and stop at page ends."""
    fn = _function(builder, "llvm.prefetch.p0i8", ir.FunctionType(ir.VoidType(), [
        _I8.as_pointer(), _I32, _I32, _I32]))
    line = builder.bitcast(builder.gep(builder.bitcast(ptr, ty.as_pointer()), [index]), _I8.as_pointer())
    most, streamed = STREAM_PREFETCHES.get(kind, (0, ()))
    plan = streamed if stream and tokens <= most else PREFETCHES[kind]
    for every, ahead, locality in plan:
        if vector % every == 0:
            builder.call(fn, [builder.gep(line, [_const(builder, ahead)]), ir.Constant(_I32, 0),
                              ir.Constant(_I32, locality), ir.Constant(_I32, 1)])


def _weight_vectors(builder, kind: str, qtile, g, tokens: int, stream: bool) -> Iterable[tuple[Any, int]]:
    """Step g's weight vectors (16 rows x 4 weights, unsigned bytes), each with the offset in
    the step of its first weight (which activation bytes it meets). u4's high nibbles stay where
    they are, 16 times their value: the step's second half sums 16 times over, and its scales
    are taken a sixteenth (_second_half_scale). PERF: an AND, not a byte shift and an AND: x86
    has no byte shift, and LLVM's gf2p8affineqb takes a vpdpbusd slot (_word_shift)."""
    v64b = _vec(_I8, 64)
    if kind == "i8":
        first = builder.mul(g, _const(builder, 16))
        out = []
        for v in range(16):
            at = builder.add(first, _const(builder, v))
            _prefetch(builder, qtile, at, v64b, kind, v, tokens, stream)
            out.append((_load(builder, qtile, at, v64b), 4 * v))
        return out
    if kind == "u6":
        first = builder.mul(g, _const(builder, 12))
        packed = []
        for v in range(12):
            at = builder.add(first, _const(builder, v))
            _prefetch(builder, qtile, at, v64b, kind, v, tokens, stream)
            packed.append(_load(builder, qtile, at, v64b))
        return ((vec, 4 * u) for u, vec in enumerate(_u6_vectors(builder, packed[:8], packed[8:])))
    low, out = ir.Constant(v64b, [15] * 64), []
    first = builder.mul(g, _const(builder, 8))
    for v in range(8):
        at = builder.add(first, _const(builder, v))
        _prefetch(builder, qtile, at, v64b, kind, v, tokens, stream)
        packed = _load(builder, qtile, at, v64b)
        out.append((builder.and_(packed, low), 4 * v))
        out.append((builder.and_(packed, ir.Constant(v64b, [0xF0] * 64)), 32 + 4 * v))
    return out


def _u6_vectors(builder, nibbles: list, highs: list) -> Iterator[Any]:
    """A u6 step's 16 byte vectors (vector u: weights 4u..4u + 3 of the 16 rows, bytes 0..63) from
    its 8 nibble vectors and 4 vectors of high bits (u6_step_vectors' layout; unpack_u6 in numpy).
    Per vector: the nibble (an AND, or a shift and an AND) and the high bits moved to bits 4-5 (a
    shift; none for c = 2) merged by an AND-OR (vpternlogd): ~3 instructions per 4 vpdpbusd at
    TOKEN_TILE tokens. A generator: each vector's IR is emitted as the caller takes it, beside
    its vpdpbusd (PERF: 16 unpacked vectors made at once spill registers)."""
    v64b = _vec(_I8, 64)

    def splat(value: int):
        return ir.Constant(v64b, [value] * 64)
    for u in range(16):
        c, h = divmod(u, 4)
        packed = nibbles[u % 8]
        low = builder.and_(packed if u < 8 else _word_shift(builder, "lshr", packed, 4), splat(15))
        high = highs[h]  # bits 2c..2c + 1 of each byte: weight vector u's high bits, to bits 4-5
        if c < 2:
            high = _word_shift(builder, "shl", high, 4 - 2 * c)
        elif c == 3:
            high = _word_shift(builder, "lshr", high, 2)
        yield builder.or_(low, builder.and_(high, splat(0x30)))


def _word_shift(builder, op: str, vec, bits: int):
    """A 64-byte vector shifted as 32 words (vpsllw / vpsrlw): the bits crossing from the next
    byte are the caller's to mask off. PERF: a byte shift (there is no such instruction) becomes
    gf2p8affineqb, which takes the pipes vpdpbusd runs on (a vpdpbusd's slot each on Zen 4);
    word shifts run beside them (`python -m ringserve.tools.vnni_peak --beside all`)."""
    words = _vec(_I16, 32)
    shifted = getattr(builder, op)(builder.bitcast(vec, words), ir.Constant(words, [bits] * 32))
    return builder.bitcast(shifted, vec.type)


def _second_half_scale(builder, kind: str | None, sb: int, subs: int, value):
    """Sub-block sb's scale (or factor), 16 rows as float32, for sums of kind's _weight_vectors
    (None: another unpacking's, amx_kernels'): u4's second half sums 16 times over, so its
    scale is taken a sixteenth. Exact (a power of two): each product is the same float32 as the
    shifted nibbles', bit for bit (unless scale * dx is subnormal), and 16 x its sum converts
    exactly (|16 isum| <= 16 x 32 x 15 x 127 < 2^24)."""
    if kind != "u4" or sb < subs // 2:
        return value
    return builder.fmul(value, ir.Constant(value.type, [1 / 16] * 16))


def _int_sums(builder, vectors, xbase, block: int, start: list[list[Any]] | None = None,
              done: Callable[[int, list[Any]], None] | None = None) -> list[list[Any]]:
    """[token][sub-block] int32 sums of the step: one vpdpbusd per weight vector and token, the
    activation's 4 bytes broadcast to the 16 lanes; from start[token][sub-block] (else 0).
    done(sub-block, its sums a token) is called as each sub-block's last vector is in."""
    v16i, v64b = _vec(_I32, 16), _vec(_I8, 64)
    vpdpbusd = _function(builder, "llvm.x86.avx512.vpdpbusd.512", ir.FunctionType(v16i, [v16i, v64b, v64b]))
    sums: list[list[Any]] = start or [[ir.Constant(v16i, [0] * 16)] * (STEP // block) for _ in xbase]
    left = [block // 4] * (STEP // block)  # vectors still to come, a sub-block
    for vec, at in vectors:
        sb = at // block
        for t, base in enumerate(xbase):
            x4 = builder.load(builder.gep(base, [_const(builder, at // 4)]), align=1)
            x4 = builder.bitcast(_splat(builder, x4, 16), v64b)
            sums[t][sb] = builder.call(vpdpbusd, [sums[t][sb], vec, x4])
        left[sb] -= 1
        if done is not None and not left[sb]:
            done(sb, [row[sb] for row in sums])
    return sums


def _scale_loader(form: str):
    """IR loading sub-block ``index``'s 16 row scales (or offsets) of a plane as float32. form:
    "f32"; "f16" (half bits); "i8" (int8 factors: the caller multiplies by the super plane)."""
    v16f = _vec(_F32, 16)

    def load(builder, tile, index):
        if form == "f32":
            return _load(builder, tile, index, v16f)
        if form == "i8":  # NOTE: vpmovsxbd + vcvtdq2ps: exact (6-bit or int8 factors)
            return builder.sitofp(_load(builder, tile, index, _vec(_I8, 16)), v16f)
        bits = _load(builder, tile, index, _vec(ir.IntType(16), 16))
        return builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), 16)), v16f)  # NOTE: vcvtph2ps, exact
    return load


def _plane_reader(form: str, super_form: str):
    """IR reading the 16 rows' scale and offset (None without one) of a sub-block as float32,
    for planes of one form (_scale_loader) and (form "i8") super planes of super_form ("f32",
    "f16"): step_planes(builder, tiles, g) -> at(index), tiles the scale, offset, and super
    planes' pointers, g the 64-weight step."""
    load_plane, load_super = _scale_loader(form), _scale_loader(super_form)

    def step_planes(builder, tiles, g):
        stile, mtile, sstile, mstile = tiles
        supers: list[Any] = [None, None]
        if sstile is not None:  # the 16 rows' d (and -dmin) of the super-block the step is in
            sup = builder.udiv(g, _const(builder, QK_K // STEP))
            supers = [load_super(builder, t, sup) if t is not None else None for t in (sstile, mstile)]

        def at(index):
            values = []
            for tile, factor in zip((stile, mtile), supers, strict=True):
                v = None if tile is None else load_plane(builder, tile, index)
                # NOTE: sc * d, no fast-math: the same float32 product as the float planes' d * sc
                values.append(v if v is None or factor is None else builder.fmul(v, factor))
            return values
        return at
    return step_planes


def float_terms(builder, form: str, super_form: str, planes, g, sums, totals, drow, srow, block: int,
                zero_point: float, vectors_kind: str | None = None):
    """totals[t] + step g's float terms for token t, from its int32 sums[t][sub-block]: the one
    float epilogue of the int8 kernels (VNNI here, AMX in gpu/cpu/amx_kernels.py). The same IR in
    the same order after the sums, so both kernels round alike, bit for bit: an output must not
    depend on how many tokens a step holds. planes: the scale, offset and super planes' tile
    pointers (None where absent), of _plane_reader's forms form and super_form; drow / srow:
    each token's activation scales and block sums. vectors_kind: the kind whose _weight_vectors
    gave the sums (None: another unpacking's, AMX's), for _second_half_scale."""
    # NOTE: contract (fused multiply-adds), not fast: with reassociation LLVM ordered the terms by
    # the shape of the code around them, and a 1-token kernel rounded unlike a 4-token one
    subs, v16f, flags = STEP // block, _vec(_F32, 16), ["contract"]
    plane_at = _plane_reader(form, super_form)(builder, planes, g)
    totals = list(totals)
    for sb in range(subs):
        index = builder.add(builder.mul(g, _const(builder, subs)), _const(builder, sb))
        scale, offset = plane_at(index)  # the 16 rows' scales (and offsets)
        # (m - z s): the offset term's factor per row, and the zero point of unsigned int8
        mz = builder.fmul(scale, ir.Constant(v16f, [-zero_point] * 16), flags=flags)
        if offset is not None:
            mz = builder.fadd(mz, offset, flags=flags)
        act = builder.udiv(builder.mul(index, _const(builder, block)), _const(builder, ACT_BLOCK))
        scale = _second_half_scale(builder, vectors_kind, sb, subs, scale)  # NOTE: after mz: unscaled there
        for t in range(len(totals)):
            dx = _splat(builder, _load(builder, drow[t], act, _F32), 16)
            part = builder.fmul(builder.sitofp(sums[t][sb], v16f), builder.fmul(scale, dx, flags=flags),
                                flags=flags)
            totals[t] = builder.fadd(totals[t], part, flags=flags)
            if offset is not None or zero_point:  # + (m - z s) * dx * sum(xq)
                xsum = _splat(builder, _load(builder, srow[t], index, _F32), 16)
                totals[t] = builder.fadd(totals[t], builder.fmul(mz, xsum, flags=flags), flags=flags)
    return totals


def _tile_frame(body, tokens: int, per_loop: int):
    """A tile kernel's IR around its loop body: the weight tile's and planes' pointers, each
    token's rows, a loop over the row's K / per_loop iterations summing a vector of 16 outputs per
    token, and the stores: out[t0 + t, 16 r: 16 r + 16] for t < tokens. body(builder, i, acc,
    qtile, planes, token_rows, k) -> acc + iteration i's terms, leaving the builder in the loop's
    last block (_tile_typing's arguments: q, s, m, ss, ms, xq, xd, xs, out, r, t0, ...)."""
    v16f = _vec(_F32, 16)

    def codegen(context, builder, sig, args):
        q, (xq, xd, xs, out, r, t0) = args[0], args[5:11]
        qty, (xqty, xdty, xsty, outty) = sig.args[0], sig.args[5:9]
        k = builder.extract_value(context.make_array(xqty)(context, builder, xq).shape, 1)
        qtile = _row_ptr(context, builder, qty, q, r)
        # the scale, offset and super planes' tiles (None where absent)
        planes = tuple(None if aty == types.none else _row_ptr(context, builder, aty, a, r)
                       for aty, a in zip(sig.args[1:5], args[1:5], strict=True))
        rows = [builder.add(t0, _const(builder, t)) for t in range(tokens)]

        def per_token(aty, a):
            return [_row_ptr(context, builder, aty, a, i) for i in rows]
        token_rows = per_token(xqty, xq), per_token(xdty, xd), per_token(xsty, xs)
        orow = per_token(outty, out)

        entry = builder.block
        loop = builder.append_basic_block("tile_loop")
        done = builder.append_basic_block("tile_done")
        builder.branch(loop)
        builder.position_at_end(loop)
        i = builder.phi(_I64)
        i.add_incoming(_const(builder, 0), entry)
        acc = [builder.phi(v16f) for _ in range(tokens)]
        totals = body(builder, i, acc, qtile, planes, token_rows, k)
        for a, total in zip(acc, totals, strict=True):
            a.add_incoming(ir.Constant(v16f, [0.0] * 16), entry)
            a.add_incoming(total, builder.block)
        i_next = builder.add(i, _const(builder, 1))
        i.add_incoming(i_next, builder.block)
        count = builder.udiv(k, _const(builder, per_loop))
        builder.cbranch(builder.icmp_unsigned("<", i_next, count), loop, done)

        builder.position_at_end(done)
        for o, total in zip(orow, totals, strict=True):
            dst = builder.gep(o, [builder.mul(r, _const(builder, TILE_ROWS * 4))])
            builder.store(total, builder.bitcast(dst, v16f.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _tile_codegen(kind: str, block: int, tokens: int, form: str, super_form: str, stream: bool):
    """IR for: out[t0 + t, 16 r: 16 r + 16] = W[16 r: 16 r + 16] . x[t0 + t] for t < tokens, a
    64-weight step a loop iteration. form: the scale planes' (_scale_loader); "i8" reads the super
    planes too, of super_form."""
    zero_point = float(ZERO_POINTS[kind])

    def step(builder, g, acc, qtile, planes, token_rows, k):
        xrow, drow, srow = token_rows
        xbase = [builder.bitcast(builder.gep(x, [builder.mul(g, _const(builder, STEP))]), _I32.as_pointer())
                 for x in xrow]
        sums = _int_sums(builder, _weight_vectors(builder, kind, qtile, g, tokens, stream), xbase, block)
        return float_terms(builder, form, super_form, planes, g, sums, list(acc), drow, srow, block,
                           zero_point, kind)
    return _tile_frame(step, tokens, STEP)


def _super_codegen(kind: str, block: int, tokens: int, super_form: str, stream: bool):
    """IR for the K-quant tiles (int8 factors) against SuperRows, as _tile_codegen's, a super-block
    of 256 weights (4 steps) a loop iteration. With one activation scale per super-block, the
    sub-block factors sc (and minimums m) multiply the exact integer sums inside it, and the
    float scales once per super-block::

        sum(w * x) = d * dx * sum_sb sc_sb sum(u_sb * xq_sb - z xq_sb) - dmin * dx * sum_sb m_sb sum(xq_sb)

    the zero point's part is the vpdpbusd sums' starting value (-z sum(xq), SuperRows.sums):
    no instruction. Per sub-block and token a convert and a fused multiply-add (and half a
    `vpdpwssd` for the minimums), against float_terms' four; per super-block and token two or
    three: ``(d * S + (-dmin) * M) * dx`` (S and M the scaled and the minimums' sums)."""
    def super_block(builder, sup, acc, qtile, planes, token_rows, k):
        return _super_block(builder, kind, block, super_form, qtile, planes, token_rows, sup, k, acc, stream)
    return _tile_frame(super_block, tokens, QK_K)


def _super_block(builder, kind: str, block: int, super_form: str, qtile, planes, token_rows, sup, k,
                 totals: list, stream: bool) -> list:
    """totals[t] + super-block sup's terms for each token (_super_codegen): its 4 steps' integer
    sums scaled by the sub-block factors in float32 (a loop: one step's IR, as _tile_codegen's),
    then the minimums' sum, d and -dmin, and dx once. Leaves the builder in the block after the
    loop."""
    v16f, flags = _vec(_F32, 16), ["contract"]  # NOTE: fused multiply-adds, no reassociation (float_terms)
    stile, mtile, sstile, mstile = planes
    xrow, drow, srow = token_rows
    subs, zero_point = STEP // block, ZERO_POINTS[kind]
    load_factor, load_super = _scale_loader("i8"), _scale_loader(super_form)
    zero = ir.Constant(v16f, [0.0] * 16)

    def add(total, a, b):
        return builder.fadd(total, builder.fmul(a, b, flags=flags), flags=flags)

    before = builder.block
    step = builder.append_basic_block("super_step")
    flush = builder.append_basic_block("super_flush")
    builder.branch(step)
    builder.position_at_end(step)
    i = builder.phi(_I64)
    i.add_incoming(_const(builder, 0), before)
    scaled_in = [builder.phi(v16f) for _ in srow]    # sum_sb sc_sb * isum_sb, a token's, as float32
    scaled = list(scaled_in)
    g = builder.add(builder.mul(sup, _const(builder, QK_K // STEP)), i)
    xbase = [builder.bitcast(builder.gep(x, [builder.mul(g, _const(builder, STEP))]), _I32.as_pointer())
             for x in xrow]
    indices = [builder.add(builder.mul(g, _const(builder, subs)), _const(builder, sb)) for sb in range(subs)]
    start = None if not zero_point else [
        [_splat(builder, _load(builder, row, index, _I32), 16) for index in indices] for row in srow]

    # PERF: a sub-block's terms as soon as its sums are done (the same adds in the same order):
    # at 8 tokens and sub-blocks of 16 (Q6_K), the step's 32 int32 sums all live at once spilled
    # registers. (Summing sc * isum in int32, vpmulld, one convert a super-block: no faster.)
    def scale(sb: int, done: list) -> None:
        factor = _second_half_scale(builder, kind, sb, subs, load_factor(builder, stile, indices[sb]))
        for t, isum in enumerate(done):
            scaled[t] = add(scaled[t], builder.sitofp(isum, v16f), factor)
    vectors = _weight_vectors(builder, kind, qtile, g, len(srow), stream)
    _int_sums(builder, vectors, xbase, block, start, scale)
    for phi, value in zip(scaled_in, scaled, strict=True):
        phi.add_incoming(zero, before)
        phi.add_incoming(value, step)
    i_next = builder.add(i, _const(builder, 1))
    i.add_incoming(i_next, step)
    builder.cbranch(builder.icmp_unsigned("<", i_next, _const(builder, QK_K // STEP)), step, flush)

    builder.position_at_end(flush)
    # PERF: the minimums' terms (sum_sb m_sb * sum(xq_sb)) need no weight quant: summed here, after
    # the loop, they keep no accumulator per token live beside the loop's int32 sums (at 8 tokens a
    # tile those filled the 32 vector registers), and in integers: a vpdpwssd takes two sub-blocks
    # (the 6-bit factors widened to int16 pairs, once for all tokens; sum(xq) pairs from
    # SuperRows), 4 a super-block and token against 8 float multiply-adds. Exact: the same value
    # the float sums had (every product and partial sum an integer under 2^24).
    mins = []
    if mtile is not None:
        v16i, v32b, v32w = _vec(_I32, 16), _vec(_I8, 32), _vec(_I16, 32)
        vpdpwssd = _function(builder, "llvm.x86.avx512.vpdpwssd.512",
                             ir.FunctionType(v16i, [v16i, v16i, v16i]))
        half_sums = builder.udiv(k, _const(builder, block))  # where they begin in a SuperRows.sums row
        # the plane holds each sub-block's 16 rows apart: [row 0: sb 2p, sb 2p + 1; row 1: ...]
        interleave = ir.Constant(_vec(_I32, 32), [i // 2 + 16 * (i % 2) for i in range(32)])
        ints = [ir.Constant(v16i, [0] * 16) for _ in srow]
        for p in range(QK_K // block // 2):
            # pair p of the super-block: the m plane's 32-byte unit, the int16 sums' 32-bit word
            pair = builder.add(builder.mul(sup, _const(builder, QK_K // block // 2)), _const(builder, p))
            two = _load(builder, mtile, pair, v32b)
            factors = builder.bitcast(builder.sext(builder.shuffle_vector(two, two, interleave), v32w), v16i)
            for t, row in enumerate(srow):
                xsums = _splat(builder, _load(builder, row, builder.add(half_sums, pair), _I32), 16)
                ints[t] = builder.call(vpdpwssd, [ints[t], factors, xsums])
        mins = [builder.sitofp(total, v16f) for total in ints]
    d = load_super(builder, sstile, sup)
    dmin = None if mstile is None else load_super(builder, mstile, sup)  # -dmin
    out = []
    # PERF: dx last, once: (d S - dmin M) dx is three vpdpbusd slots a token and super-block, where
    # d dx S - dmin dx M was four (a product d dx and dmin dx each): Q4_K's tiles at 8 tokens, one
    # thread, 174-175 -> 178.5 G multiply-adds/s (docs/bench_forward.md); other bits, as exact
    for t, row in enumerate(drow):
        dx = _splat(builder, _load(builder, row, sup, _F32), 16)
        terms = builder.fmul(scaled[t], d, flags=flags)
        if dmin is not None:
            terms = add(terms, mins[t], dmin)
        out.append(add(totals[t], terms, dx))
    return out


def _tile_typing(typingctx, q, s, m, ss, ms, xq, xd, xs, out, r, t0, tokens, block, vectors, stream):
    """out[t0 + t, 16 r: 16 r + 16] = the tile's 16 rows . x[t0 + t], for t < tokens. q, s, m, ss,
    ms: Int8Weight's planes as 2-D arrays (one tile a row), None for none; s and m float32, both
    half bits (uint16) or both int8 factors of the super planes ss and ms (float32 or half bits;
    a kernel each); xq / xd / xs: Int8Rows' q, scale and the sums at the weight's sub-block size,
    or SuperRows' q, scale and sums (int32: the K-quants' kernel, _super_codegen).
    Literals, one kernel each: tokens (1..TOKEN_TILE), block (16, 32), vectors (VECTORS: 16 int8
    bytes, 12 u6, 8 nibbles), stream (1: a streaming driver's, STREAM_PREFETCHES)."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (tokens, block, vectors, stream)):
        return None
    kind = {v: k for k, v in VECTORS.items()}[vectors.literal_value]
    form = {types.uint16: "f16", types.int8: "i8"}.get(s.dtype, "f32")
    assert m == types.none or m.dtype == s.dtype, "scale and offset share a dtype"
    factored = form == "i8"
    assert (ss != types.none) == factored and (ms != types.none) == (factored and m != types.none), \
        "int8 factors come with their super planes"
    super_form = "f16" if factored and ss.dtype == types.uint16 else "f32"
    assert ms == types.none or ms.dtype == ss.dtype, "the super planes share a dtype"
    sig = types.none(q, s, m, ss, ms, xq, xd, xs, out, r, t0, tokens, block, vectors, stream)
    streamed = bool(stream.literal_value)
    if xs.dtype == types.int32:  # SuperRows: one activation scale per 256
        assert factored, "activations in blocks of 256 meet the K-quants' int8 factors only"
        return sig, _super_codegen(kind, block.literal_value, tokens.literal_value, super_form, streamed)
    return sig, _tile_codegen(kind, block.literal_value, tokens.literal_value, form, super_form, streamed)


_tile: Any = intrinsic(_tile_typing)


# ---- drivers -------------------------------------------------------------------------------------

@njit(inline="always")
def _run(q, s, m, ss, ms, xq, xd, xs, out, lo, hi, block, vectors, stream):  # pragma: no cover - compiled
    """Row tiles lo..hi against every token, TOKEN_TILE tokens at a time (a tile's bytes, 16 x K,
    stay in L1 and L2 across its token tiles), in blocks of tokens whose int8 rows fit in
    TOKEN_BLOCK_BYTES (they stay in L2 across the row tiles; the row tiles stream again for each
    block). block and vectors: constants of the caller (inlined: the kernel's literals); so is
    stream (1: a streaming driver's prefetches, STREAM_PREFETCHES). Each token's terms are
    summed in the same order whatever tile it is in: its result does not depend on the step's
    row count.
    PERF: 8 tokens a tile share each step's unpacking and scale loads (1 thread, Zen 4, 16-64
    rows: Q4_K 121-135 -> 130-147 G MAC/s against 4, Q6_K 94-97 -> 100-107, Q8_0 132-146 ->
    144-152); prefill's long steps too, since the nibbles' high halves are ANDed in place (two
    threads at 128 rows: Q4_K +5 %, Q4_0 +5 %, Q8_0 +2-4 %; at 512 equal or better). A remainder
    takes one tile of 4, then one of 1-3 (5 kernels a driver, not 8)."""
    num_tokens = xq.shape[0]
    whole = num_tokens // TOKEN_TILE * TOKEN_TILE
    per_block = max(TOKEN_TILE, TOKEN_BLOCK_BYTES // xq.shape[1] // TOKEN_TILE * TOKEN_TILE)
    for first in range(0, max(whole, 1), per_block):  # NOTE: one pass at least: fewer than 8 tokens
        for r in range(lo, hi):
            for t in range(first, min(first + per_block, whole), TOKEN_TILE):
                # NOTE: a global int is a literal to Numba, as _tile needs
                _tile(q, s, m, ss, ms, xq, xd, xs, out, r, t, TOKEN_TILE, block, vectors, stream)
            if first + per_block < whole:
                continue
            t = whole  # the last block's row tile, still in L1, takes the tokens left over
            if t + 4 <= num_tokens:
                _tile(q, s, m, ss, ms, xq, xd, xs, out, r, t, 4, block, vectors, stream)
                t += 4
            left = num_tokens - t  # one kernel per count below 4
            if left == 3:
                _tile(q, s, m, ss, ms, xq, xd, xs, out, r, t, 3, block, vectors, stream)
            elif left == 2:
                _tile(q, s, m, ss, ms, xq, xd, xs, out, r, t, 2, block, vectors, stream)
            elif left == 1:
                _tile(q, s, m, ss, ms, xq, xd, xs, out, r, t, 1, block, vectors, stream)


@njit(inline="always")
def _split(q, s, m, ss, ms, xq, xd, xs, out, tasks, counter, block, vectors, stream):  # pragma: no cover
    """Row tiles in `tasks` runs, claimed by the threads as they come free (gpu/cpu/tasks.py);
    counter: [0] the next task, [1] the threads to start."""
    n = q.shape[0]
    counter[0] = 0
    for _ in prange(counter[1]):
        i = claim(counter)
        while i < tasks:
            lo, hi = i * n // tasks, (i + 1) * n // tasks
            _run(q, s, m, ss, ms, xq, xd, xs, out, lo, hi, block, vectors, stream)
            i = claim(counter)


# One compiled (and cached) driver per (sub-block size, vectors a step: VECTORS). Each
# quantizes x first, in the same call (PERF: a Numba call costs microseconds; a decode step makes
# ~120 of these at ~15 us of work each).
_serial_driver = njit(cache=True, nogil=True, error_model="numpy")
_parallel_driver = njit(cache=True, nogil=True, error_model="numpy", parallel=True)


@_serial_driver
def _serial_16_16(x, q, s, m, ss, ms, xq, xd, xs16, xs32, out):  # pragma: no cover - compiled
    _quantize(x, xq, xd, xs16, xs32)
    _run(q, s, m, ss, ms, xq, xd, xs16, out, 0, q.shape[0], 16, 16, 0)


@_serial_driver
def _serial_32_16(x, q, s, m, ss, ms, xq, xd, xs16, xs32, out):  # pragma: no cover - compiled
    _quantize(x, xq, xd, xs16, xs32)
    _run(q, s, m, ss, ms, xq, xd, xs32, out, 0, q.shape[0], 32, 16, 0)


@_serial_driver
def _serial_32_8(x, q, s, m, ss, ms, xq, xd, xs16, xs32, out):  # pragma: no cover - compiled
    _quantize(x, xq, xd, xs16, xs32)
    _run(q, s, m, ss, ms, xq, xd, xs32, out, 0, q.shape[0], 32, 8, 0)


@_parallel_driver
def _parallel_16_16(x, q, s, m, ss, ms, xq, xd, xs16, xs32, out, tasks, counter):  # pragma: no cover
    _quantize_split(x, xq, xd, xs16, xs32, counter)
    _split(q, s, m, ss, ms, xq, xd, xs16, out, tasks, counter, 16, 16, 0)


@_parallel_driver
def _parallel_32_16(x, q, s, m, ss, ms, xq, xd, xs16, xs32, out, tasks, counter):  # pragma: no cover
    _quantize_split(x, xq, xd, xs16, xs32, counter)
    _split(q, s, m, ss, ms, xq, xd, xs32, out, tasks, counter, 32, 16, 0)


@_parallel_driver
def _parallel_32_8(x, q, s, m, ss, ms, xq, xd, xs16, xs32, out, tasks, counter):  # pragma: no cover
    _quantize_split(x, xq, xd, xs16, xs32, counter)
    _split(q, s, m, ss, ms, xq, xd, xs32, out, tasks, counter, 32, 8, 0)


@_serial_driver
def _serial_16_12(x, q, s, m, ss, ms, xq, xd, xs16, xs32, out):  # pragma: no cover - compiled
    _quantize(x, xq, xd, xs16, xs32)
    _run(q, s, m, ss, ms, xq, xd, xs16, out, 0, q.shape[0], 16, 12, 0)


@_serial_driver
def _serial_32_12(x, q, s, m, ss, ms, xq, xd, xs16, xs32, out):  # pragma: no cover - compiled
    _quantize(x, xq, xd, xs16, xs32)
    _run(q, s, m, ss, ms, xq, xd, xs32, out, 0, q.shape[0], 32, 12, 0)


@_parallel_driver
def _parallel_16_12(x, q, s, m, ss, ms, xq, xd, xs16, xs32, out, tasks, counter):  # pragma: no cover
    _quantize_split(x, xq, xd, xs16, xs32, counter)
    _split(q, s, m, ss, ms, xq, xd, xs16, out, tasks, counter, 16, 12, 0)


@_parallel_driver
def _parallel_32_12(x, q, s, m, ss, ms, xq, xd, xs16, xs32, out, tasks, counter):  # pragma: no cover
    _quantize_split(x, xq, xd, xs16, xs32, counter)
    _split(q, s, m, ss, ms, xq, xd, xs32, out, tasks, counter, 32, 12, 0)


# (block, vectors) -> (serial, parallel); nibbles come in 32-weight sub-blocks only
_DRIVERS = {(16, 16): (_serial_16_16, _parallel_16_16), (32, 16): (_serial_32_16, _parallel_32_16),
            (32, 8): (_serial_32_8, _parallel_32_8), (16, 12): (_serial_16_12, _parallel_16_12),
            (32, 12): (_serial_32_12, _parallel_32_12)}


# The K-quants' drivers: x quantized in blocks of 256 (SuperRows, _super_codegen), one a (block,
# vectors) as above; the tiles' zero point (ZERO_POINTS: i8 128, u6 32, u4 0) a constant of each.
@_serial_driver
def _super_serial_16_16(x, q, s, m, ss, ms, xq, xd, xs, xf, out):  # pragma: no cover - compiled
    _quantize_super(x, xq, xd, xs, xf, 16, 128)
    _run(q, s, m, ss, ms, xq, xd, xs, out, 0, q.shape[0], 16, 16, 0)


@_serial_driver
def _super_serial_32_16(x, q, s, m, ss, ms, xq, xd, xs, xf, out):  # pragma: no cover - compiled
    _quantize_super(x, xq, xd, xs, xf, 32, 128)
    _run(q, s, m, ss, ms, xq, xd, xs, out, 0, q.shape[0], 32, 16, 0)


@_serial_driver
def _super_serial_32_8(x, q, s, m, ss, ms, xq, xd, xs, xf, out):  # pragma: no cover - compiled
    _quantize_super(x, xq, xd, xs, xf, 32, 0)
    _run(q, s, m, ss, ms, xq, xd, xs, out, 0, q.shape[0], 32, 8, 0)


@_serial_driver
def _super_serial_16_12(x, q, s, m, ss, ms, xq, xd, xs, xf, out):  # pragma: no cover - compiled
    _quantize_super(x, xq, xd, xs, xf, 16, 32)
    _run(q, s, m, ss, ms, xq, xd, xs, out, 0, q.shape[0], 16, 12, 0)


@_serial_driver
def _super_serial_32_12(x, q, s, m, ss, ms, xq, xd, xs, xf, out):  # pragma: no cover - compiled
    _quantize_super(x, xq, xd, xs, xf, 32, 32)
    _run(q, s, m, ss, ms, xq, xd, xs, out, 0, q.shape[0], 32, 12, 0)


@_parallel_driver
def _super_parallel_16_16(x, q, s, m, ss, ms, xq, xd, xs, xf, out, tasks, counter):  # pragma: no cover
    _quantize_super_split(x, xq, xd, xs, xf, 16, 128, counter)
    _split(q, s, m, ss, ms, xq, xd, xs, out, tasks, counter, 16, 16, 0)


@_parallel_driver
def _super_parallel_32_16(x, q, s, m, ss, ms, xq, xd, xs, xf, out, tasks, counter):  # pragma: no cover
    _quantize_super_split(x, xq, xd, xs, xf, 32, 128, counter)
    _split(q, s, m, ss, ms, xq, xd, xs, out, tasks, counter, 32, 16, 0)


@_parallel_driver
def _super_parallel_32_8(x, q, s, m, ss, ms, xq, xd, xs, xf, out, tasks, counter):  # pragma: no cover
    _quantize_super_split(x, xq, xd, xs, xf, 32, 0, counter)
    _split(q, s, m, ss, ms, xq, xd, xs, out, tasks, counter, 32, 8, 0)


@_parallel_driver
def _super_parallel_16_12(x, q, s, m, ss, ms, xq, xd, xs, xf, out, tasks, counter):  # pragma: no cover
    _quantize_super_split(x, xq, xd, xs, xf, 16, 32, counter)
    _split(q, s, m, ss, ms, xq, xd, xs, out, tasks, counter, 16, 12, 0)


@_parallel_driver
def _super_parallel_32_12(x, q, s, m, ss, ms, xq, xd, xs, xf, out, tasks, counter):  # pragma: no cover
    _quantize_super_split(x, xq, xd, xs, xf, 32, 32, counter)
    _split(q, s, m, ss, ms, xq, xd, xs, out, tasks, counter, 32, 12, 0)


_SUPER_DRIVERS = {(16, 16): (_super_serial_16_16, _super_parallel_16_16),
                  (32, 16): (_super_serial_32_16, _super_parallel_32_16),
                  (32, 8): (_super_serial_32_8, _super_parallel_32_8),
                  (16, 12): (_super_serial_16_12, _super_parallel_16_12),
                  (32, 12): (_super_serial_32_12, _super_parallel_32_12)}


# Streaming drivers: the K-quants' parallel drivers again, their few-token kernels with
# STREAM_PREFETCHES (a matrix of STREAM_MIN_BYTES or more: the 1B-8B models' linears at batch 1)
@_parallel_driver
def _super_stream_32_8(x, q, s, m, ss, ms, xq, xd, xs, xf, out, tasks, counter):  # pragma: no cover
    _quantize_super_split(x, xq, xd, xs, xf, 32, 0, counter)
    _split(q, s, m, ss, ms, xq, xd, xs, out, tasks, counter, 32, 8, 1)


@_parallel_driver
def _super_stream_16_12(x, q, s, m, ss, ms, xq, xd, xs, xf, out, tasks, counter):  # pragma: no cover
    _quantize_super_split(x, xq, xd, xs, xf, 16, 32, counter)
    _split(q, s, m, ss, ms, xq, xd, xs, out, tasks, counter, 16, 12, 1)


@_parallel_driver
def _super_stream_32_12(x, q, s, m, ss, ms, xq, xd, xs, xf, out, tasks, counter):  # pragma: no cover
    _quantize_super_split(x, xq, xd, xs, xf, 32, 32, counter)
    _split(q, s, m, ss, ms, xq, xd, xs, out, tasks, counter, 32, 12, 1)


_STREAM_DRIVERS = {(32, 8): _super_stream_32_8, (16, 12): _super_stream_16_12, (32, 12): _super_stream_32_12}
assert {VECTORS[kind] for kind in STREAM_PREFETCHES} == {v for _, v in _STREAM_DRIVERS}


def super_activations(w: Int8Weight) -> bool:
    """W's tiles take activations in blocks of 256 (SuperRows): SUPER_BLOCK_TYPES' factored tiles."""
    return w.scale_super is not None and w.qtype in SUPER_BLOCK_TYPES


def int8_linear(x: np.ndarray, w: Int8Weight, out: np.ndarray | None = None, *,
                parallel: bool = False, super_blocks: bool = True) -> np.ndarray:
    """x float32 [T, in] (C-contiguous), W in tiles [out, in] -> float32 [T, out] (x @ W.T), x
    quantized to int8 blocks on the way: of 256 (quantize_super_rows) for SUPER_BLOCK_TYPES' factored
    tiles unless super_blocks is False (gpu/cpu/amx_kernels.py, whose tiles take blocks of 32),
    else of 32 (quantize_rows)."""
    t, (n, k) = x.shape[0], w.shape
    if out is None:
        out = np.empty((t, n), dtype=np.float32)
    assert out.strides[1] == 4 and out.shape == (t, n), "the kernels store 16 columns at a time"
    weights = (w.q, w.scale, w.offset, w.scale_super, w.offset_super)
    if super_blocks and super_activations(w):
        serial, par = _SUPER_DRIVERS[(w.block, VECTORS[w.kind])]
        if w.nbytes >= STREAM_MIN_BYTES:
            par = _STREAM_DRIVERS.get((w.block, VECTORS[w.kind]), par)
        args = (x, *weights, *super_scratch_rows(t, k, w.block), out)
    else:
        rows = scratch_rows(t, k)
        serial, par = _DRIVERS[(w.block, VECTORS[w.kind])]
        args = (x, *weights, rows.q, rows.scale, rows.sum16, rows.sum32, out)
    if parallel:
        par(*args, *linear_tasks(len(w.q)))
    else:
        serial(*args)
    return out
