"""The Llama layer's small CPU kernels in Numba: RMSNorm (with the residual add fused), the
per-head q/k RMSNorm (Qwen3, Gemma 3), RoPE with the K/V cache write fused, SiLU·mul and
GELU-tanh·mul (Gemma 3).

Each is one compiled pass over its rows instead of several numpy temporaries: at decode sizes a
numpy call costs more in dispatch than in arithmetic, and the layer has 30 of each. The math is
the HF Llama math in float32 (variance as the mean of squares, x * rsqrt(var + eps) then times
the weight; rotate_half over two halves of a head).
"""
from __future__ import annotations

import types
from typing import Any, Callable

import numpy as np
from numba import njit, prange

from ringserve.gpu.cpu.kv_dtypes import kv_store

# NOTE: kv_store is compiled into these kernels, and Numba's cache keys on this file alone: a change
# to gpu/cpu/kv_dtypes.py (2026-12-06: F16C's conversions) comes with an edit here, or old caches stay

# Every CPU kernel's fastmath flags: reassociation lets LLVM vectorize sums with several
# accumulators; no 'nnan'/'ninf': the kernels rely on inf and -inf behaving as IEEE says.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def fast_exp(x):  # pragma: no cover - compiled
    """float32 exp that LLVM vectorizes (libm's expf, which np.exp compiles to in Numba, is a
    call per value: it was most of SiLU's and softmax's time). Cody-Waite reduction
    x = k ln2 + r, a degree-7 polynomial for e^r, 2^k built in the exponent bits; relative
    error ~1.2e-7 over [-87, 88]. Inputs are clamped there: below, e^x < 1.7e-38 becomes that;
    above, +inf becomes 1.7e38 (silu(x) = x / (1 + e^-x) still gives ~0 there)."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    k = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * np.int32((np.int32(k) + 127) << 23).view(np.float32)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", inline="always")
def _norm_row(h, t, weight, eps, out):  # pragma: no cover - compiled
    n = h.shape[1]
    s = np.float32(0.0)
    for i in range(n):
        s += h[t, i] * h[t, i]
    r = np.float32(1.0) / np.sqrt(s / np.float32(n) + eps)
    for i in range(n):
        out[t, i] = weight[i] * (h[t, i] * r)


# The norms: one compilation each, its rows split over `threads` (1: on the calling thread). NOTE:
# not serial and parallel twins (below): LLVM vectorized a row's sum of squares apart in the two
# (rows of 100 differed by 5e-7), and a token's result must not depend on the step's row count.
# PERF, 4 x 128-token step of the 1B shape, two threads: 28 -> 13 ms; the price on one thread,
# a region's start: +1.6 us a call (0.9 -> 2.5 us a row of 2,048; a decode step's 33 calls ~50 us)
@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", parallel=True)
def rms_norm(h, weight, eps, out, threads):  # pragma: no cover - compiled
    """out [T, n] = RMSNorm(h [T, n]) * weight."""
    rows = h.shape[0]
    for p in prange(threads):
        for t in range(p * rows // threads, (p + 1) * rows // threads):
            _norm_row(h, t, weight, eps, out)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", parallel=True)
def add_rms_norm(h, delta, weight, eps, out, threads):  # pragma: no cover - compiled
    """The residual step: h += delta (in place), then out = RMSNorm(h) * weight."""
    rows = h.shape[0]
    for p in prange(threads):
        for t in range(p * rows // threads, (p + 1) * rows // threads):
            for i in range(h.shape[1]):
                h[t, i] += delta[t, i]
            _norm_row(h, t, weight, eps, out)


@njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")
def qk_norm(qkv, num_heads, num_kv_heads, weight, eps):  # pragma: no cover - compiled
    """In place in qkv [T, (H + 2 KVH) * D]: each of the H q heads and KVH k heads that follow
    them = RMSNorm(head) * weight (weight [2D]: q's then k's), as HF Qwen3's q_norm / k_norm."""
    head_dim = weight.shape[0] // 2
    for t in range(qkv.shape[0]):
        for h in range(num_heads + num_kv_heads):
            base, w = h * head_dim, (0 if h < num_heads else head_dim)
            s = np.float32(0.0)
            for i in range(head_dim):
                s += qkv[t, base + i] * qkv[t, base + i]
            r = np.float32(1.0) / np.sqrt(s / np.float32(head_dim) + eps)
            for i in range(head_dim):
                qkv[t, base + i] = weight[w + i] * (qkv[t, base + i] * r)


def _silu_mul(gate_up, out):  # pragma: no cover - compiled
    """gate_up [T, 2I] (gate then up) -> out [T, I] = silu(gate) * up."""
    inter = out.shape[1]
    for t in prange(out.shape[0]):
        for i in range(inter):
            g = gate_up[t, i]
            out[t, i] = g / (np.float32(1.0) + fast_exp(-g)) * gate_up[t, inter + i]


def _gelu_tanh_mul(gate_up, out):  # pragma: no cover - compiled
    """gate_up [T, 2I] (gate then up) -> out [T, I] = gelu_tanh(gate) * up (Gemma 3's MLP:
    transformers' gelu_pytorch_tanh). 0.5 x (1 + tanh(u)) is x / (1 + e^(-2u)): SiLU's form,
    so fast_exp serves it (libm's tanh is a call per value)."""
    inter = out.shape[1]
    c = np.float32(2.0 * 0.7978845608028654)  # 2 sqrt(2 / pi)
    for t in prange(out.shape[0]):
        for i in range(inter):
            g = gate_up[t, i]
            u = c * (g + np.float32(0.044715) * g * g * g)
            out[t, i] = g / (np.float32(1.0) + fast_exp(-u)) * gate_up[t, inter + i]


def _rope_store_kv(qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, q_out):  # pragma: no cover
    """Split qkv [T, (H + 2 KVH) * D] into q, k, v; rotate q and k by each token's position
    (cos, sin: [max_pos, R/2] tables: the first R = rotary_dim dims of a head rotate as HF's
    rotate_half over them, the rest pass through) into q_out [T, H, D] and into the cache at the
    token's slot, with v, in the cache's storage type (gpu/cpu/kv_dtypes.py). A slot of -1
    stores nothing (padding)."""
    num_heads, head_dim = q_out.shape[1], q_out.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    half = cos.shape[1]
    k_off = num_heads * head_dim
    v_off = k_off + num_kv_heads * head_dim
    for t in prange(qkv.shape[0]):  # NOTE: each token its own rows and slot (a range where not parallel)
        p = positions[t]
        c, s = cos[p], sin[p]
        # PERF: each head's halves as slices indexed from 0: an index like base + half + i is
        # signed, and its negative-index check kept these loops scalar
        for h in range(num_heads):
            base = h * head_dim
            lo, hi = qkv[t, base:base + half], qkv[t, base + half:base + 2 * half]
            out_lo, out_hi = q_out[t, h, :half], q_out[t, h, half:2 * half]
            for i in range(half):
                x1, x2 = lo[i], hi[i]
                out_lo[i] = x1 * c[i] - x2 * s[i]
                out_hi[i] = x2 * c[i] + x1 * s[i]
            for i in range(2 * half, head_dim):
                q_out[t, h, i] = qkv[t, base + i]
        slot = slot_mapping[t]
        if slot < 0:
            continue
        block, row = slot // block_size, slot % block_size
        for h in range(num_kv_heads):
            base = k_off + h * head_dim
            lo, hi = qkv[t, base:base + half], qkv[t, base + half:base + 2 * half]
            k_lo, k_hi = k_cache[block, row, h, :half], k_cache[block, row, h, half:2 * half]
            for i in range(half):
                x1, x2 = lo[i], hi[i]
                k_lo[i] = kv_store(x1 * c[i] - x2 * s[i], k_cache)
                k_hi[i] = kv_store(x2 * c[i] + x1 * s[i], k_cache)
            for i in range(2 * half, head_dim):
                k_cache[block, row, h, i] = kv_store(qkv[t, base + i], k_cache)
            v_src, v_dst = qkv[t, v_off + h * head_dim:v_off + (h + 1) * head_dim], v_cache[block, row, h]
            for i in range(head_dim):
                v_dst[i] = kv_store(v_src[i], v_cache)


def _twins(body: Callable) -> tuple[Any, Any]:
    """body compiled twice: on the calling thread (decodes, short chunks: a parallel region's fork
    and join cost more than the work) and over the step's threads (its prange) for long ones; the
    same arithmetic per value (element-wise kernels only: no sums, whose vectorization the two
    compilations may choose apart). NOTE: the parallel one from a copy of body under another name:
    Numba's cache keys a function by its name, line and argument types, not by its flags, so
    twins of one function shared a cache entry, and whichever compiled first served both (the
    parallel RoPE ran on one thread)."""
    copy = types.FunctionType(body.__code__, body.__globals__, body.__name__ + "_parallel",
                              body.__defaults__, body.__closure__)
    copy.__qualname__ = body.__qualname__ + "_parallel"
    serial, parallel = (njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy", parallel=p)(f)
                        for f, p in ((body, False), (copy, True)))
    return serial, parallel


# PERF, the 1B shape's 4 x 128-token step on two threads: silu_mul 37 -> 23 ms, RoPE and
# attention 63 -> 58 (docs/bench_forward.md)
rope_store_kv, rope_store_kv_parallel = _twins(_rope_store_kv)
silu_mul, silu_mul_parallel = _twins(_silu_mul)
gelu_tanh_mul, gelu_tanh_mul_parallel = _twins(_gelu_tanh_mul)
