"""The numpy references the CUDA kernels are checked against, checked on their own: against
the CPU backend's paged attention and against the plain definitions."""
from __future__ import annotations

import numpy as np
import pytest

from paged_cases import free_before_windows, paged_layout
from ringserve.gpu.cpu.attention import paged_attention as cpu_paged_attention
from ringserve.gpu.cuda import reference as ref


@pytest.mark.parametrize("window", [0, 1, 4, 7, 9])
def test_paged_attention_matches_cpu_backend(window):
    """Full attention and sliding windows (1, smaller than, equal to and larger than the longest
    request's 7 keys): the CPU kernel never reads a block wholly before a request's window (its
    table entry names a NaN block: a read shows), the reference reads the whole table."""
    rng = np.random.default_rng(0)
    H, KVH, D, BS, NB = 4, 2, 8, 2, 20
    cached_new = [(0, 6), (5, 1), (3, 2)]
    layout = paged_layout(rng, cached_new, block_size=BS, num_blocks=NB)
    positions, qsl, seq_lens, tables = (layout[k] for k in ("positions", "query_start_loc", "seq_lens",
                                                           "block_tables"))
    qkv = rng.standard_normal((9, (H + 2 * KVH) * D)).astype(np.float32)
    k = rng.standard_normal((NB, BS, KVH, D)).astype(np.float32)
    v = rng.standard_normal((NB, BS, KVH, D)).astype(np.float32)
    ref.store_kv(qkv, layout["slots"], k, v, H)
    out = ref.paged_attention(qkv, k, v, positions, qsl, seq_lens, tables, H, 0.3, window)
    spare = np.setdiff1d(np.arange(NB), tables)[0]
    k[spare] = v[spare] = np.nan
    if window:
        tables = free_before_windows(tables, cached_new, block_size=BS, window=window, null=spare)
    expect = np.empty((9, H, D), np.float32)
    cpu_paged_attention(np.ascontiguousarray(qkv[:, :H * D].reshape(9, H, D)), k, v, positions,
                        qsl, seq_lens, tables, np.float32(0.3), window, expect)
    np.testing.assert_allclose(out, expect.reshape(9, -1), rtol=1e-5, atol=1e-5)


def test_store_kv_writes_each_slot_and_skips_minus_one():
    qkv = np.arange(1, 19, dtype=np.float32).reshape(3, 6)  # H=1, KVH=1, D=2: q 0:2, k 2:4, v 4:6
    k = np.zeros((2, 2, 1, 2), np.float32)  # 2 blocks of 2 slots
    v = np.zeros_like(k)
    ref.store_kv(qkv, np.array([3, -1, 0], np.int32), k, v, num_heads=1)
    np.testing.assert_array_equal(k.reshape(4, 2), [qkv[2, 2:4], [0, 0], [0, 0], qkv[0, 2:4]])
    np.testing.assert_array_equal(v.reshape(4, 2), [qkv[2, 4:6], [0, 0], [0, 0], qkv[0, 4:6]])


def test_rope_is_rotate_half():
    rng = np.random.default_rng(1)
    D = 8
    qkv = rng.standard_normal((2, 3 * D)).astype(np.float32)  # H=1, KVH=1
    angles = np.array([[0.0] * (D // 2), [0.5, 0.25, 0.125, 1.0]], np.float32)
    out = ref.rope(qkv, np.array([0, 1], np.int32), np.cos(angles), np.sin(angles), 1, 1, D)
    np.testing.assert_array_equal(out[0], qkv[0])               # position 0: identity
    np.testing.assert_array_equal(out[1, 2 * D:], qkv[1, 2 * D:])  # v untouched
    for head in (0, 1):
        x = qkv[1, head * D:(head + 1) * D]
        z = (x[:D // 2] + 1j * x[D // 2:]) * np.exp(1j * angles[1])  # a rotation of each pair
        y = out[1, head * D:(head + 1) * D]
        np.testing.assert_allclose(y[:D // 2] + 1j * y[D // 2:], z, rtol=1e-6, atol=1e-6)


def test_add_rms_norm_and_silu_mul():
    rng = np.random.default_rng(2)
    h, d, w = (rng.standard_normal((3, 16)).astype(np.float32) for _ in range(3))
    h2, out = ref.add_rms_norm(h, d, w, 1e-5)
    np.testing.assert_allclose(h2, h + d)
    np.testing.assert_allclose(np.sqrt(np.mean((out / w) ** 2, axis=-1)), 1.0, rtol=1e-4)
    g = np.array([[0.0, 2.0, 3.0, -1.0]], np.float32)  # gate (0, 2), up (3, -1)
    np.testing.assert_allclose(ref.silu_mul(g), [[0.0, -2.0 / (1 + np.exp(-2.0))]], rtol=1e-6)
    # gelu_tanh(2) = 2 * Phi(2) to ~1e-3 (the tanh approximation of the normal CDF)
    np.testing.assert_allclose(ref.gelu_tanh_mul(g), [[0.0, -2.0 * 0.97725]], rtol=1e-3)
