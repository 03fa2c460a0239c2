"""On a CUDA device (skipped without one): each kernel vs its numpy reference on random
inputs, CUDA-graph replay equal to eager, and greedy tokens of a random-weight model equal to
the CPU backend's. tools/gpu_check.py runs these first."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from fp16_checks import ELEMENT_TYPES, narrow, widen
from ringserve.engine.config import CUDA_MAX_NUM_BATCHED_TOKENS
from ringserve.gpu.cuda import reference as ref
from ringserve.gpu.settings import CacheConfig, DeviceConfig, StepLimits


def _has_device() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_device(), reason="no CUDA device")]
LIMITS = StepLimits(max_num_seqs=8, max_num_batched_tokens=CUDA_MAX_NUM_BATCHED_TOKENS)  # the runners' steps


def _paged_case(rng, T_dec=6, H=8, KVH=2, D=128, BS=16, NB=64):
    lens = [(0, 37), (100, 1), (700, 1)] + [(int(rng.integers(1, 300)), 1) for _ in range(T_dec)]
    seq_lens = np.array([a + b for a, b in lens], np.int32)
    mb = int(-(-seq_lens.max() // BS))
    NB = max(NB, mb * len(lens))
    tables = rng.permutation(NB)[:mb * len(lens)].reshape(len(lens), mb).astype(np.int32)
    pos = np.concatenate([np.arange(a, a + b) for a, b in lens]).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    qkv = rng.standard_normal((len(pos), (H + 2 * KVH) * D)).astype(np.float16)
    k = rng.standard_normal((NB, BS, KVH, D)).astype(np.float16)
    v = rng.standard_normal((NB, BS, KVH, D)).astype(np.float16)
    return qkv, k, v, pos, qsl, seq_lens, tables, H


# relative tolerance of one kernel's 16-bit output against its float32 reference: a few steps
TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2}


@pytest.mark.parametrize("dtype", ELEMENT_TYPES)  # bfloat16: the _bf16 kernels on uint16 bits
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_attention_kernels_match_reference(splits, dtype):
    import cupy as cp
    from numba import cuda

    from ringserve.gpu.cuda import numba_kernels as nk
    from ringserve.gpu.cuda.attention import PagedAttention
    qkv, k, v, pos, qsl, seq_lens, tables, H = _paged_case(np.random.default_rng(0))
    qkv, k, v = (narrow(a.astype(np.float32), dtype) for a in (qkv, k, v))
    expect = ref.paged_attention(widen(qkv), widen(k), widen(v), pos, qsl, seq_lens, tables, H, 0.088)
    d = [cp.asarray(a) for a in (qkv, k, v, pos, qsl, seq_lens, tables)]
    out = cp.zeros((len(pos), H * 128), qkv.dtype)
    attn = PagedAttention(128, H // 2)
    stream = cp.cuda.Stream()
    attn(*d, 0.088, out, stream, splits=splits,
         workspace=attn.workspace(len(pos), H, splits))
    stream.synchronize()
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(widen(out.get()), expect, rtol=tol, atol=tol)
    out_nb = cp.zeros_like(out)
    nk.paged_attention(*(cuda.as_cuda_array(a) for a in d), 0.088, cuda.as_cuda_array(out_nb))
    cuda.synchronize()
    np.testing.assert_allclose(widen(out_nb.get()), expect, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ELEMENT_TYPES)
def test_fused_kernels_match_reference(dtype):
    import cupy as cp

    from ringserve.gpu.cuda.fused import FusedKernels
    rng = np.random.default_rng(1)
    f, s = FusedKernels(), cp.cuda.Stream()
    tol = TOLERANCE[dtype]
    h = rng.standard_normal((5, 576)).astype(np.float32)
    delta = narrow(rng.standard_normal((5, 576)), dtype)
    w = narrow(rng.standard_normal(576), dtype)
    hd, out = cp.asarray(h), cp.empty((5, 576), delta.dtype)
    f.add_rms_norm(hd, cp.asarray(delta), cp.asarray(w), out, 1e-5, s)
    h_ref, out_ref = ref.add_rms_norm(h, widen(delta), widen(w), 1e-5)
    s.synchronize()
    np.testing.assert_allclose(hd.get(), h_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(widen(out.get()), out_ref, rtol=tol, atol=tol)
    qkv = narrow(rng.standard_normal((4, 12 * 64)), dtype)  # H=8, KVH=2, D=64
    pos = np.array([0, 5, 77, 1000], np.int32)
    from ringserve.gpu.rope import cos_sin
    slots = np.array([3, -1, 9, 14], np.int32)  # -1: a padding row writes nothing
    for rotary in (64, 48):  # whole heads, and Phi-4-mini's 3/4 (the rest of each head untouched)
        cos, sin = cos_sin(np.arange(1024), (1e4 ** -(np.arange(0, rotary, 2) / rotary)).astype(np.float32))
        qd = cp.asarray(qkv)
        kd, vd = (cp.zeros((4, 4, 2, 64), qkv.dtype) for _ in range(2))
        f.rope_store_kv(qd, cp.asarray(pos), cp.asarray(slots), cp.asarray(cos), cp.asarray(sin), kd, vd,
                        8, 64, s)
        s.synchronize()
        rotated = ref.rope(widen(qkv), pos, cos, sin, 8, 2, 64)
        k_want, v_want = np.zeros((4, 4, 2, 64), np.float32), np.zeros((4, 4, 2, 64), qkv.dtype)
        ref.store_kv(rotated, slots, k_want, np.zeros_like(k_want), 8)
        ref.store_kv(qkv, slots, np.zeros_like(v_want), v_want, 8)
        np.testing.assert_allclose(widen(qd.get())[:, :512], rotated[:, :512], rtol=tol, atol=tol)
        np.testing.assert_array_equal(qd.get()[:, 512:], qkv[:, 512:])  # k and v in qkv untouched
        np.testing.assert_allclose(widen(kd.get()), k_want, rtol=tol, atol=tol)
        np.testing.assert_array_equal(vd.get(), v_want)
    gu = narrow(rng.standard_normal((3, 2 * 1536)), dtype)
    act = cp.empty((3, 1536), gu.dtype)
    f.silu_mul(cp.asarray(gu), act, s)
    s.synchronize()
    np.testing.assert_allclose(widen(act.get()), ref.silu_mul(widen(gu)), rtol=tol, atol=tol)
    bias = narrow(rng.standard_normal(1536), dtype)
    f.add_bias(act, cp.asarray(bias), s)
    wide = cp.empty(act.shape, cp.float32)
    f.to_float32(act, wide, s)
    s.synchronize()
    np.testing.assert_allclose(wide.get(), ref.silu_mul(widen(gu)) + widen(bias), rtol=tol, atol=tol)


def test_gemm_in_bf16_matches_numpy():
    """cuBLAS with CUDA_R_16BF operands and fp32 sums: bf16 bits in uint16 arrays, one rounding."""
    import cupy as cp
    from nvmath.bindings import cublas

    from ringserve.gpu.cuda.gemm import WORKSPACE_BYTES, CublasGemm
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(3)
    x = narrow(rng.standard_normal((7, 320)), "bfloat16")
    w = narrow(rng.standard_normal((72, 320)) * 0.1, "bfloat16")
    with stream:  # NOTE: every array made on the stream that reads it
        ws = cp.empty(WORKSPACE_BYTES, cp.uint8)
        gemm = CublasGemm(cublas, stream.ptr, ws.data.ptr, WORKSPACE_BYTES, lambda a: a.data.ptr)
        out = cp.zeros((7, 72), cp.uint16)
        gemm(cp.asarray(x), cp.asarray(w), out)
    stream.synchronize()
    np.testing.assert_allclose(widen(out.get()), widen(x) @ widen(w).T, rtol=1e-2, atol=2e-2)
    gemm.close()


def test_gemm_captures_where_cupys_cublas_refuses_and_capture_fails_safe():
    """gpu/cuda/gemm.py on the device: a GEMM captured and replayed on new inputs equals
    numpy's; cp.matmul in a capture raises (CuPy's guard, the reason for our own handle), and
    so does an allocation, each capture ended and the stream usable after."""
    import cupy as cp
    from nvmath.bindings import cublas

    from ringserve.gpu.cuda import capture
    from ringserve.gpu.cuda.gemm import WORKSPACE_BYTES, CublasGemm
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(2)
    no_alloc = lambda: cp.cuda.using_allocator(capture.refuse_allocation)  # noqa: E731
    with stream:  # NOTE: every array made on the stream that reads it
        ws = cp.empty(WORKSPACE_BYTES, cp.uint8)
        gemm = CublasGemm(cublas, stream.ptr, ws.data.ptr, WORKSPACE_BYTES, lambda a: a.data.ptr)
        x = cp.asarray(rng.standard_normal((8, 320)).astype(np.float16))[:5]  # a leading-rows view
        w = cp.asarray((rng.standard_normal((72, 320)) * 0.1).astype(np.float16))
        out = cp.zeros((5, 72), cp.float16)
        gemm(x, w, out)
        stream.synchronize()
        graph = capture.capture(stream, lambda: gemm(x, w, out), no_alloc)
        x_host = rng.standard_normal((5, 320)).astype(np.float16)
        x.set(x_host, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        want = x_host.astype(np.float32) @ w.get().astype(np.float32).T
        np.testing.assert_allclose(out.get().astype(np.float32), want, rtol=2e-2, atol=2e-2)
        with pytest.raises(NotImplementedError, match="stream capture"):
            capture.capture(stream, lambda: cp.matmul(x, w.T, out=out), contextlib.nullcontext)
        assert not stream.is_capturing()
        with pytest.raises(capture.AllocationDuringCapture):
            capture.capture(stream, lambda: cp.empty(1 << 20, cp.uint8), no_alloc)
        assert not stream.is_capturing()
        capture.capture(stream, lambda: gemm(x, w, out), no_alloc).launch(stream)
        stream.synchronize()
    gemm.close()


@pytest.mark.parametrize("backend", ["rawkernel", "numba"])
def test_forward_matches_cpu_backend_and_graphs_match_eager(tiny_cuda_model_dir, backend):
    """Prefill then 11 decode steps of three requests, the CPU backend's greedy tokens fed to
    every runner: eager and graph-replayed logits as the CPU backend's (fp16 tolerance, the
    same token wherever it is clear), and graphs as eager."""
    from fp16_checks import assert_logits_close, next_batch
    from ringserve.gpu.cuda.runner import CudaModelRunner
    from ringserve.gpu.runner import ModelRunner
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3], [1, 17, 17, 17, 17, 17, 40, 41, 42]]
    tables = np.random.default_rng(0).permutation(64)[:3 * 8].reshape(3, 8).astype(np.int32)
    cpu = ModelRunner(tiny_cuda_model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=64))
    eager = CudaModelRunner.from_dir(tiny_cuda_model_dir, DeviceConfig(device="cuda", enforce_eager=True,
                                                                          attention_backend=backend),
                                     CacheConfig(num_gpu_blocks_override=64),
                                     LIMITS)
    graphs = CudaModelRunner.from_dir(tiny_cuda_model_dir,
                                      DeviceConfig(device="cuda", attention_backend=backend),
                                      CacheConfig(num_gpu_blocks_override=64),
                                      LIMITS)
    assert sorted(graphs.graphs.graphs) == graphs.graphs.sizes, graphs.capture_failures  # every size
    seqs, new = [list(p) for p in prompts], [list(p) for p in prompts]
    for _ in range(12):
        batch = next_batch(seqs, new, tables, 16)
        want = cpu.execute(batch)
        got_eager, got_graphs = eager.execute(batch), graphs.execute(batch)
        assert_logits_close(got_eager, want)
        assert_logits_close(got_graphs, want)
        np.testing.assert_allclose(got_graphs, got_eager, atol=1e-2 * np.abs(got_eager).max())
        for r, seq in enumerate(seqs):
            seq.append(int(want[r].argmax()))
            new[r] = [seq[-1]]


def test_verify_steps_replay_their_graphs_as_eager_and_match_the_cpu_backend(tiny_cuda_models):
    """Speculative decoding's verify steps on the device (K = 3, graphs up to 4 requests): after
    a prefill, verify steps of three requests (3, 1 and 0 drafts: the CPU's greedy tokens, one
    made wrong) replay a verify graph, their 1 + k rows of logits as the eager runner's and the
    CPU backend's (the host-shim version: tests/test_cuda_forward_host.py)."""
    from dataclasses import replace

    from fp16_checks import assert_logits_close, next_batch
    from ringserve.gpu.cuda.runner import CudaModelRunner
    from ringserve.gpu.runner import ModelRunner
    from test_cuda_forward_host import greedy_reference, verify_batch
    model = tiny_cuda_models("untied-g2")
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3], [1, 17, 17, 17, 17, 17, 40, 41, 42]]
    tables = np.random.default_rng(0).permutation(64)[:3 * 4].reshape(3, 4).astype(np.int32)
    cache = CacheConfig(num_gpu_blocks_override=64)
    limits = replace(LIMITS, num_speculative_tokens=3, max_num_verify_seqs=4)
    cpu = ModelRunner(model, DeviceConfig(device="cpu"), cache)
    eager = CudaModelRunner.from_dir(model, DeviceConfig(device="cuda", enforce_eager=True), cache, limits)
    graphs = CudaModelRunner.from_dir(model, DeviceConfig(device="cuda"), cache, limits)
    assert sorted(graphs.verify_graphs.graphs) == [1, 2, 4], graphs.verify_capture_failures
    seqs = [list(p) for p in prompts]
    prefill = next_batch(seqs, [list(p) for p in prompts], tables, 16)
    want = cpu.execute(prefill)
    eager.execute(prefill), graphs.execute(prefill)
    for r, seq in enumerate(seqs):
        seq.append(int(want[r].argmax()))
    expect, _ = greedy_reference(ModelRunner(model, DeviceConfig(device="cpu"), cache), prompts, tables, 14)
    for _ in range(3):
        ahead = [expect[r][len(seq) - len(p):] for r, (seq, p) in enumerate(zip(seqs, prompts, strict=True))]
        drafts = [ahead[0][:3], [ahead[1][0], ahead[1][1] + 1], []]  # all right; one right, one wrong; none
        batch = verify_batch(seqs, drafts, tables)
        assert graphs.verify_graphs.pick(batch) == 4
        want = cpu.execute(batch)
        got_eager, got_graphs = eager.execute(batch), graphs.execute(batch)
        assert got_graphs.shape == want.shape == (4 + 3 + 1, graphs.config.vocab_size)
        assert_logits_close(got_eager, want)
        assert_logits_close(got_graphs, want)
        np.testing.assert_allclose(got_graphs, got_eager, atol=1e-2 * np.abs(got_eager).max())
        start = 0
        for seq, d in zip(seqs, drafts, strict=True):  # accept as engine/core.py
            for i, token in enumerate(want[start:start + 1 + len(d)].argmax(-1).tolist()):
                seq.append(token)
                if i == len(d) or token != d[i]:
                    break
            start += 1 + len(d)


@pytest.mark.parametrize("heads", [2, 4])  # head_dim 64 (attention.cu), 32 (Numba's, as Phi-3.5's 96)
def test_a_phi3_forward_matches_cpu_backend_and_graphs_match_eager(tmp_path, default_model_dir, heads):
    """A tiny random Phi-3 (fused qkv_proj / gate_up_proj, 3/4 of each head rotated, LongRoPE's
    long factors at max_model_len 256): prefill then decodes, eager and graph-replayed logits as
    the CPU backend's with the same max_model_len (the same factors)."""
    from fp16_checks import assert_logits_close, next_batch
    from ringserve.gpu.cuda.runner import CudaModelRunner
    from ringserve.gpu.runner import ModelRunner
    from test_cuda_forward_host import tiny_phi3
    model_dir = tiny_phi3(tmp_path, default_model_dir, heads=heads)
    limits = StepLimits(max_num_seqs=8, max_num_batched_tokens=CUDA_MAX_NUM_BATCHED_TOKENS, max_model_len=256)
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3], [1] + list(range(40, 100))]
    tables = np.random.default_rng(0).permutation(64)[:3 * 8].reshape(3, 8).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"), CacheConfig(num_gpu_blocks_override=64), limits)
    eager = CudaModelRunner.from_dir(model_dir, DeviceConfig(device="cuda", enforce_eager=True),
                                     CacheConfig(num_gpu_blocks_override=64), limits)
    graphs = CudaModelRunner.from_dir(model_dir, DeviceConfig(device="cuda"),
                                      CacheConfig(num_gpu_blocks_override=64), limits)
    c = eager.config
    assert c.rotary_dim == 3 * c.head_dim // 4 == 2 * eager.cos.shape[1] and c.head_dim == 128 // heads
    seqs, new = [list(p) for p in prompts], [list(p) for p in prompts]
    for _ in range(6):
        batch = next_batch(seqs, new, tables, 16)
        want = cpu.execute(batch)
        got_eager, got_graphs = eager.execute(batch), graphs.execute(batch)
        assert_logits_close(got_eager, want)
        assert_logits_close(got_graphs, want)
        for r, seq in enumerate(seqs):
            seq.append(int(want[r].argmax()))
            new[r] = [seq[-1]]


def test_sampler_on_device_matches_references():
    """The sampling kernels at a real vocabulary size and 1024 threads per row."""
    import cupy as cp
    from numba import cuda

    from ringserve.gpu.cuda.sampler import CudaSampler, draw_uniforms
    from ringserve.gpu.sampling.sampler import SamplingMetadata, sample
    rng = np.random.default_rng(7)
    B, V = 6, 128256
    x = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    rows = np.array([(0.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.0), (1.0, 50, 1.0, 0.0),
                     (1.0, 0, 0.9, 0.0), (0.7, 0, 1.0, 0.1), (1.0, 40, 0.8, 0.05)], np.float32)

    def meta():
        return SamplingMetadata(np.ascontiguousarray(rows[:, 0]), rows[:, 1].astype(np.int32),
                                np.ascontiguousarray(rows[:, 2]), np.ascontiguousarray(rows[:, 3]),
                                [np.random.default_rng(i) for i in range(B)], max_num_logprobs=5)
    got = CudaSampler().sample(cuda.as_cuda_array(cp.asarray(x)), meta())
    u = draw_uniforms(meta())
    assert got.token_ids[0] == x[0].argmax()
    for r in range(1, B):
        temperature, top_k, top_p, min_p = rows[r]  # float32 columns: top_k an int again
        probs = ref.sampling_probs(x[r], float(temperature), int(top_k), float(top_p), float(min_p))
        assert got.token_ids[r] == ref.inverse_cdf(probs, float(u[0, r]))
    expect = sample(x, meta())
    np.testing.assert_array_equal(got.logprobs.token_ids[:, 1:], expect.logprobs.token_ids[:, 1:])
    np.testing.assert_allclose(got.logprobs.logprobs[:, 1:], expect.logprobs.logprobs[:, 1:], atol=1e-4)
    # rows verifying a draft model's token (rejection sampling) at this vocabulary: the reference's
    qs = [ref.sampling_probs(x[r][::-1].copy(), 1.0, 0, 1.0, 0.0) for r in range(B)]
    drafts = [int(np.argmax(q)) for q in qs]

    def draft_meta():
        m = meta()
        m.draft_probs, m.draft_token_ids = qs, drafts
        return m
    got = CudaSampler().sample(cuda.as_cuda_array(cp.asarray(x)), draft_meta())
    u = draw_uniforms(draft_meta())
    for r in range(1, B):
        temperature, top_k, top_p, min_p = rows[r]
        probs = ref.sampling_probs(x[r], float(temperature), int(top_k), float(top_p), float(min_p))
        q32 = qs[r].astype(np.float32).astype(np.float64)
        want = ref.accept_or_resample(probs, drafts[r], q32, float(u[0, r]), float(u[1, r]))
        assert got.token_ids[r] == want, r


def test_submit_samples_on_device(tiny_cuda_model_dir):
    """ModelRunner(device="cuda").submit: greedy tokens sampled on the GPU = argmax of execute."""
    from ringserve.gpu.batch import Batch
    from ringserve.gpu.runner import ModelRunner
    from ringserve.gpu.sampling.sampler import SamplingMetadata
    r = ModelRunner(tiny_cuda_model_dir, DeviceConfig(device="cuda"),
                    CacheConfig(num_gpu_blocks_override=64),
                    LIMITS)
    tables = np.arange(3 * 8, dtype=np.int32).reshape(3, 8)
    b = Batch(np.array([1, 5, 9, 1, 200, 3], np.int32), np.array([0, 1, 2, 0, 1, 0], np.int32),
              np.array([0, 1, 2, 128, 129, 256], np.int32), np.array([0, 3, 5, 6], np.int32),
              np.array([3, 2, 1], np.int32), tables)
    logits = r.execute(b)
    meta = SamplingMetadata(np.zeros(2, np.float32), np.zeros(2, np.int32), np.ones(2, np.float32),
                            np.zeros(2, np.float32), [None, None])
    out = r.submit(b, np.array([0, 2]), meta).result()
    np.testing.assert_array_equal(out.token_ids, logits[[0, 2]].argmax(-1))


def test_prompt_logprobs_and_logits_at_any_row_match_the_cpu_backend(tiny_cuda_model_dir):
    """execute(batch, logits_indices) and submit(..., PromptLogprobsSpec) on the GPU (eager and
    in a graph-shaped batch) = the CPU backend's, to fp16 tolerance."""
    from fp16_checks import fp16_tolerance
    from ringserve.gpu.batch import Batch
    from ringserve.gpu.runner import ModelRunner
    from ringserve.gpu.sampling.prompt_logprobs import PromptLogprobsSpec
    from ringserve.gpu.sampling.sampler import SamplingMetadata
    tables = np.arange(3 * 8, dtype=np.int32).reshape(3, 8)
    prefill = Batch(np.array([1, 5, 9, 1, 200, 3], np.int32), np.array([0, 1, 2, 0, 1, 0], np.int32),
                    np.array([0, 1, 2, 128, 129, 256], np.int32), np.array([0, 3, 5, 6], np.int32),
                    np.array([3, 2, 1], np.int32), tables)
    one_each = Batch(np.array([7, 8, 9], np.int32), np.array([3, 2, 1], np.int32),  # decode-shaped
                     np.array([3, 130, 257], np.int32), np.array([0, 1, 2, 3], np.int32),
                     np.array([4, 3, 2], np.int32), tables)
    spec = [PromptLogprobsSpec(np.array([0, 1, 3]), np.array([5, 9, 200], np.int32), 4),
            PromptLogprobsSpec(np.array([1]), np.array([11], np.int32), 2)]
    meta = SamplingMetadata(np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
                            np.zeros(1, np.float32), [None])
    results = []
    for device in ("cpu", "cuda"):
        r = ModelRunner(tiny_cuda_model_dir, DeviceConfig(device=device),
                        CacheConfig(num_gpu_blocks_override=64),
                        LIMITS)
        every = r.execute(prefill, np.arange(6))
        outs = [r.submit(b, np.array([2]), meta, s).result()
                for b, s in zip((prefill, one_each), spec, strict=True)]
        results.append((every, outs))
    (cpu_every, cpu_outs), (gpu_every, gpu_outs) = results
    atol = fp16_tolerance(cpu_every)  # fp16 logits: a few of fp16's steps at their magnitude
    np.testing.assert_allclose(gpu_every, cpu_every, atol=atol)
    for c, g in zip(cpu_outs, gpu_outs, strict=True):
        np.testing.assert_array_equal(g.token_ids, c.token_ids)
        np.testing.assert_array_equal(g.prompt_logprobs.token_ids[:, 0], c.prompt_logprobs.token_ids[:, 0])
        np.testing.assert_allclose(g.prompt_logprobs.logprobs, c.prompt_logprobs.logprobs, atol=atol)


def _lead(position) -> float:
    """How far a greedy position's best token leads the runner-up (logprobs=2: the top two)."""
    values = sorted((lp.logprob for lp in position.values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def _serve_on(path, model_dir, device):
    from ringserve.engine.config import EngineConfig
    from ringserve.engine.process import run_engine
    run_engine(EngineConfig.create(model=str(model_dir), device=device, num_gpu_blocks_override=256,
                                   max_num_seqs=8, max_num_batched_tokens=32), path)


def test_engine_process_on_the_gpu_overlaps_and_matches_the_cpu(tiny_cuda_models, tmp_path):
    """A real engine process on the GPU (its loop overlaps: step N-1 delivered while step N
    runs) against the CPU backend's offline LLM: the same greedy tokens for requests batched
    together, a chunked prefill among them."""
    import asyncio
    import multiprocessing as mp

    from fp16_checks import assert_same_generation
    from ringserve.ipc.sampling_params import SamplingParams
    from ringserve.server.engine_client import EngineClient
    from ringserve.server.llm import LLM
    tiny_cuda_model_dir = tiny_cuda_models("tied-g3")  # one model: a spawned engine compiles every kernel
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3], list(range(3, 83))]  # the last one chunked
    params = [dict(max_tokens=10, temperature=0.0, ignore_eos=True)] * 3
    cpu = LLM(model=str(tiny_cuda_model_dir), device="cpu", max_num_batched_tokens=32)
    done = cpu.generate(prompts, [SamplingParams(**p, logprobs=2) for p in params])
    expect = [list(o.outputs[0].token_ids) for o in done]
    leads = [[_lead(pos) for pos in o.outputs[0].logprobs] for o in done]
    path = str(tmp_path / "engine.sock")
    proc = mp.get_context("spawn").Process(target=_serve_on, args=(path, tiny_cuda_model_dir, "cuda"))
    proc.start()

    async def run():
        client = EngineClient([path])
        await client.start()
        await client.wait_ready(timeout=120)
        streams = [await client.submit(f"r{i}", p, SamplingParams(**q))
                   for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
        got = []
        for s in streams:
            got.append([t async for o in s for t in o.new_token_ids])
        await client.close()
        return got

    try:
        got = asyncio.run(asyncio.wait_for(run(), 300))
        compared = [assert_same_generation(g, e, lead) for g, e, lead in zip(got, expect, leads, strict=True)]
        assert sum(compared) >= 5, f"too few clear choices to compare: {compared}"
    finally:
        proc.terminate()
        proc.join(30)
    assert proc.exitcode == 0


def test_speculative_decoding_replays_verify_graphs_and_keeps_greedy_output(tiny_cuda_models):
    """--speculative-config on CUDA (n-gram, K = 3): the verify graphs [1, 2, 4, 8] are captured
    and verify steps replay them, drafts are accepted, and three greedy requests batched
    together decode the tokens they decode without speculation (fp16: compared up to the first
    near-tie of the plain run, where a verify row's other GEMM shape may round differently)."""
    from fp16_checks import assert_same_generation
    from ringserve.ipc.sampling_params import SamplingParams
    from ringserve.server.llm import LLM
    model = str(tiny_cuda_models("tied-g3"))
    prompts = [[1] + [5, 6, 7, 8] * 6, [1, 200, 3] * 5, list(range(3, 40))]
    common = dict(model=model, device="cuda", num_gpu_blocks_override=256, max_num_seqs=8)
    done = LLM(**common).generate(prompts, [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                                           logprobs=2)] * 3)
    expect = [list(o.outputs[0].token_ids) for o in done]
    leads = [[_lead(pos) for pos in o.outputs[0].logprobs] for o in done]
    spec = LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    runner = spec.engine.runner
    verify = runner.verify_graphs
    assert verify.sizes == [1, 2, 4, 8], verify.sizes
    assert sorted(verify.graphs) == verify.sizes, runner.verify_capture_failures
    replays: list[int] = []
    for size, captured in verify.graphs.items():
        captured.launch = lambda stream, _size=size, _launch=captured.launch: (replays.append(_size),
                                                                               _launch(stream))
    outs = spec.generate(prompts, [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)] * 3)
    got = [list(o.outputs[0].token_ids) for o in outs]
    stats = spec.engine.scheduler.speculation.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0 and replays, (stats, replays)
    compared = [assert_same_generation(g, e, lead) for g, e, lead in zip(got, expect, leads, strict=True)]
    assert sum(compared) >= 10, f"too few clear choices to compare: {compared}"


def test_a_draft_model_on_cuda_keeps_greedy_output_and_replays_its_decode_graphs(tiny_cuda_models):
    """A draft model on CUDA (the target drafting for itself, K = 3): built before its target
    on one stream with as many blocks (the profile sizes blocks for both: each costs the two
    caches' bytes); its one-token draft steps replay its decode graphs, its catch-up (two
    tokens a request after all drafts were accepted) its graphs of query length 2, the
    target's verify steps its verify graphs; nearly every greedy draft is accepted (fp16: the
    draft's decode and the target's verify round apart at near-ties), and three greedy requests
    decode what they decode
    without speculation (up to the plain run's first near-tie). Then sampled at temperature
    1 through the device sampler's rejection sampling (q is p: every draft kept)."""
    from fp16_checks import assert_same_generation
    from ringserve.ipc.sampling_params import SamplingParams
    from ringserve.server.llm import LLM
    model = str(tiny_cuda_models("tied-g3"))
    prompts = [[1] + [5, 6, 7, 8] * 6, [1, 200, 3] * 5, list(range(3, 40))]
    common = dict(model=model, device="cuda", max_num_seqs=8, max_model_len=512)
    done = LLM(**common, num_gpu_blocks_override=256).generate(
        prompts, [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2)] * 3)
    expect = [list(o.outputs[0].token_ids) for o in done]
    leads = [[_lead(pos) for pos in o.outputs[0].logprobs] for o in done]
    spec = LLM(**common, num_gpu_blocks_override=256,
               speculative_config={"model": model, "num_speculative_tokens": 3})
    core = spec.engine
    draft = core.draft_runner
    assert draft is not None and draft.stream is core.runner.stream
    assert draft.num_blocks == core.runner.num_blocks == core.kv.num_blocks == 256
    own, mirror = core.runner.kv_bytes_per_block, draft.kv_bytes_per_block
    alone, both = (core.runner._profile_num_blocks(512, 8, 0.5, extra) for extra in (0, mirror))
    assert abs(both / alone - own / (own + mirror)) < 0.01, (alone, both)
    assert sorted(draft.graphs.graphs) == draft.graphs.sizes and draft.verify_graphs.query_len == 2
    assert sorted(draft.verify_graphs.graphs) == draft.verify_graphs.sizes, draft.verify_capture_failures
    replays: list[tuple[str, int]] = []
    for kind, table in (("draft", draft.graphs), ("catch-up", draft.verify_graphs),
                        ("verify", core.runner.verify_graphs)):
        for size, captured in table.graphs.items():
            captured.launch = lambda stream, _k=kind, _s=size, _launch=captured.launch: (
                replays.append((_k, _s)), _launch(stream))
    outs = spec.generate(prompts, [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)] * 3)
    got = [list(o.outputs[0].token_ids) for o in outs]
    stats = core.scheduler.speculation.stats
    assert {k for k, _ in replays} == {"draft", "catch-up", "verify"}, replays
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens, stats
    compared = [assert_same_generation(g, e, lead) for g, e, lead in zip(got, expect, leads, strict=True)]
    assert sum(compared) >= 10, f"too few clear choices to compare: {compared}"
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    sampled = spec.generate(prompts, [params] * 3)
    assert all(len(o.outputs[0].token_ids) == 16 for o in sampled)
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert drafted > 0 and accepted >= 0.8 * drafted, (drafted, accepted)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                                   "Q6_K", "BF16"])
@pytest.mark.parametrize("rows", [1, 7, 16, 37, 70])
def test_quant_kernels_match_gguf_dequantize(qtype, rows):
    """quant.cu on the device through QuantLinear (mat-vec tiles, or dequantize + the runner's
    cuBLAS GEMM), as tests/test_cuda_quant_host.py checks it on the host."""
    import cupy as cp
    import gguf
    import gguf.quants
    from nvmath.bindings import cublas

    from ringserve.gpu.cuda.gemm import CublasGemm
    from ringserve.gpu.cuda.quant import QuantKernels
    from ringserve.gpu.cuda.quant_linear import QuantLinear, QuantStore
    from ringserve.gpu.loader.quant import random_raw
    from ringserve.gpu.loader.weights import GGMLTensor
    from test_cuda_quant_host import FORMS, form
    rng = np.random.default_rng(rows)
    N, K = 40, 2304
    raw = random_raw(qtype, (N, K), rng)
    want_w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(N, K)
    x = rng.standard_normal((rows, K)).astype(np.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # NOTE: every array made on the stream that reads it (the NaN fill included)
        workspace = cp.empty(32 << 20, cp.uint8)
        gemm = CublasGemm(cublas, stream.ptr, workspace.data.ptr, workspace.nbytes, lambda a: a.data.ptr)
        linear = QuantLinear(QuantKernels(stream).call, gemm, cp.empty(8 * K, cp.float16))
        w = QuantStore(cp).packed([GGMLTensor(qtype, (N, K), raw)])  # the compact planes, as a model's
        out = cp.full((rows, N), cp.nan, cp.float16)
        linear(cp.asarray(x), w, out)
    assert form(w) == FORMS[qtype]
    stream.synchronize()
    want = x.astype(np.float64) @ want_w.astype(np.float64).T
    np.testing.assert_allclose(out.get().astype(np.float64), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    gemm.close()


# K with a last K step of 64 that is not whole where the kind allows it (i8, bf16)
@pytest.mark.parametrize("qtype,K", [("Q4_K", 2304), ("Q8_0", 2336), ("Q6_K", 2304), ("BF16", 2312)])
def test_quant_tiled_gemm_on_tensor_cores(qtype, K):
    """quant.cu's gemm_* (QuantLinear large_batch="tiled": mma.sync on the device's tensor
    cores, whose fragment layout the host shim only emulates) at row tails 1..130, 77 output
    features (a tail of 13), x with ldx > K and out a column slice: against the float64
    product of the fp16-rounded dequantized weights (a device may fuse scale * q + offset:
    one fp16 step of a weight, within rtol), and against dequantize + cuBLAS."""
    import cupy as cp
    import gguf
    import gguf.quants
    from nvmath.bindings import cublas

    from ringserve.gpu.cuda.gemm import CublasGemm
    from ringserve.gpu.cuda.quant import QuantKernels
    from ringserve.gpu.cuda.quant_linear import QuantLinear, QuantStore
    from ringserve.gpu.loader.quant import random_raw
    from ringserve.gpu.loader.weights import GGMLTensor
    from test_cuda_quant_host import FORMS, form
    rng = np.random.default_rng(K)
    N = 77
    raw = random_raw(qtype, (N, K), rng)
    w16 = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(N, K).astype(np.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # NOTE: every array made on the stream that reads it
        workspace = cp.empty(32 << 20, cp.uint8)
        gemm = CublasGemm(cublas, stream.ptr, workspace.data.ptr, workspace.nbytes, lambda a: a.data.ptr)
        kernels = QuantKernels(stream).call
        tiled = QuantLinear(kernels, gemm, cp.empty(8 * K, cp.float16), large_batch="tiled")
        dequant = QuantLinear(kernels, gemm, cp.empty(8 * K, cp.float16), large_batch="dequant")
        w = QuantStore(cp).packed([GGMLTensor(qtype, (N, K), raw)])  # the compact planes, as a model's
    assert form(w) == FORMS[qtype]
    for rows in (1, 17, 64, 70, 130):
        x = rng.standard_normal((rows, K)).astype(np.float16)
        with stream:
            x_dev = cp.zeros((rows, K + 8), cp.float16)
            x_dev[:, :K] = cp.asarray(x)
            buffer = cp.full((rows, N + 11), cp.nan, cp.float16)
            out = buffer[:, 5:5 + N]
            other = cp.full((rows, N), cp.nan, cp.float16)
            tiled.tiled(x_dev[:, :K], w, out)
            dequant.dequant_gemm(x_dev[:, :K], w, other)
        stream.synchronize()
        got, host = out.get().astype(np.float64), buffer.get()
        want = x.astype(np.float64) @ w16.astype(np.float64).T
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
        np.testing.assert_allclose(got, other.get().astype(np.float64), rtol=2e-3,
                                   atol=2e-3 * np.abs(want).max())
        assert np.isnan(host[:, :5]).all() and np.isnan(host[:, 5 + N:]).all(), "written outside out"
    gemm.close()


@pytest.mark.parametrize("layout", ["q4_k_m", "q8_0", "awq", "bf16"])
def test_a_packed_model_matches_cpu_backend_and_graphs_match_eager(tmp_path, monkeypatch, layout):
    """A tiny random Q4_K_M / Q8_0 GGUF and a tiny AWQ, weights packed on the device: a prefill
    of 69 rows (dequantize + GEMM), then decodes (the mat-vec kernels); and a tiny bfloat16
    checkpoint, served in bf16 (its bits through cuBLAS's CUDA_R_16BF GEMMs, bf16 activations
    and KV cache, every kernel's _bf16 instantiation). Eager and graph-replayed logits as the
    CPU backend's."""
    import cupy as cp

    from fp16_checks import assert_logits_close, next_batch
    from ringserve.gpu.cuda.runner import CudaModelRunner
    from ringserve.gpu.runner import ModelRunner
    if layout == "awq":
        from test_hf_quant import make_int4_llama
        model_dir, _ = make_int4_llama(tmp_path / "awq", "awq")
    elif layout == "bf16":
        from conftest import TINY_CUDA_MODELS
        from ringserve.tools.tiny_llama import make_tiny_llama
        model_dir = make_tiny_llama(tmp_path / "bf16", dtype="bfloat16", **TINY_CUDA_MODELS["tied-g3"])
    else:
        from test_cuda_forward_host import tiny_gguf
        model_dir = tiny_gguf(tmp_path, layout, monkeypatch)
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3], [1] + list(range(40, 100))]
    tables = np.random.default_rng(0).permutation(64)[:3 * 8].reshape(3, 8).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"), CacheConfig(num_gpu_blocks_override=64))
    eager = CudaModelRunner.from_dir(model_dir, DeviceConfig(device="cuda", enforce_eager=True),
                                     CacheConfig(num_gpu_blocks_override=64),
                                     LIMITS)
    graphs = CudaModelRunner.from_dir(model_dir, DeviceConfig(device="cuda"),
                                      CacheConfig(num_gpu_blocks_override=64),
                                      LIMITS)
    assert sorted(graphs.graphs.graphs) == graphs.graphs.sizes, graphs.capture_failures
    assert (eager.ops.quant is None) == (layout == "bf16")
    assert eager.dtype == graphs.dtype == ("bfloat16" if layout == "bf16" else "float16")
    assert eager.kv_caches[0][0].dtype == (cp.uint16 if layout == "bf16" else cp.float16)
    seqs, new = [list(p) for p in prompts], [list(p) for p in prompts]
    for _ in range(6):
        batch = next_batch(seqs, new, tables, 16)
        want = cpu.execute(batch)
        got_eager, got_graphs = eager.execute(batch), graphs.execute(batch)
        assert_logits_close(got_eager, want)
        assert_logits_close(got_graphs, want)
        for r, seq in enumerate(seqs):
            seq.append(int(want[r].argmax()))
            new[r] = [seq[-1]]


@pytest.mark.parametrize("backend", ["rawkernel", "numba"])
def test_a_gemma3_forward_matches_cpu_backend_and_graphs_match_eager(tmp_path, default_model_dir, backend):
    """A tiny random Gemma 3 (tools/tiny_models.py, head_dim 64; two layers: one sliding over a
    window of 8, which the 20-token prompt outruns, one full on the other RoPE base): the
    embedding scale (a CuPy multiply inside the graphs), fused.cu's rms_norm and gelu_tanh_mul,
    the window, in bf16 (auto for Gemma 3), eager and graph-replayed logits as the CPU backend's
    over 8 decode steps."""
    import json
    from pathlib import Path

    from fp16_checks import assert_logits_close, next_batch
    from ringserve.gpu.cuda.runner import CudaModelRunner
    from ringserve.gpu.runner import ModelRunner
    from ringserve.tools.tiny_models import make_tiny_model

    config = json.loads((Path(__file__).parent / "data" / "gemma3_tiny" / "config.json").read_text())
    config |= dict(head_dim=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                   sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_dir = make_tiny_model("gemma3", tmp_path / "gemma3", config=tmp_path / "config.json",
                                tokenizer_dir=default_model_dir)
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3], [1] + list(range(40, 59))]
    tables = np.random.default_rng(0).permutation(64)[:3 * 8].reshape(3, 8).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"), CacheConfig(num_gpu_blocks_override=64))
    eager = CudaModelRunner.from_dir(model_dir, DeviceConfig(device="cuda", enforce_eager=True,
                                                             attention_backend=backend),
                                     CacheConfig(num_gpu_blocks_override=64), LIMITS)
    graphs = CudaModelRunner.from_dir(model_dir, DeviceConfig(device="cuda", attention_backend=backend),
                                      CacheConfig(num_gpu_blocks_override=64), LIMITS)
    assert sorted(graphs.graphs.graphs) == graphs.graphs.sizes, graphs.capture_failures
    seqs, new = [list(p) for p in prompts], [list(p) for p in prompts]
    for _ in range(9):
        batch = next_batch(seqs, new, tables, 16)
        want = cpu.execute(batch)
        got_eager, got_graphs = eager.execute(batch), graphs.execute(batch)
        assert_logits_close(got_eager, want)
        assert_logits_close(got_graphs, want)
        np.testing.assert_allclose(got_graphs, got_eager, atol=1e-2 * np.abs(got_eager).max())
        for r, seq in enumerate(seqs):
            seq.append(int(want[r].argmax()))
            new[r] = [seq[-1]]
