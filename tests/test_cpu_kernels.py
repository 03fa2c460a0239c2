"""The CPU forward's own kernels: every path of the linear (streaming, tiled, BLAS; float32 and
bfloat16 weights; one thread and several) against numpy, bfloat16 rounding, and the runner's
bfloat16 and multi-thread options against its float32 single-thread logits on the tiny model."""
from __future__ import annotations

import numpy as np
import pytest

from ringserve.gpu.batch import Batch
from ringserve.gpu.bfloat16 import to_bfloat16, widen_bfloat16
from ringserve.gpu.cpu.linear import SMALL_ROWS, STREAM_ROWS, linear
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig


@pytest.mark.parametrize("rows", [1, STREAM_ROWS, STREAM_ROWS + 1, 8, 9, SMALL_ROWS, SMALL_ROWS + 1])
@pytest.mark.parametrize("parallel", [False, True])
def test_linear_matches_numpy(rows, parallel):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((38, 20)).astype(np.float32)  # 38 rows: a remainder after 4-row tiles
    x = rng.standard_normal((rows, 20)).astype(np.float32)
    np.testing.assert_allclose(linear(x, w, parallel=parallel), x @ w.T, rtol=1e-5, atol=1e-5)
    wb = to_bfloat16(np, w)
    np.testing.assert_allclose(linear(x, wb, parallel=parallel), x @ widen_bfloat16(np, wb).T,
                               rtol=1e-5, atol=1e-5)


def test_bfloat16_rounds_to_nearest_even():
    f = np.array([1.0, 1.00390625, 1.01171875, 1.0048828125, -2.5], dtype=np.float32)
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even mantissa (1.0); 1 + 3 * 2^-8
    # is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6); 1 + 1.25 * 2^-8 is
    # nearer to 1 + 2^-7 (truncation would give 1.0).
    expected = np.array([1.0, 1.0, 1.015625, 1.0078125, -2.5], dtype=np.float32)
    np.testing.assert_array_equal(widen_bfloat16(np, to_bfloat16(np, f)), expected)


def step(tokens: list[int], start: int) -> Batch:
    """One request at positions start.. in blocks 0, 1, 2, ... of 16."""
    pos = np.arange(start, start + len(tokens), dtype=np.int32)
    return Batch(input_ids=np.array(tokens, dtype=np.int32), positions=pos, slot_mapping=pos.copy(),
                 query_start_loc=np.array([0, len(tokens)], dtype=np.int32),
                 seq_lens=np.array([start + len(tokens)], dtype=np.int32),
                 block_tables=np.arange(8, dtype=np.int32)[None])


def run(runner: ModelRunner) -> np.ndarray:
    """A 70-token prefill (BLAS path), a 5-token chunk (tiles), then one decode token (streaming)."""
    tokens = np.random.default_rng(0).integers(3, 300, 76).tolist()
    return np.stack([runner.execute(step(tokens[:70], 0))[0], runner.execute(step(tokens[70:75], 70))[0],
                     runner.execute(step(tokens[75:], 75))[0]])


def test_runner_options_agree(tiny_model_dir):
    exact = run(ModelRunner(tiny_model_dir, DeviceConfig(device="cpu", cpu_threads=1),
                            CacheConfig(num_gpu_blocks_override=8)))
    threaded = run(ModelRunner(tiny_model_dir, DeviceConfig(device="cpu", cpu_threads=2),
                               CacheConfig(num_gpu_blocks_override=8)))
    np.testing.assert_allclose(threaded, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
    bf16 = run(ModelRunner(tiny_model_dir, DeviceConfig(device="cpu", dtype="bfloat16"),
                           CacheConfig(num_gpu_blocks_override=8)))
    error = np.abs(bf16 - exact).max() / np.abs(exact).max()
    assert 0 < error < 0.05  # bf16 weights: close, and not secretly float32



def test_fast_exp_and_silu_mul():
    from ringserve.gpu.cpu.kernels import silu_mul
    gate_up = (np.random.default_rng(1).standard_normal((5, 64)) * 40).astype(np.float32)
    gate_up[0, :4] = [-200.0, 200.0, 0.0, -87.5]  # beyond the exp's clamp on both sides
    out = np.empty((5, 32), np.float32)
    silu_mul(gate_up, out)
    g = gate_up[:, :32].astype(np.float64)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * gate_up[:, 32:], rtol=1e-6, atol=1e-30)


def test_each_row_kernels_parallel_twin_is_compiled_apart_and_gives_the_serial_bits():
    """kernels._twins: the serial and the parallel compilation of one element-wise body. Numba's
    cache keys a function by name, line and argument types, not by its flags: twins under one
    name shared an entry, and the parallel RoPE ran the serial code. Each twin its own name,
    the same bits."""
    from ringserve.gpu.cpu import kernels as k
    rng = np.random.default_rng(5)
    for T, n in ((70, 576), (65, 100)):
        gate_up = rng.standard_normal((T, 2 * n)).astype(np.float32) * 4
        for name in ("silu_mul", "gelu_tanh_mul"):
            serial, parallel = getattr(k, name), getattr(k, name + "_parallel")
            assert parallel.targetoptions["parallel"] and not serial.targetoptions.get("parallel")
            assert serial.py_func.__qualname__ != parallel.py_func.__qualname__
            want, got = np.empty((T, n), np.float32), np.empty((T, n), np.float32)
            serial(gate_up, want)
            parallel(gate_up, got)
            assert np.array_equal(got, want), name
    assert k.rope_store_kv.py_func.__qualname__ != k.rope_store_kv_parallel.py_func.__qualname__


@pytest.mark.parametrize("n", [100, 576, 2048])
def test_a_norms_rows_are_the_same_bits_on_one_thread_or_two(n):
    """The norms are one compilation whose rows split over a thread count: a row's sum of squares
    is the same code however many rows the step has (serial and parallel twins of it, vectorized
    apart by LLVM, differed at a width of 100)."""
    from ringserve.gpu.cpu.kernels import add_rms_norm, rms_norm
    rng = np.random.default_rng(6)
    h, delta = rng.standard_normal((2, 67, n)).astype(np.float32) * 3
    weight, eps = rng.standard_normal(n).astype(np.float32), np.float32(1e-5)
    outs = []
    for threads in (1, 2):
        h1, out, normed = h.copy(), np.empty_like(h), np.empty_like(h)
        add_rms_norm(h1, delta, weight, eps, out, threads)
        rms_norm(h, weight, eps, normed, threads)
        outs.append((h1, out, normed))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert np.array_equal(got, want)
    alone = np.empty((1, n), np.float32)
    rms_norm(h[5:6], weight, eps, alone, 1)
    assert np.array_equal(alone[0], outs[1][2][5])
