"""Quantizers for the GGUF K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), which gguf-py can read
(`gguf.quants.dequantize`) but not write: float32 rows -> GGUF blocks, bit-exact in ggml's
layout, so that gguf-py and llama.cpp read them back.

Each 256-weight super-block has sub-blocks of 16 or 32 weights with their own quantized scale
(and minimum, for the affine types), times the super-block's float16 `d` (and `dmin`). The
choice of scales is the plain one: a sub-block's range (affine: min clamped to <= 0, as ggml
keeps `m` >= 0) or its largest magnitude (symmetric, signed as ggml's make_qx_quants so the
extreme weight is exact), then the sub-block scales quantized against the largest, then each
weight rounded with the scales as stored. llama.cpp's own quantizers search the scales for the
least weighted squared error (make_qkx2_quants, make_qx_quants' rmse search); these do not, so
their error is somewhat larger than llama-quantize's for the same type.
"""
from __future__ import annotations

import numpy as np

QK_K = 256
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as the float16 a block stores, and its bytes [n, 2]."""
    h = x.astype(np.float16)
    return h.astype(np.float32), h.reshape(-1, 1).view(np.uint8)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def _affine(x: np.ndarray, sub: int, qmax: int, smax: int):
    """x [n, 256] -> (q uint8 [n, 256] in 0..qmax, sc, m uint8 [n, 256 / sub] in 0..smax,
    d and dmin bytes [n, 2]) with x ~ d*sc*q - dmin*m."""
    n = x.shape[0]
    xs = x.reshape(n, -1, sub)
    lo = np.minimum(xs.min(axis=-1), 0)
    scale, mins = (xs.max(axis=-1) - lo) / qmax, -lo
    d, d_bytes = _f16(scale.max(axis=-1) / smax)
    dmin, dmin_bytes = _f16(mins.max(axis=-1) / smax)
    sc = np.clip(np.rint(_div(scale, d[:, None])), 0, smax)
    m = np.clip(np.rint(_div(mins, dmin[:, None])), 0, smax)
    step, offset = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.rint(_div(xs + offset[..., None], step[..., None])), 0, qmax)
    return (q.reshape(n, QK_K).astype(np.uint8), sc.astype(np.uint8), m.astype(np.uint8),
            d_bytes, dmin_bytes)


def _symmetric(x: np.ndarray, nmax: int, smax: int):
    """x [n, 256] -> (q int in -nmax..nmax-1 [n, 256], sc int in -smax..smax [n, 16], d bytes)
    with x ~ d*sc*q over 16-weight sub-blocks; the largest magnitude maps to -nmax (ggml's sign)."""
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    extreme = np.take_along_axis(xs, np.abs(xs).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scale = extreme / -nmax
    d, d_bytes = _f16(np.abs(scale).max(axis=-1) / smax)
    sc = np.clip(np.rint(_div(scale, d[:, None])), -smax, smax)
    step = d[:, None] * sc
    q = np.clip(np.rint(_div(xs, step[..., None])), -nmax, nmax - 1)
    return q.reshape(n, QK_K).astype(np.int16), sc.astype(np.int16), d_bytes


def _bits(values: np.ndarray, groups: int, width: int, shift_step: int) -> np.ndarray:
    """Pack values [n, groups * k * width] so that byte j of group g holds value
    g*k*width + s*width + j at bit s*shift_step (k = 8 // shift_step): the inverse of gguf-py's
    `reshape(n, groups, 1, width) >> shifts`."""
    n = values.shape[0]
    k = 8 // shift_step
    v = values.reshape(n, groups, k, width).astype(np.uint8)
    shifts = (np.arange(k, dtype=np.uint8) * shift_step).reshape(1, 1, k, 1)
    return np.bitwise_or.reduce(v << shifts, axis=2).reshape(n, groups * width)


def _scales_6bit(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes for 8 six-bit scales and mins (gguf-py's Q4_K.get_scale_min)."""
    return np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                           (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1).astype(np.uint8)


def q2_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _affine(x, 16, 3, 15)
    return np.concatenate([sc | (m << 4), _bits(q, 2, 32, 2), d, dmin], axis=1)


def q3_k(x: np.ndarray) -> np.ndarray:
    q, sc, d = _symmetric(x, 4, 31)
    u = (q + 4).astype(np.uint8)                   # 0..7: the high bit set means q = low bits
    s = (sc + 32).astype(np.uint8)                 # 6-bit, stored biased by 32
    scales = np.concatenate([_bits(s & 0x0F, 1, 8, 4), _bits(s >> 4, 1, 4, 2)], axis=1)
    return np.concatenate([_bits(u >> 2, 1, 32, 1), _bits(u & 3, 2, 32, 2), scales, d], axis=1)


def q4_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _affine(x, 32, 15, 63)
    return np.concatenate([d, dmin, _scales_6bit(sc, m), _bits(q, 4, 32, 4)], axis=1)


def q5_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _affine(x, 32, 31, 63)
    return np.concatenate([d, dmin, _scales_6bit(sc, m), _bits(q >> 4, 1, 32, 1),
                           _bits(q & 0x0F, 4, 32, 4)], axis=1)


def q6_k(x: np.ndarray) -> np.ndarray:
    q, sc, d = _symmetric(x, 32, 127)
    u = (q + 32).astype(np.uint8)
    return np.concatenate([_bits(u & 0x0F, 2, 64, 4), _bits(u >> 4, 2, 32, 2),
                           sc.astype(np.int8).view(np.uint8), d], axis=1)


QUANTIZERS = {"Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}


def quantize_k(weights: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * block bytes]."""
    rows, cols = weights.shape
    if cols % QK_K:
        raise ValueError(f"{type_name} needs rows of a multiple of {QK_K} weights, got {cols}")
    blocks = QUANTIZERS[type_name](np.ascontiguousarray(weights, dtype=np.float32).reshape(-1, QK_K))
    return blocks.reshape(rows, -1)
