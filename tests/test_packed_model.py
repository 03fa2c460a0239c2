"""The model served from its GGUF types (gpu/cpu/packed.py): the default model's Q4_1 and Q8_0
kept packed give the float32 path's logits and greedy text, and take a fifth of the memory;
a fused linear of mixed types (Q4_K_M's Q4_K and Q6_K) runs part by part."""
from __future__ import annotations

import gc
import types

import numpy as np
import pytest
from numpy.lib.array_utils import byte_bounds

from ringserve.gpu.cpu.int8_kernels import has_vnni
from ringserve.gpu.cpu.packed import fuse_packed, packed_linear
from ringserve.gpu.loader.packing import SplitWeight
from ringserve.gpu.loader.quant import dequantize, random_raw
from ringserve.gpu.loader.weights import GGMLTensor
from ringserve.gpu.runner import MemoryReport, ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig
from test_cpu_kernels import step


@pytest.mark.slow
@pytest.mark.parametrize("num_threads", [1, 2])
def test_the_default_model_packed_gives_the_float32_logits(default_model_dir, num_threads):
    packed = ModelRunner(default_model_dir,
                         DeviceConfig(device="cpu", cpu_threads=num_threads, cpu_activation_dtype="float32"),
                         CacheConfig(num_gpu_blocks_override=16))
    wide = ModelRunner(default_model_dir, DeviceConfig(device="cpu", cpu_threads=num_threads),
                       CacheConfig(num_gpu_blocks_override=16),
                       widen_packed=True)
    held = MemoryReport.of(packed).weight_bytes
    assert set(held) == {"Q4_1", "Q8_0", "F32"} and MemoryReport.of(wide).weight_bytes.keys() == {"F32"}
    assert sum(held.values()) * 4.5 < sum(MemoryReport.of(wide).weight_bytes.values())
    tokens = np.random.default_rng(3).integers(3, 40000, 40).tolist()
    for runner in (packed, wide):  # a prefill (the BLAS path), a chunk of 3 (tiles), decode tokens
        runner.out = [runner.execute(step(tokens[:30], 0))[0], runner.execute(step(tokens[30:33], 30))[0]]
        runner.out += [runner.execute(step([t], 33 + i))[0] for i, t in enumerate(tokens[33:36])]
    for got, want in zip(packed.out, wide.out, strict=True):
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        assert got.argmax() == want.argmax()


@pytest.mark.slow
@pytest.mark.skipif(not has_vnni(), reason="no AVX-512 VNNI on this CPU: no int8 activations")
def test_int8_activations_keep_the_default_models_greedy_choices(default_model_dir):
    """llama.cpp's numerics (gpu/cpu/int8_kernels.py): the activations' int8 rounding moves the
    logits by a few percent of their range, and the greedy token stays the float path's."""
    cache = CacheConfig(num_gpu_blocks_override=16)
    int8 = ModelRunner(default_model_dir,
                       DeviceConfig(device="cpu", cpu_threads=1, cpu_activation_dtype="int8"),
                       cache)
    exact = ModelRunner(default_model_dir,
                        DeviceConfig(device="cpu", cpu_threads=1, cpu_activation_dtype="float32"),
                        cache)
    assert int8.int8_activations and not exact.int8_activations
    tokens = np.random.default_rng(3).integers(3, 40000, 40).tolist()
    for runner in (int8, exact):
        runner.out = [runner.execute(step(tokens[:30], 0))[0], runner.execute(step(tokens[30:33], 30))[0]]
        runner.out += [runner.execute(step([t], 33 + i))[0] for i, t in enumerate(tokens[33:40])]
    for got, want in zip(int8.out, exact.out, strict=True):
        assert 0 < np.abs(got - want).max() <= 0.08 * np.abs(want).max()
        assert np.corrcoef(got, want)[0, 1] > 0.995 and got.argmax() == want.argmax()


def test_a_fused_linear_of_mixed_types_runs_part_by_part():
    rng = np.random.default_rng(0)
    shapes = [("Q4_K", 256), ("Q4_K", 128), ("Q6_K", 128)]   # q, k in Q4_K; v in Q6_K
    tensors = [GGMLTensor(kind, (rows, 512), random_raw(kind, (rows, 512), rng)) for kind, rows in shapes]
    tensors.append(rng.standard_normal((8, 512)).astype(np.float16))    # and an F16 part
    fused = fuse_packed(tensors)
    assert isinstance(fused, SplitWeight) and [p.qtype for p in fused.parts] == ["Q4_K", "Q6_K", "F16"]
    assert fused.parts[0].shape == (384, 512) and fused.shape == (520, 512)
    want_w = np.concatenate([np.asarray(t, dtype=np.float64) for t in tensors])
    for rows, parallel in ((1, False), (3, True), (70, False)):
        x = rng.standard_normal((rows, 512)).astype(np.float32)
        out = np.empty((rows, 520), np.float32)
        packed_linear(x, fused, out, parallel=parallel)
        want = x.astype(np.float64) @ want_w.T
        np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    assert np.array_equal(dequantize(fused.parts[1]), np.asarray(tensors[2]))


def held_bytes(*roots) -> int:
    """Bytes of memory every numpy array reachable from roots spans, overlapping views once: what
    a widened copy kept anywhere beside the packed weights would add to."""
    spans, seen, todo = [], set(), list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, str, bytes)):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            spans.append(byte_bounds(obj))
            continue
        todo += gc.get_referents(obj)
    total, end = 0, 0
    for lo, hi in sorted(spans):
        total += max(0, hi - max(lo, end))
        end = max(end, hi)
    return total


@pytest.mark.skipif(not has_vnni(), reason="no AVX-512 VNNI on this CPU: no int8 activations")
def test_a_q4_k_m_model_holds_its_weights_in_about_the_gguf_bytes(tmp_path, monkeypatch):
    """No widened copy beside the packed planes (an embedding or lm_head in float32 would be 3-5x
    its bytes): everything the runner's weights and ops hold spans at most 1.1x the GGUF's tensor
    bytes. The K-quants' scales stay llama.cpp's compact form (int8 factors, one float per 256
    weights, a half as the file's): Q4_K 0.578 bytes a weight against the file's 0.5625 (float32
    planes were 0.75), Q6_K 0.820 against 0.8203 as u6 (1.078 widened to int8)."""
    from ringserve.gpu.loader.model_store import resolve_model
    from ringserve.gpu.loader.weights import load_weights
    from ringserve.tools.random_gguf import Shape, write_random_gguf

    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    write_random_gguf(tmp_path / "m.gguf", Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512,
                                                 vocab=1024, context=256), "q4_k_m", progress=False)
    model = resolve_model(str(tmp_path / "m.gguf"))
    stored: dict[str, int] = {}
    for t in load_weights(model).values():
        kind = getattr(t, "ggml_type", "F32")
        stored[kind] = stored.get(kind, 0) + int(t.nbytes)
    runner = ModelRunner(model, DeviceConfig(device="cpu", cpu_threads=1),
                         CacheConfig(num_gpu_blocks_override=4))
    by_type = MemoryReport.of(runner).weight_bytes
    assert set(by_type) == set(stored) == {"Q4_K", "Q6_K", "F32"}
    held = held_bytes(runner.weights, runner.ops)
    assert sum(by_type.values()) <= held <= 1.1 * sum(stored.values()), (held, stored)
    assert by_type["Q4_K"] <= 0.579 / 0.5625 * stored["Q4_K"]
    assert by_type["Q6_K"] <= 0.821 / 0.8203 * stored["Q6_K"]
