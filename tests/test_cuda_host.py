"""The CUDA C kernels (gpu/cuda/fused.cu, attention.cu) executed on the CPU: g++ compiles the
sources NVRTC gets (toolchain.source/options) unchanged against a CUDA-on-host shim
(tests/cuda_host/), each block's threads run as fibers (real __syncthreads and warp
shuffles: the shim's own tests are at the end), launched with the launchers' own geometry
(gpu/cuda/launch.py), and the results are checked against gpu/cuda/reference.py
(docs/design.md §8).
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_host_kernels import paged_attention, paged_attention_args
from fp16_checks import ELEMENT_TYPES, SUFFIX, assert_rounded_from, narrow, widen
from paged_cases import free_before_windows, paged_layout
from ringserve.gpu.cuda import launch, step_plan
from ringserve.gpu.cuda import reference as ref

pytestmark = pytest.mark.sim
# (HEAD_DIM, GQA_GROUP) -> KV heads: SmolLM2 (64, 9/3), Llama-3.2-1B-like 64/4, 128 with MHA
# and GQA (16-byte loads: row groups of 8 and 16 lanes), 70B-like 128/8 (8-byte loads over the
# whole warp: the group's registers), 192 (six dims per lane: the 12-byte row load).
ATTENTION_VARIANTS = {(64, 1): 2, (64, 3): 3, (64, 4): 2, (128, 1): 2, (128, 4): 1, (128, 8): 1, (192, 2): 1}
VARIANT_IDS = [f"d{d}g{g}" for d, g in ATTENTION_VARIANTS]


@pytest.fixture(scope="module")
def host_kernels(cuda_host):
    """Every variant of this module, built in parallel on first use."""
    variants = [("fused.cu", None)] + [("attention.cu", dict(HEAD_DIM=d, GQA_GROUP=g))
                                       for d, g in ATTENTION_VARIANTS]
    cuda_host.prebuild(variants)
    kernels = {"fused": cuda_host.get("fused.cu")}
    kernels.update({(d, g): cuda_host.get("attention.cu", dict(HEAD_DIM=d, GQA_GROUP=g))
                    for d, g in ATTENTION_VARIANTS})
    return kernels


def assert_fp16_close(actual: np.ndarray, expect: np.ndarray, atol: float = 1e-5) -> None:
    """actual (fp16, or bf16 bits) is expect (float32) rounded to its type (fp16_checks)."""
    assert_rounded_from(actual, expect, atol)


def unwritten(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """An output buffer of NaN in the element type's storage (0xFFFF: NaN in both)."""
    return np.full(shape, 0xFFFF, np.uint16).view(np.float16 if dtype == "float16" else np.uint16)


# ---- fused.cu: every kernel in both element types (fp16: the plain names, bf16: _bf16)

@pytest.mark.parametrize("dtype", ELEMENT_TYPES)
@pytest.mark.parametrize("hidden", [576, 64])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(host_kernels, hidden, with_delta, dtype):
    rng = np.random.default_rng(hidden)
    T, eps = 3, 1e-5
    h = (rng.standard_normal((T, hidden)) * 2).astype(np.float32)
    delta = narrow(rng.standard_normal((T, hidden)), dtype) if with_delta else None
    weight = narrow(1 + 0.3 * rng.standard_normal(hidden), dtype)
    out = unwritten((T, hidden), dtype)
    expect_h, expect_out = ref.add_rms_norm(h, None if delta is None else widen(delta), widen(weight), eps)
    host_kernels["fused"].call("add_rms_norm" + SUFFIX[dtype], launch.norm_launch(T, hidden), h, delta,
                               weight, out, np.int32(hidden), np.float32(eps))
    np.testing.assert_array_equal(h, expect_h)  # the same float32 adds, in place
    assert_fp16_close(out, expect_out)


@pytest.mark.parametrize("dtype", ELEMENT_TYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,num_heads,num_kv_heads", [(64, 64, 9, 3), (128, 128, 4, 2),
                                                                        (128, 96, 4, 2)])
def test_rope_store_kv_rotates_q_and_writes_k_and_v(host_kernels, head_dim, rotary_dim, num_heads,
                                                    num_kv_heads, dtype):
    """One launch: q rotated in place (the first rotary_dim dims of each head: 2 * the table's
    width; Phi-4-mini rotates 96 of 128), k rotated into the cache and v copied there at each
    token's slot (the reference's rope then store_kv, bit for bit), padding slots (-1) write
    nothing, k and v in qkv and every other cache row untouched."""
    rng = np.random.default_rng(head_dim + rotary_dim)
    T, max_pos, half, block_size = 5, 100, rotary_dim // 2, 4
    inv_freq = 1.0 / 10000.0 ** (np.arange(half) / half)
    angles = np.arange(max_pos)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    positions = rng.integers(0, max_pos, T).astype(np.int32)
    slots = np.array([9, -1, 0, 14, -1], np.int32)
    qkv = narrow(rng.standard_normal((T, (num_heads + 2 * num_kv_heads) * head_dim)), dtype)
    shape = (4, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (narrow(rng.standard_normal(shape), dtype) for _ in range(2))
    rotated = ref.rope(widen(qkv), positions, cos, sin, num_heads, num_kv_heads, head_dim)  # float32
    k_want, v_want = widen(k_cache), v_cache.copy()
    ref.store_kv(rotated, slots, k_want, widen(v_cache), num_heads)
    ref.store_kv(qkv, slots, k_cache.copy(), v_want, num_heads)  # v: qkv's own bits (rope leaves v)
    x = qkv.copy()
    plan = step_plan.rope_store_kv(x, num_heads, num_kv_heads, head_dim, half)
    host_kernels["fused"].call(plan.kernel, plan.geometry, x, positions, slots, cos, sin, k_cache, v_cache,
                               np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim),
                               np.int32(half), np.int32(qkv.shape[1]))
    q = num_heads * head_dim
    assert_fp16_close(x[:, :q], rotated[:, :q])
    np.testing.assert_array_equal(x[:, q:], qkv[:, q:])  # k and v in qkv as they were
    assert_fp16_close(k_cache, k_want)  # written rows: rotated k rounded once; the rest as it was
    np.testing.assert_array_equal(v_cache, v_want)
    heads = x[:, :q].reshape(T, num_heads, head_dim)  # the unrotated rest of each head, as it was
    np.testing.assert_array_equal(heads[..., rotary_dim:],
                                  qkv[:, :q].reshape(T, num_heads, head_dim)[..., rotary_dim:])


@pytest.mark.parametrize("dtype", ELEMENT_TYPES)
def test_silu_mul_odd_token_count(host_kernels, dtype):
    rng = np.random.default_rng(5)
    T, inter = 7, 96
    gate_up = narrow(rng.standard_normal((T, 2 * inter)) * 3, dtype)
    out = unwritten((T, inter), dtype)
    host_kernels["fused"].call("silu_mul" + SUFFIX[dtype], launch.silu_launch(T, inter), gate_up, out,
                               np.int32(T), np.int32(inter // 2))
    assert_fp16_close(out, ref.silu_mul(widen(gate_up)))


@pytest.mark.parametrize("dtype", ELEMENT_TYPES)
def test_gelu_tanh_mul_odd_token_count(host_kernels, dtype):
    """Gemma 3's MLP activation: transformers' gelu_pytorch_tanh of the gate times up."""
    rng = np.random.default_rng(7)
    T, inter = 7, 96
    gate_up = narrow(rng.standard_normal((T, 2 * inter)) * 3, dtype)
    out = unwritten((T, inter), dtype)
    host_kernels["fused"].call("gelu_tanh_mul" + SUFFIX[dtype], launch.silu_launch(T, inter), gate_up, out,
                               np.int32(T), np.int32(inter // 2))
    assert_fp16_close(out, ref.gelu_tanh_mul(widen(gate_up)))


@pytest.mark.parametrize("dtype", ELEMENT_TYPES)
@pytest.mark.parametrize("hidden", [1152, 64])
def test_rms_norm_in_place(host_kernels, hidden, dtype):
    """Gemma 3's norm of a layer's output before the residual add: in the activations' dtype."""
    rng = np.random.default_rng(hidden + 1)
    T, eps = 3, 1e-6
    x = narrow(rng.standard_normal((T, hidden)) * 5, dtype)
    weight = narrow(1 + 0.3 * rng.standard_normal(hidden), dtype)
    _, expect = ref.add_rms_norm(widen(x), None, widen(weight), eps)
    got = x.copy()
    host_kernels["fused"].call("rms_norm" + SUFFIX[dtype], launch.norm_launch(T, hidden), got, weight,
                               np.int32(hidden), np.float32(eps))
    assert_fp16_close(got, expect)


@pytest.mark.parametrize("dtype", ELEMENT_TYPES)
def test_add_bias_and_to_float32(host_kernels, dtype):
    """x += bias (one rounding of the float32 sum); the logits widened to float32 exactly."""
    rng = np.random.default_rng(6)
    T, n = 5, 200
    x, bias = narrow(rng.standard_normal((T, n)) * 4, dtype), narrow(rng.standard_normal(n), dtype)
    got = x.copy()
    host_kernels["fused"].call("add_bias" + SUFFIX[dtype], launch.elementwise_launch(T * n), got, bias,
                               np.int32(T), np.int32(n))
    expect = widen(x) + widen(bias)
    np.testing.assert_array_equal(got, narrow(expect, dtype))  # round to nearest even, as numpy
    out = np.full((T, n), np.nan, np.float32)
    host_kernels["fused"].call("to_float32" + SUFFIX[dtype], launch.elementwise_launch(T * n), got, out,
                               np.int32(T), np.int32(n))
    np.testing.assert_array_equal(out, widen(got))


# ---- attention.cu

def guarded(a: np.ndarray, guard: float = 7.0) -> np.ndarray:
    """a inside a buffer one block larger at each end, filled with 7: a kernel that reads block
    -1 (a padding row's table entry) or past the pool gets keys and values of 7, not memory that
    happens to be there (not NaN: fmaxf drops a NaN score and the row would still come out 0).
    NaN where a read is an error whatever its weight (a block freed before a sliding window)."""
    fill = narrow(np.float32(guard)[None], "bfloat16" if a.dtype == np.uint16 else "float16")[0]
    buf = np.full((a.shape[0] + 2, *a.shape[1:]), fill, a.dtype)
    buf[1:-1] = a
    return buf[1:-1]


def paged_case(rng, *, head_dim: int, group: int, kvh: int, requests: list[tuple[int, int]],
               pad: int = 0, block_size: int = 16, dtype: str = "float16", guard: float = 7.0) -> dict:
    """requests: (tokens already cached, new tokens) each, blocks shuffled over a pool with
    spare blocks; pad: graph padding rows after them (one token, seq_len 0, slot -1, table -1).
    The new tokens' K/V are stored first, as the runner does before attention. dtype: q and the
    cache's element type (bf16: uint16 bits)."""
    layout = paged_layout(rng, requests, block_size=block_size, pad=pad)
    positions, slots, num_blocks = layout["positions"], layout["slots"], layout["num_blocks"]
    num_heads = kvh * group
    qkv = narrow(rng.standard_normal((len(positions), (num_heads + 2 * kvh) * head_dim)), dtype)
    k_cache = guarded(narrow(rng.standard_normal((num_blocks, block_size, kvh, head_dim)), dtype), guard)
    v_cache = guarded(narrow(rng.standard_normal((num_blocks, block_size, kvh, head_dim)), dtype), guard)
    ref.store_kv(qkv, slots, k_cache, v_cache, num_heads)
    return dict(qkv=qkv, k_cache=k_cache, v_cache=v_cache, positions=positions,
                query_start_loc=layout["query_start_loc"], seq_lens=layout["seq_lens"],
                block_tables=layout["block_tables"], num_heads=num_heads, slots=slots)


def case_args(c: dict) -> tuple:
    """A case's arrays in paged_attention's order, up to the scale."""
    return (c["qkv"], c["k_cache"], c["v_cache"], c["positions"], c["query_start_loc"],
            c["seq_lens"], c["block_tables"], c["k_cache"].shape[-1] ** -0.5)


def run_attention(kernels, c: dict, splits: int, window: int = 0) -> np.ndarray:
    """What PagedAttention.__call__ launches, with NaN-filled outputs and partials; split, it
    runs twice over one workspace (a graph replayed): the kernel must leave every ticket at 0
    and the second launch's output equal to the first."""
    T, d, H, kvh = len(c["positions"]), c["k_cache"].shape[-1], c["num_heads"], c["k_cache"].shape[2]
    dtype = "bfloat16" if c["qkv"].dtype == np.uint16 else "float16"
    workspace = (np.full((T, H, splits, d), np.nan, np.float32),
                 np.full((T, H, splits, 2), np.nan, np.float32),
                 np.zeros((T, kvh), np.int32)) if splits > 1 else (None, None, None)
    outs = []
    for _ in range(2 if splits > 1 else 1):
        outs.append(unwritten((T, H * d), dtype))
        paged_attention(kernels, *case_args(c), outs[-1], splits, workspace, window)
        if splits > 1:
            assert not workspace[2].any(), "a ticket left behind"
    np.testing.assert_array_equal(outs[-1], outs[0])
    return outs[0]


def expected_attention(c: dict, window: int = 0) -> np.ndarray:
    return ref.paged_attention(widen(c["qkv"]), widen(c["k_cache"]), widen(c["v_cache"]), c["positions"],
                               c["query_start_loc"], c["seq_lens"], c["block_tables"], c["num_heads"],
                               c["k_cache"].shape[-1] ** -0.5, window)


@pytest.mark.parametrize("variant", list(ATTENTION_VARIANTS), ids=VARIANT_IDS)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", ELEMENT_TYPES)
def test_paged_attention_prefill_and_decode(host_kernels, variant, splits, dtype):
    """A fresh prefill, a prefill chunk over a cached prefix, two decodes; split-K (each query's
    keys in equal shares: the 1-key rows of the fresh prefill leave splits 1, 2 empty).
    Each element type: the kernels of q's and the cache's (fp16, or bf16: _bf16)."""
    d, g = variant
    c = paged_case(np.random.default_rng(d + g), head_dim=d, group=g, kvh=ATTENTION_VARIANTS[variant],
                   requests=[(0, 5), (21, 4), (40, 1), (3, 1)], dtype=dtype)
    out = run_attention(host_kernels[variant], c, splits)
    assert_fp16_close(out, expected_attention(c))


@pytest.mark.parametrize("variant", list(ATTENTION_VARIANTS), ids=VARIANT_IDS)
@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("dtype", ELEMENT_TYPES)
def test_paged_attention_padded_graph_decode(host_kernels, variant, splits, dtype):
    """A graph replay: decodes padded to the captured size with seq_len-0 rows and the split
    count a graph plans for max_model_len (8): each request's own keys in 8 shares (the 1-key
    decode: splits 1-7 empty; the 10-key one: shares of 2, splits 5-7 empty; the 200-key one:
    25 each). Padding rows (no keys, every split empty) must come out exactly zero."""
    d, g = variant
    c = paged_case(np.random.default_rng(10 * d + g), head_dim=d, group=g, kvh=ATTENTION_VARIANTS[variant],
                   requests=[(9, 1), (199, 1), (0, 1)], pad=2, dtype=dtype)
    out = run_attention(host_kernels[variant], c, splits)
    expect = expected_attention(c)
    assert_fp16_close(out, expect)
    assert np.all(out[-2:] == 0)


WINDOW_REQUESTS = [(0, 5), (21, 4), (40, 1), (3, 1), (30, 15)]  # the longest: 45 keys


@pytest.mark.parametrize("window", [1, 7, 24, 45, 300])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_attention_sliding_window(host_kernels, window, splits):
    """Windows of 1 (a token sees itself), smaller than the context (7, 24: not block
    multiples), equal to the longest request's 45 keys and larger than any; prefill chunks and
    decodes, eager split-K. Each request's blocks wholly before its first new token's window
    are -1 in its table (freed, engine/kv_cache.py) and the guard around the pool is NaN, so
    reading one, even at weight 0, shows; the reference reads the whole table."""
    variant = (64, 4)
    c = paged_case(np.random.default_rng(window), head_dim=64, group=4, kvh=ATTENTION_VARIANTS[variant],
                   requests=WINDOW_REQUESTS, guard=np.nan)
    expect = expected_attention(c, window)
    assert np.allclose(expect, expected_attention(c)) == (window >= 45)  # the window matters
    c["block_tables"] = free_before_windows(c["block_tables"], WINDOW_REQUESTS, block_size=16, window=window)
    out = run_attention(host_kernels[variant], c, splits, window)
    assert_fp16_close(out, expect)


ROPE_DECODES = [(9, 1), (199, 1), (0, 1), (40, 1)]  # (cached tokens, the new one): decodes only


def rope_tables(rng, max_pos: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    angles = rng.uniform(0, 2 * np.pi, (max_pos, half))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def run_rope_attention(kernels, fused, c: dict, cos, sin, splits: int, window: int) -> tuple:
    """paged_attention_rope over case c (qkv as the QKV GEMM left it, the step's slots not yet
    written), twice over one workspace as a graph replays it; and, on copies of the caches, the
    unfused path's fused.cu rope_store_kv. Returns (out, k_cache, v_cache, k_unfused, v_unfused)."""
    T, d, H, kvh = len(c["positions"]), c["k_cache"].shape[-1], c["num_heads"], c["k_cache"].shape[2]
    dtype = "bfloat16" if c["qkv"].dtype == np.uint16 else "float16"
    k_unfused, v_unfused = guarded(c["k_cache"].copy()), guarded(c["v_cache"].copy())
    x = c["qkv"].copy()
    plan = step_plan.rope_store_kv(x, H, kvh, d, cos.shape[1])
    fused.call(plan.kernel, plan.geometry, x, c["positions"], c["slots"], cos, sin, k_unfused, v_unfused,
               np.int32(H), np.int32(kvh), np.int32(d), np.int32(cos.shape[1]), np.int32(x.shape[1]))
    workspace = (np.full((T, H, splits, d), np.nan, np.float32),
                 np.full((T, H, splits, 2), np.nan, np.float32),
                 np.zeros((T, kvh), np.int32)) if splits > 1 else (None, None, None)
    qkv = c["qkv"].copy()
    outs = []
    for _ in range(2):
        outs.append(unwritten((T, H * d), dtype))
        paged_attention(kernels, *case_args(c), outs[-1], splits, workspace, window,
                        rope=(c["slots"], cos, sin))
        assert not (splits > 1 and workspace[2].any()), "a ticket left behind"
    np.testing.assert_array_equal(outs[-1], outs[0])
    np.testing.assert_array_equal(c["qkv"], qkv)  # qkv read, never written
    return outs[0], c["k_cache"], c["v_cache"], k_unfused, v_unfused


@pytest.mark.parametrize("variant,rotary_dim,window", [((64, 3), 64, 0), ((128, 4), 96, 0), ((64, 4), 64, 24),
                                                        ((192, 2), 192, 0), ((128, 1), 128, 7)],
                         ids=["d64g3", "d128g4-rot96", "d64g4-window24", "d192g2", "d128g1-window7"])
@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("dtype", ELEMENT_TYPES)
def test_paged_attention_rope_is_rope_store_kv_then_attention(host_kernels, variant, rotary_dim, window,
                                                              splits, dtype):
    """The decode-only launch (RoPE and the K/V write inside attention.cu): graph-padded decodes
    (two padding rows: no keys, slot -1) whose step slots hold NaN until the launch, q and the
    own k rotated from qkv (partial rotary: Phi's 96 of 128), split-K as a graph plans it,
    sliding windows (blocks before them freed, NaN guards): out is the reference's rope, store_kv
    and attention; the caches are bit for bit what fused.cu rope_store_kv writes."""
    d, g = variant
    kvh = ATTENTION_VARIANTS[variant]
    rng = np.random.default_rng(d + g + rotary_dim + window)
    c = paged_case(rng, head_dim=d, group=g, kvh=kvh, requests=ROPE_DECODES, pad=2, dtype=dtype,
                   guard=np.nan if window else 7.0)
    real = c["slots"] >= 0
    nan = narrow(np.float32(np.nan)[None], dtype)[0]
    for cache in (c["k_cache"], c["v_cache"]):  # paged_case stored the step's k/v: unwrite them
        cache.reshape(-1, kvh, d)[c["slots"][real]] = nan
    if window:
        c["block_tables"] = free_before_windows(c["block_tables"], ROPE_DECODES + [(0, 1)] * 2,
                                                block_size=16, window=window)
    cos, sin = rope_tables(rng, 256, rotary_dim // 2)
    out, k_cache, v_cache, k_unfused, v_unfused = run_rope_attention(
        host_kernels[variant], host_kernels["fused"], c, cos, sin, splits, window)
    np.testing.assert_array_equal(k_cache, k_unfused)
    np.testing.assert_array_equal(v_cache, v_unfused)
    H = c["num_heads"]
    rotated = narrow(ref.rope(widen(c["qkv"]), c["positions"], cos, sin, H, kvh, d), dtype)
    expect = ref.paged_attention(widen(rotated), widen(k_cache), widen(v_cache), c["positions"],
                                 c["query_start_loc"], c["seq_lens"], c["block_tables"], H, d ** -0.5, window)
    assert_fp16_close(out, expect)
    assert np.all(out[-2:] == 0)


def test_launch_outside_the_kernels_bounds_is_refused(host_kernels):
    """The shim refuses what a device would: more threads than __launch_bounds__ allows."""
    c = paged_case(np.random.default_rng(0), head_dim=64, group=1, kvh=2, requests=[(0, 1)])
    (grid, block), kernels = launch.attention_launch(1, 2, 1), host_kernels[64, 1]
    out = np.zeros((1, 2 * 64), np.float16)
    kernels.call("paged_attention", (grid, block), *paged_attention_args(*case_args(c), out))
    with pytest.raises(RuntimeError, match="invalid block"):
        kernels.call("paged_attention", (grid, (2 * block[0],)), *paged_attention_args(*case_args(c), out))


# ---- the shim itself (tests/cuda_host/shim_selftest.cpp)

@pytest.fixture(scope="module")
def shim(cuda_host):
    return cuda_host.get("shim")


@pytest.mark.parametrize("threads", [32, 128, 1024])
def test_shim_syncthreads_orders_shared_memory(shim, threads):
    """After __syncthreads every thread reads its neighbour's write; without it, a thread that
    runs before its neighbour reads the NaN the shim fills shared memory with: the host tests
    catch a missing barrier instead of passing by the OS scheduler's luck."""
    blocks = 3
    out = np.full(blocks * threads, -1, np.float32)
    shim.call("neighbour", ((blocks,), (threads,)), out, np.int32(1))
    idx = np.arange(blocks * threads)
    np.testing.assert_array_equal(out, idx // threads * threads + (idx % threads + 1) % threads)
    shim.call("neighbour", ((blocks,), (threads,)), out, np.int32(0))
    assert np.isnan(out).any()


def test_shim_warp_shuffles_exchange_between_lanes(shim):
    x = np.arange(64, dtype=np.float32)
    out = np.zeros(64, np.float32)
    shim.call("warp_total", ((1,), (64,)), x, out)
    np.testing.assert_array_equal(out, np.repeat([x[:32].sum(), x[32:].sum()], 32))


def test_shim_reports_a_barrier_not_every_thread_reaches(shim):
    """Half a warp in a full-warp shuffle while the rest wait in __syncthreads() hangs a GPU (and
    hung the shim's OS threads): the shim says so, and the next launch works."""
    out = np.zeros(64, np.float32)
    with pytest.raises(RuntimeError, match="deadlock"):
        shim.call("divergent_barrier", ((2,), (64,)), out, np.int32(16))
    shim.call("divergent_barrier", ((2,), (64,)), out, np.int32(0))
    np.testing.assert_array_equal(out, 1.0)
