"""--kv-cache-dtype on the CPU (gpu/cpu/kv_dtypes.py): 16-bit K/V stored as bits, rounded to
nearest even as numpy and torch round, read back exactly; attention over them is attention over
their float32 values; a model runs on them with logits near float32's."""
from __future__ import annotations

import re

import numpy as np
import pytest
from numba import njit

from paged_cases import load_all, store_all
from ringserve.gpu.bfloat16 import to_bfloat16, widen_bfloat16
from ringserve.gpu.cpu.attention import paged_attention
from ringserve.gpu.cpu.kv_dtypes import HARDWARE_HALF, float_to_half, half_to_float
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig

STORAGE = {"bfloat16": np.uint16, "float16": np.int16}


def _edge_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    f16 = np.finfo(np.float16)
    special = [0.0, -0.0, 1.0, -1.0, float(f16.max), float(f16.max) + 15.0, float(f16.max) + 17.0,
               65520.0, 65536.0, 1e30, -1e30, np.inf, -np.inf, float(f16.tiny), float(f16.tiny) / 3,
               float(f16.smallest_subnormal), float(f16.smallest_subnormal) / 2,
               float(f16.smallest_subnormal) * 0.51, 1e-30, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11]
    spread = rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000)   # 1e-9 .. 1e5
    return np.concatenate([np.array(special, np.float32), spread.astype(np.float32)])


def test_float16_store_rounds_as_numpy_and_every_half_reads_back_exactly():
    values, every = _edge_values(), _every_half()
    stored, back = np.empty(len(values), np.int16), np.empty(len(every), np.float32)
    store_all(values, stored)
    load_all(every, back)
    _assert_numpy_halves(values, stored, every, back)


def _every_half() -> np.ndarray:
    return np.arange(2 ** 16, dtype=np.uint16).view(np.int16)


def _assert_numpy_halves(values, stored, every, back) -> None:
    """stored: values as half bits, rounded as numpy rounds; back: every half bit pattern read as
    float32, exactly (any NaN for a NaN)."""
    with np.errstate(over="ignore"):                          # numpy warns as it makes the infs
        want16 = values.astype(np.float16)
    assert np.array_equal(stored.view(np.uint16), want16.view(np.uint16))
    want = every.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(back[~nan], want[~nan]) and np.isnan(back[nan]).all()


@njit
def _bit_arithmetic(values, bits, stored, back):  # pragma: no cover - compiled
    for i in range(values.shape[0]):
        stored[i] = float_to_half(values[i])
    for i in range(bits.shape[0]):
        back[i] = half_to_float(bits[i])


def test_the_bit_arithmetic_fallback_converts_as_the_hardware():
    """Where the CPU has no half conversions (no F16C) kv_load / kv_store are bit arithmetic: the
    same bits as numpy both ways, as the test above checks of whichever path this CPU takes."""
    values, every = _edge_values(), _every_half()
    stored, back = np.empty(len(values), np.int16), np.empty(len(every), np.float32)
    _bit_arithmetic(values, every, stored, back)
    _assert_numpy_halves(values, stored, every, back)
    print("this CPU's kernels convert halves with", "F16C" if HARDWARE_HALF else "the bit arithmetic")


def test_bfloat16_store_rounds_as_torch_and_reads_back_exactly():
    values = _edge_values()[np.isfinite(_edge_values())]
    stored = np.empty(len(values), np.uint16)
    store_all(values, stored)
    assert np.array_equal(stored, to_bfloat16(np, values))
    back = np.empty(len(values), np.float32)
    load_all(stored, back)
    assert np.array_equal(back, widen_bfloat16(np, stored))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_attention_over_16_bit_caches_is_attention_over_their_values(dtype):
    rng = np.random.default_rng(1)
    blocks, bs, kvh, d, heads = 6, 4, 2, 16, 4
    k = rng.standard_normal((blocks, bs, kvh, d)).astype(np.float32)
    v = rng.standard_normal((blocks, bs, kvh, d)).astype(np.float32)
    stored_k, stored_v = (np.empty(x.shape, STORAGE[dtype]) for x in (k, v))
    store_all(k.ravel(), stored_k.reshape(-1))
    store_all(v.ravel(), stored_v.reshape(-1))
    wide_k, wide_v = (np.empty(x.shape, np.float32) for x in (k, v))
    load_all(stored_k.reshape(-1), wide_k.reshape(-1))
    load_all(stored_v.reshape(-1), wide_v.reshape(-1))
    assert not np.array_equal(wide_k, k)                       # really rounded to 16 bits
    q = rng.standard_normal((3, heads, d)).astype(np.float32)
    args = (np.array([9, 10, 4], np.int32), np.array([0, 2, 3], np.int32), np.array([11, 5], np.int32),
            np.array([[0, 2, 4], [5, 1, 3]], np.int32), np.float32(0.25), 0)
    got, want = np.empty_like(q), np.empty_like(q)
    paged_attention(q, stored_k, stored_v, *args, got)
    paged_attention(q, wide_k, wide_v, *args, want)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_model_on_a_16_bit_cache_is_near_float32_and_takes_half_the_bytes(tiny_model_dir, dtype):
    from test_cpu_kernels import run
    exact_runner = ModelRunner(tiny_model_dir, DeviceConfig(device="cpu", cpu_threads=1),
                               CacheConfig(num_gpu_blocks_override=8))
    runner = ModelRunner(tiny_model_dir, DeviceConfig(device="cpu", cpu_threads=1),
                         CacheConfig(num_gpu_blocks_override=8, kv_cache_dtype=dtype))
    exact, got = run(exact_runner), run(runner)
    error = np.abs(got - exact).max() / np.abs(exact).max()
    assert 0 < error < (0.05 if dtype == "bfloat16" else 0.01), error
    assert 2 * runner.bytes_per_block == exact_runner.bytes_per_block
    assert all(k.dtype == STORAGE[dtype] for k, _ in runner.kv_caches)


def test_cuda_refuses_a_cache_type_it_does_not_have(tiny_model_dir):
    """float32 is not a CUDA cache type (bfloat16 and float16 are, as the serving dtype)."""
    with pytest.raises(ValueError, match="kv_cache_dtype 'float32' is not supported by the CUDA"):
        ModelRunner(tiny_model_dir, DeviceConfig(device="cuda"), CacheConfig(kv_cache_dtype="float32"))


def test_serve_takes_the_flag_and_reports_the_halved_pool(tiny_server, tiny_model_dir):
    import subprocess
    import sys

    import httpx
    url = tiny_server("--kv-cache-dtype", "bfloat16", "--kv-cache-memory-bytes", str(1 << 20))
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    metrics = httpx.get(url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("ringserve:kv_cache_bytes{"))
    blocks = int(re.search(r'num_gpu_blocks="(\d+)"', metrics).group(1))
    c = ModelConfig.from_dir(tiny_model_dir)
    per_block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * c.head_dim * 2   # 2 bytes each
    assert float(line.rsplit(" ", 1)[1]) == blocks * per_block and blocks == (1 << 20) // per_block
    bad = subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "serve", "--kv-cache-dtype", "fp8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--kv-cache-dtype" in bad.stderr and "fp8" in bad.stderr
