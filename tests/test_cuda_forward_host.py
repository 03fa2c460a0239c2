"""The CUDA backend's whole forward without a GPU: gpu/models' forward, the model
CudaModelRunner runs, over HostOps (model.ModelOps): the real CUDA C kernels (fused.cu,
attention.cu) compiled for the host (tests/cuda_host_kernels.py), numpy in place of cuBLAS
(16-bit in and out, float32 accumulation) and the numpy references of the Numba kernels (which
run in the CUDA simulator in tests/test_cuda_sim.py). Against the CPU backend's logits on tiny
random Llamas: eager prefill and decode, and decode the way a CUDA graph replays it (padded to
a ladder size, the shared buffers' block table holding stale rows, split-K from
max_model_len), and speculative decoding's verify steps eager and as their graphs replay them
(1 + k rows of logits per request) against the CPU's logits and the plain greedy decode's
tokens; in fp16 and in bf16 (weights, activations and KV cache as bf16 bits: each
kernel's _bf16 instantiation). What it cannot check: cuBLAS, CuPy, Numba on a device, graph
capture.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_CUDA_MODELS
from cuda_host_kernels import paged_attention
from fp16_checks import (
    assert_logits_close,
    assert_same_generation,
    decode_against_cpu,
    fp16_tolerance,
    narrow,
    next_batch,
    widen,
)
from ringserve.gpu.batch import Batch
from ringserve.gpu.cuda import launch, plan, step_plan
from ringserve.gpu.cuda import reference as ref
from ringserve.gpu.cuda.buffers import AttentionLaunch, StepBuffers
from ringserve.gpu.cuda.dtypes import SERVING_DTYPES, serving_dtype
from ringserve.gpu.cuda.quant_linear import LARGE_BATCH, QuantLinear, QuantStore, keeps_blocks
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.weights import load_weights
from ringserve.gpu.models import model_definition
from ringserve.gpu.rope import rope_tables_by_type
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig
from test_cuda_quant_host import FORMS, form

pytestmark = pytest.mark.sim
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 16, 48, 256
SPEC_TOKENS, MAX_VERIFY_SEQS = 3, 4  # the host runner's verify graphs: K and the most requests
F16, F32 = np.float16, np.float32


class HostOps:
    """model.ModelOps on the CPU as CudaOps runs them (see the module docstring)."""

    def __init__(self, c: ModelConfig, cuda_host, packed: bool = False, large_batch: str = LARGE_BATCH,
                 act_dtype=F16):
        self.fused = cuda_host.get("fused.cu")
        # packed weights: quant.cu through the runner's own plan, a workspace of 2 ** 16
        # elements in the activations' dtype (several chunks of rows for the larger weights of
        # a prefill), NaN in fp16 and bf16
        workspace = np.full(1 << 16, 0xFFFF, np.uint16).view(act_dtype)
        self.quant = QuantLinear(cuda_host.get("quant.cu").call, fp16_gemm, workspace,
                                 large_batch) if packed else None
        self.paged = cuda_host.get("attention.cu", dict(
            HEAD_DIM=c.head_dim, GQA_GROUP=c.num_attention_heads // c.num_key_value_heads))
        self.scale, self.eps = c.attention_scale, c.rms_norm_eps
        self.head_dim, self.num_heads = c.head_dim, c.num_attention_heads
        self.num_rot_heads = c.num_attention_heads + c.num_key_value_heads

    def copy_in(self, dst, src):
        dst[:len(src)] = src

    def copy_in_corner(self, dst, src):
        dst[:src.shape[0], :src.shape[1]] = src

    def embedding(self, ids, table, out):
        if self.quant is not None and not isinstance(table, np.ndarray):  # a packed table
            self.quant.embedding(ids, table, out)
        else:
            out[...] = ref.embedding(ids, table)

    def linear(self, x, weight, out):
        if self.quant is not None:
            self.quant(x, weight, out)
        else:
            fp16_gemm(x, weight, out)

    def add_bias(self, x, bias):
        T, n = x.shape
        self.fused.call("add_bias" + _suffix(x), launch.elementwise_launch(T * n), x, bias, np.int32(T),
                        np.int32(n))

    def add_rms_norm(self, h, delta, weight, out):
        T, n = h.shape
        self.fused.call("add_rms_norm" + _suffix(out), launch.norm_launch(T, n), h, delta, weight, out,
                        np.int32(n), np.float32(self.eps))

    def rms_norm(self, x, weight):
        plan = step_plan.rms_norm(x)
        self.fused.call(plan.kernel, plan.geometry, x, weight, np.int32(x.shape[1]), np.float32(self.eps))

    def scale_embedding(self, h, factor):
        h *= np.float32(factor)  # CudaOps: one CuPy elementwise multiply of the float32 stream

    def qk_norm(self, qkv, weight):
        self.fused.call("qk_norm" + _suffix(qkv), launch.qk_norm_launch(qkv.shape[0], self.num_rot_heads),
                        qkv, weight, np.int32(self.num_heads), np.int32(self.head_dim),
                        np.int32(qkv.shape[1]), np.float32(self.eps))

    def attention(self, buf, cos, sin, k_cache, v_cache, attn: AttentionLaunch, window: int):
        """CudaOps.attention: one fused launch for a decode-only step, else rope_store_kv first."""
        fused = step_plan.fuses_rope("rawkernel", attn.decode_only)
        if not fused:
            qkv, kvh, D, half = buf.qkv, k_cache.shape[2], self.head_dim, cos.shape[1]
            plan = step_plan.rope_store_kv(qkv, self.num_heads, kvh, D, half)
            self.fused.call(plan.kernel, plan.geometry, qkv, buf.positions, buf.slot_mapping, cos, sin,
                            k_cache, v_cache, np.int32(self.num_heads), np.int32(kvh), np.int32(D),
                            np.int32(half), np.int32(qkv.shape[1]))
        paged_attention(self.paged, buf.qkv, k_cache, v_cache, buf.positions, buf.query_start_loc,
                        buf.seq_lens, buf.block_tables, self.scale, buf.attn, attn.splits_for(window),
                        attn.workspace, window, rope=(buf.slot_mapping, cos, sin) if fused else None)

    def silu_mul(self, gate_up, out):
        T, inter = out.shape
        self.fused.call("silu_mul" + _suffix(out), launch.silu_launch(T, inter), gate_up, out, np.int32(T),
                        np.int32(inter // 2))

    def gelu_tanh_mul(self, gate_up, out):
        T, inter = out.shape
        plan = step_plan.gelu_tanh_mul(out)
        self.fused.call(plan.kernel, plan.geometry, gate_up, out, np.int32(T), np.int32(inter // 2))

    def gather_rows(self, x, indices, out):
        out[...] = x[indices]

    def to_float32(self, src, out):
        rows, cols = src.shape
        self.fused.call("to_float32" + _suffix(src), launch.elementwise_launch(rows * cols), src, out,
                        np.int32(rows), np.int32(cols))


def _suffix(x) -> str:
    """The CUDA C kernel of x's element type (fused.py's choice)."""
    return launch.SUFFIXES[str(x.dtype)]


def fp16_gemm(x, weight, out):
    """cuBLAS's stand-in: 16-bit in and out (fp16, or bf16 bits), float32 accumulation."""
    out[...] = narrow(widen(x) @ widen(weight).T, "bfloat16" if out.dtype == np.uint16 else "float16")


def workspace(c: ModelConfig, T: int, splits: int) -> tuple:
    """PagedAttention.workspace's shapes, the partials NaN-filled (a partial nobody wrote shows
    up), the tickets zeroed."""
    if splits == 1:
        return None, None, None
    num_heads, head_dim = c.num_attention_heads, c.head_dim
    return (np.full((T, num_heads, splits, head_dim), np.nan, F32),
            np.full((T, num_heads, splits, 2), np.nan, F32), np.zeros((T, c.num_key_value_heads), np.int32))


class HostRunner:
    """CudaModelRunner's eager and graph-shaped paths, on HostOps."""

    def __init__(self, model_dir, cuda_host, num_sms: int = 16, large_batch: str = LARGE_BATCH,
                 dtype: str = "auto"):
        c = self.config = ModelConfig.from_dir(model_dir)
        weights = load_weights(model_dir)
        self.dtype = serving_dtype(dtype, weights, c.architecture)  # as CudaModelRunner
        act = self.act_dtype = SERVING_DTYPES[self.dtype]
        self.ops = HostOps(c, cuda_host, packed=any(keeps_blocks(t) for t in weights.values()),
                           large_batch=large_batch, act_dtype=act)
        self.model = model_definition(c)
        self.weights = self.model.fuse(c, weights, QuantStore(np, self.dtype))
        shape = (NUM_BLOCKS, BLOCK_SIZE, c.num_key_value_heads, c.head_dim)
        self.caches = [(np.zeros(shape, act), np.zeros(shape, act)) for _ in range(c.num_hidden_layers)]
        self.ropes = rope_tables_by_type(c, MAX_MODEL_LEN, MAX_MODEL_LEN)
        self.num_sms = num_sms  # few "SMs": split-K kicks in at these tiny batches
        self.decode = plan.GraphTable(plan.graph_batch_sizes(8))
        self.verify = plan.GraphTable(plan.verify_batch_sizes(8, MAX_VERIFY_SEQS), 1 + SPEC_TOKENS)
        self.max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
        # the graphs' one set of buffers, with stale garbage where no step wrote yet
        T, B, R = plan.shared_shape([self.decode, self.verify])
        self.shared = StepBuffers(c, T, B, self.max_blocks, np, act, R)
        tables = self.shared.block_tables
        tables[...] = np.random.default_rng(0).integers(0, NUM_BLOCKS, tables.shape)

    def splits(self, num_tokens: int, max_seq_len: int) -> int:
        return plan.attention_splits(num_tokens=num_tokens, num_kv_heads=self.config.num_key_value_heads,
                                     max_seq_len=max_seq_len, num_sms=self.num_sms, partition_size=32)

    def window_splits(self, num_tokens: int, max_seq_len: int) -> dict[int, int]:
        return plan.window_splits(self.config.layer_windows, num_tokens=num_tokens,
                                  num_kv_heads=self.config.num_key_value_heads, max_seq_len=max_seq_len,
                                  num_sms=self.num_sms, partition_size=32)

    def eager(self, batch: Batch) -> np.ndarray:
        c = self.config
        buf = StepBuffers(c, batch.num_tokens, batch.num_reqs, batch.block_tables.shape[1], np,
                          self.act_dtype, len(batch.logits_indices))
        buf.load(batch, self.ops)
        max_len = int(batch.seq_lens.max())
        s = self.splits(batch.num_tokens, max_len)
        self.model.forward(self.ops, self.weights, buf, self.caches, AttentionLaunch(
            s, workspace(c, batch.num_tokens, s), plan.is_decode_only(batch),
            self.window_splits(batch.num_tokens, max_len)), self.ropes)
        return buf.logits.copy()

    def graph_shaped(self, batch: Batch) -> np.ndarray:
        """A decode (or a verify step) as its graph replays it: padded to its ladder's size,
        leading views of the shared buffers, split-K planned for max_model_len."""
        c = self.config
        table = self.decode if plan.is_decode_only(batch) else self.verify
        size = table.fit(batch)
        assert size is not None, "no graph holds this step"
        T, B, R = table.shape(size)
        buf = self.shared.leading(T, B, R)
        buf.load(table.pad(batch, size, self.max_blocks), self.ops)
        s = self.splits(T, MAX_MODEL_LEN)
        launch = AttentionLaunch(s, workspace(c, T, s), table is self.decode,
                                 self.window_splits(T, MAX_MODEL_LEN))
        self.model.forward(self.ops, self.weights, buf, self.caches, launch, self.ropes)
        return buf.logits[:len(batch.logits_indices)].copy()


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])  # auto: a float32 checkpoint in fp16
@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_cuda_forward_matches_the_cpu_backend(tiny_cuda_model_dir, cuda_host, decode, dtype):
    """Three requests (one prompt spans two blocks) prefilled together, then decoded greedily
    (the CPU backend's tokens fed to both): every step's logits as the CPU backend's, K/V
    written and read through shuffled block tables."""
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3], [1] + list(range(40, 60))]
    tables = np.random.default_rng(3).permutation(NUM_BLOCKS)[:3 * 4].reshape(3, 4).astype(np.int32)
    cpu = ModelRunner(tiny_cuda_model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE))
    host = HostRunner(tiny_cuda_model_dir, cuda_host, dtype=dtype)
    assert host.caches[0][0].dtype == (F16 if dtype == "auto" else np.uint16)
    decode_against_cpu(cpu, host, prompts, tables, BLOCK_SIZE, 6, graph=decode == "graph")
    if decode == "eager" and dtype == "auto":  # the prompt-logprobs gpu test's fp16 tolerance holds
        batch = next_batch([list(p) for p in prompts], [list(p) for p in prompts], tables, BLOCK_SIZE)
        want = cpu.execute(batch)
        np.testing.assert_allclose(host.eager(batch), want, atol=fp16_tolerance(want))


def verify_batch(seqs: list[list[int]], drafts: list[list[int]], tables: np.ndarray) -> Batch:
    """Speculative decoding's verify step as engine/inputs.py builds it: each request computes
    its last token (seqs[r][-1]) and its drafts, logits at all those 1 + k rows, its block
    table -1 past its blocks."""
    full = [seq + d for seq, d in zip(seqs, drafts, strict=True)]
    tables = tables.copy()
    for r, seq in enumerate(full):
        tables[r, -(-len(seq) // BLOCK_SIZE):] = -1
    batch = next_batch(full, [[seq[-1]] + d for seq, d in zip(seqs, drafts, strict=True)], tables, BLOCK_SIZE)
    batch.sample_indices = np.arange(batch.num_tokens, dtype=np.int32)
    return batch


def greedy_reference(runner, prompts: list[list[int]], tables: np.ndarray, steps: int):
    """The plain greedy decode (prefill, then one token a step) on `runner`: each request's
    tokens and each choice's lead in logprob over the runner-up."""
    seqs, new = [list(p) for p in prompts], [list(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    leads: list[list[float]] = [[] for _ in prompts]
    for _ in range(steps):
        logits = runner.execute(next_batch(seqs, new, tables, BLOCK_SIZE))
        logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        for r, seq in enumerate(seqs):
            top2 = np.sort(logprobs[r])[-2:]
            tokens[r].append(int(logprobs[r].argmax()))
            leads[r].append(float(top2[1] - top2[0]))
            seq.append(tokens[r][-1])
            new[r] = [seq[-1]]
    return tokens, leads


# Per request, per verify step: (k drafts from the plain decode's next tokens, the one made
# wrong or None). All accepted; one accepted then a wrong one (its K/V rewritten next step);
# none (a plain decode row in a verify step); the first wrong.
VERIFY_PLANS = [[(3, None), (2, None)], [(3, 1), (3, 2)], [(0, None), (2, 0)]]


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_verify_steps_match_the_cpu_backend_and_the_plain_greedy_decode(tiny_cuda_models, cuda_host, dtype):
    """Speculative decoding on the CUDA forward: after a prefill, two verify steps of three
    requests (k = 3, 3, 0 then 2, 3, 2 drafts: all right, one right then a wrong one, none, the
    first wrong). Eager, every row's logits as the CPU backend's for the same batch; as their
    verify graph replays them (padded to the ladder's n x (1 + K) tokens and n + 1 request
    slots, the shared device table stale past the real rows, the batch's own tables -1 past
    each request's blocks), as eager. Accepting as engine/core.py does (while the row's argmax
    is the draft, then one more), each request's tokens are the plain greedy decode's."""
    model_dir = tiny_cuda_models("untied-g2")
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3], [1] + list(range(40, 60))]
    tables = np.random.default_rng(3).permutation(NUM_BLOCKS)[:3 * 4].reshape(3, 4).astype(np.int32)
    cache = CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"), cache)
    expect, leads = greedy_reference(ModelRunner(model_dir, DeviceConfig(device="cpu"), cache), prompts,
                                     tables, 9)
    host = HostRunner(model_dir, cuda_host, dtype=dtype)
    seqs = [list(p) for p in prompts]
    prefill = next_batch(seqs, [list(p) for p in prompts], tables, BLOCK_SIZE)
    want = cpu.execute(prefill)
    assert_logits_close(host.eager(prefill), want)
    for r, seq in enumerate(seqs):
        seq.append(int(want[r].argmax()))
    vocab = host.config.vocab_size
    for step in range(2):
        drafts = []
        for r, seq in enumerate(seqs):
            k, wrong = VERIFY_PLANS[r][step]
            done = len(seq) - len(prompts[r])
            d = list(expect[r][done:done + k])
            if wrong is not None:
                d[wrong] = (d[wrong] + 1) % vocab
            drafts.append(d)
        batch = verify_batch(seqs, drafts, tables)
        want = cpu.execute(batch)
        assert want.shape == (sum(1 + len(d) for d in drafts), vocab)
        assert not plan.is_decode_only(batch) and host.verify.fit(batch) == 4
        eager = host.eager(batch)
        assert_logits_close(eager, want)
        got = host.graph_shaped(batch)  # the same step as its graph replays it (the same K/V rewritten)
        np.testing.assert_allclose(got, eager, atol=fp16_tolerance(eager))
        np.testing.assert_array_equal(got.argmax(-1), eager.argmax(-1))
        start = 0
        for seq, d in zip(seqs, drafts, strict=True):
            for i, token in enumerate(got[start:start + 1 + len(d)].argmax(-1).tolist()):
                seq.append(token)
                if i == len(d) or token != d[i]:
                    break
            start += 1 + len(d)
    assert [len(seq) - len(p) for seq, p in zip(seqs, prompts, strict=True)] == [8, 6, 3]
    compared = [assert_same_generation(seq[len(p):], expect[r][:len(seq) - len(p)], leads[r])
                for r, (seq, p) in enumerate(zip(seqs, prompts, strict=True))]
    assert sum(compared) >= 8, compared  # the tiny model's near-ties leave most tokens checked


def tiny_gguf(folder, layout: str, monkeypatch):
    """A tiny random GGUF in `layout` (tools/random_gguf.py), converted as served; its folder."""
    from ringserve.gpu.loader.model_store import resolve_model
    from ringserve.tools.random_gguf import Shape, write_random_gguf

    monkeypatch.setenv("RINGSERVE_CACHE", str(folder / "cache"))
    path = folder / f"tiny-{layout}.gguf"
    # NOTE: as small as K-quant rows allow (256): the host runs every CUDA thread as a fiber
    write_random_gguf(path, Shape(hidden=256, layers=1, heads=4, kv_heads=2, ffn=256, vocab=384,
                                  context=MAX_MODEL_LEN), layout, progress=False)
    return resolve_model(str(path))


# A prefill of 69 rows (> MATVEC_MAX_ROWS: the LARGE_BATCH kernel, or the large_batch asked), then
# decodes of 3 (the mat-vec kernels).
PACKED_PROMPTS = [[1, 5, 9, 33, 7], [1, 200, 3], [1] + list(range(40, 100))]
GGUF_LAYOUTS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m"]


@pytest.mark.parametrize("layout", GGUF_LAYOUTS)
def test_a_packed_gguf_forward_matches_the_cpu_backend(tmp_path_factory, cuda_host, monkeypatch, layout):
    """A tiny random GGUF of each block type (q4_k_m: llama.cpp's mix, Q6_K v and lm_head in a
    fused QKV of Q4_K q/k), converted as served: its weights stay packed through the CUDA
    runner's store (QuantStore) and ops (quant.cu: prefills through dequantized chunks and the
    GEMM, decodes through the mat-vec kernels, the packed embedding), against the CPU backend's
    own packed kernels, eagerly and graph-shaped."""
    model_dir = tiny_gguf(tmp_path_factory.mktemp(f"gguf-{layout}"), layout, monkeypatch)
    host = HostRunner(model_dir, cuda_host)
    kept = {type(w).__name__ for layer in host.weights.layers for w in (layer.qkv, layer.gate_up, layer.down)}
    assert kept == ({"QuantWeight", "SplitWeight"} if layout == "q4_k_m" else {"QuantWeight"})
    # the compact scale planes, end to end: each type in its form (test_cuda_quant_host.py FORMS)
    linears = [p for layer in host.weights.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
               for p in getattr(w, "parts", (w,))]
    assert {(w.qtype, form(w)) for w in linears} == {(t, FORMS[t]) for t in {w.qtype for w in linears}}
    assert {w.qtype for w in linears} & {layout.upper(), "Q4_K"}
    prompts = PACKED_PROMPTS
    tables = np.random.default_rng(3).permutation(NUM_BLOCKS)[:3 * 4].reshape(3, 4).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE))
    decode_against_cpu(cpu, host, prompts, tables, BLOCK_SIZE, 2, graph=True)  # prefill, one decode


def test_a_packed_gguf_served_in_bf16_matches_the_cpu_backend(tmp_path_factory, cuda_host, monkeypatch):
    """A tiny Q4_K_M GGUF with --dtype bfloat16: the packed planes as ever, bf16 activations and
    KV cache (quant.cu's matvec_*_bf16 for the decodes, with large_batch="dequant" dequant_*_bf16
    chunks and the bf16 GEMM for the 69-row prefill, the other kernels' _bf16), against the CPU
    backend (the tiled GEMM's bf16 kernels: tests/test_cuda_quant_host.py)."""
    model_dir = tiny_gguf(tmp_path_factory.mktemp("gguf-bf16"), "q4_k_m", monkeypatch)
    host = HostRunner(model_dir, cuda_host, dtype="bfloat16", large_batch="dequant")
    launched = []
    call = host.ops.quant.call
    host.ops.quant.call = lambda name, *args: (launched.append(name), call(name, *args))[1]
    tables = np.random.default_rng(3).permutation(NUM_BLOCKS)[:3 * 4].reshape(3, 4).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE))
    decode_against_cpu(cpu, host, PACKED_PROMPTS, tables, BLOCK_SIZE, 2, graph=True)
    assert host.caches[0][0].dtype == np.uint16
    assert {"matvec_u4_r4_bf16", "dequant_u4_bf16", "dequant_u6_bf16"} <= set(launched)
    assert not any(n.startswith("matvec_") and not n.endswith("_bf16") for n in launched)


def test_a_packed_prefill_through_the_tiled_gemm_matches_the_cpu_backend(tmp_path_factory, cuda_host,
                                                                         monkeypatch):
    """The large_batch="tiled" policy: the 69-row prefill of a tiny Q4_K_M GGUF (Q4_K and Q6_K
    parts: u4 and u6 planes, a fused QKV split in two) through quant.cu's gemm_* on the
    host's tensor-core emulation, no workspace chunk and no GEMM of dequantized weights; the
    decode after it through the mat-vec; against the CPU backend."""
    model_dir = tiny_gguf(tmp_path_factory.mktemp("gguf-tiled"), "q4_k_m", monkeypatch)
    host = HostRunner(model_dir, cuda_host, large_batch="tiled")
    launched = []
    call = host.ops.quant.call
    host.ops.quant.call = lambda name, *args: (launched.append(name), call(name, *args))[1]
    host.ops.quant.gemm = host.ops.quant.workspace = None  # the tiled path uses neither
    tables = np.random.default_rng(3).permutation(NUM_BLOCKS)[:3 * 4].reshape(3, 4).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE))
    decode_against_cpu(cpu, host, PACKED_PROMPTS, tables, BLOCK_SIZE, 2, graph=True)
    assert {"gemm_u4_m128", "gemm_u6_m128"} <= set(launched)  # 69 rows: 128 a block
    assert not any(n.startswith("dequant_") and n.endswith("f16") for n in launched)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_an_int4_checkpoint_forward_matches_the_cpu_backend(tmp_path, cuda_host, method):
    """A tiny AWQ / GPTQ checkpoint (tests/test_hf_quant.py): its linears stay u4 planes on the
    CUDA side (group-128 scales), against the CPU backend, which widens them to float32."""
    from test_hf_quant import make_int4_llama

    model_dir, _ = make_int4_llama(tmp_path / method, method)
    host = HostRunner(model_dir, cuda_host)
    assert all(getattr(layer.qkv, "qtype", None) == method.upper() for layer in host.weights.layers)
    assert {form(layer.qkv) for layer in host.weights.layers} == {FORMS[method.upper()]}  # GPTQ: fp16
    prompts = PACKED_PROMPTS
    tables = np.random.default_rng(3).permutation(NUM_BLOCKS)[:3 * 4].reshape(3, 4).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE))
    decode_against_cpu(cpu, host, prompts, tables, BLOCK_SIZE, 2, graph=True)


@pytest.mark.parametrize("dtype", ["auto", "float16"])
def test_a_bf16_checkpoint_forward_matches_the_cpu_backend(tmp_path, cuda_host, dtype):
    """A tiny Llama stored in bfloat16 (tools/tiny_llama.py dtype="bfloat16", tied: the table is
    the embedding and the lm_head). auto serves it in bf16 as vLLM does: every weight the file's
    bits, bf16 activations and KV cache, the linears through the GEMM (cuBLAS's stand-in in
    bf16), every kernel's _bf16 instantiation; --dtype float16 narrows it (exactly, at these
    magnitudes) and runs the fp16 kernels. Against the CPU backend, which keeps the weights
    bf16 and computes in float32."""
    from ringserve.tools.tiny_llama import make_tiny_llama

    # NOTE: one layer, as the GGUF models above: the host runs every CUDA thread as a fiber
    model_dir = make_tiny_llama(tmp_path / "bf16", dtype="bfloat16", num_layers=1,
                                **TINY_CUDA_MODELS["tied-g3"])
    host = HostRunner(model_dir, cuda_host, dtype=dtype)
    w = host.weights
    want = np.uint16 if dtype == "auto" else F16
    assert host.dtype == ("bfloat16" if dtype == "auto" else "float16")
    assert all(m.dtype == want for layer in w.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert w.embed.dtype == want and w.lm_head is w.embed and host.caches[0][0].dtype == want
    prompts = PACKED_PROMPTS
    tables = np.random.default_rng(3).permutation(NUM_BLOCKS)[:3 * 4].reshape(3, 4).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE))
    decode_against_cpu(cpu, host, prompts, tables, BLOCK_SIZE, 2, graph=True)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_a_qwen3_forward_matches_the_cpu_backend(tmp_path, cuda_host, default_model_dir, dtype):
    """A tiny random Qwen3 (tools/tiny_models.py; head_dim 64 where hidden / heads is 32): fused.cu's
    qk_norm (one warp per q or k head) before RoPE, in fp16 and bf16, prefill then graph-shaped
    decode against the CPU backend's logits."""
    import json

    from ringserve.tools.tiny_models import make_tiny_model

    config = json.loads((Path(__file__).parent / "data" / "qwen3_tiny" / "config.json").read_text())
    config |= dict(head_dim=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                   layer_types=["full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    # NOTE: one layer, as the GGUF models above: the host runs every CUDA thread as a fiber
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", config=tmp_path / "config.json",
                                tokenizer_dir=default_model_dir)
    host = HostRunner(model_dir, cuda_host, dtype=dtype)
    assert host.weights.layers[0].qk_norm.shape == (128,)
    tables = np.random.default_rng(3).permutation(NUM_BLOCKS)[:3 * 4].reshape(3, 4).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE))
    decode_against_cpu(cpu, host, PACKED_PROMPTS, tables, BLOCK_SIZE, 2, graph=True)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_a_sliding_window_forward_matches_the_cpu_backend(tmp_path, cuda_host, default_model_dir, dtype):
    """A tiny random Mistral (tools/tiny_models.py) with a window of 7 on its one layer: a
    61-token prefill (a window of 7 inside blocks of 16), then graph-shaped decodes whose block
    tables hold -1 for the blocks before each request's window (freed, as engine/kv_cache.py
    leaves them; the graph's split-K partitions from the window), against the CPU backend."""
    import json

    from ringserve.tools.tiny_models import make_tiny_model

    window = 7
    config = json.loads((Path(__file__).parent / "data" / "mistral_tiny" / "config.json").read_text())
    config |= dict(head_dim=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                   sliding_window=window)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_dir = make_tiny_model("mistral", tmp_path / "mistral", config=tmp_path / "config.json",
                                tokenizer_dir=default_model_dir)
    host = HostRunner(model_dir, cuda_host, dtype=dtype)
    assert [layer.sliding_window for layer in host.weights.layers] == [window]
    tables = np.random.default_rng(5).permutation(NUM_BLOCKS)[:3 * 5].reshape(3, 5).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE))
    seqs, new = [list(p) for p in PACKED_PROMPTS], [list(p) for p in PACKED_PROMPTS]
    for step in range(3):
        batch = next_batch(seqs, new, tables, BLOCK_SIZE)
        if step:  # each decode's blocks wholly before its window: freed
            batch.block_tables = tables.copy()
            for r, seq in enumerate(seqs):
                batch.block_tables[r, :max(0, len(seq) - window) // BLOCK_SIZE] = -1
            assert (batch.block_tables == -1).any()
        want = cpu.execute(batch)
        assert_logits_close(host.graph_shaped(batch) if step else host.eager(batch), want)
        for r, seq in enumerate(seqs):
            seq.append(int(want[r].argmax()))
            new[r] = [seq[-1]]


def tiny_phi3(folder: Path, tokenizer_dir: Path, heads: int = 2, max_positions: int = MAX_MODEL_LEN) -> Path:
    """The tiny Phi-3 of tests/data/phi3_tiny with 2 heads of 64 (attention.cu's smallest; 48 dims
    rotated, 24 LongRoPE factors each) or 4 of 32 (no attention.cu size, as Phi-3.5's 96: the
    Numba attention on CUDA), one layer, max_position_embeddings `max_positions` (over the
    original 16: the long factors)."""
    import json

    from ringserve.tools.tiny_models import make_tiny_model

    config = json.loads((Path(__file__).parent / "data" / "phi3_tiny" / "config.json").read_text())
    rotary_half = int(config["hidden_size"] // heads * 0.75) // 2
    steps = np.linspace(0, 1, rotary_half)
    config |= dict(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=1,
                   max_position_embeddings=max_positions, sliding_window=None)
    config["rope_parameters"] |= dict(short_factor=(1 + 0.5 * steps).tolist(),
                                      long_factor=(1 + 15 * steps * steps).tolist())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return make_tiny_model("phi3", folder / "phi3", config=folder / "config.json",
                           tokenizer_dir=tokenizer_dir)


@pytest.mark.parametrize("dtype", ["auto", "float16"])
def test_a_phi3_forward_matches_the_cpu_backend(tmp_path, cuda_host, default_model_dir, dtype):
    """A tiny random Phi-3 (tools/tiny_models.py: fused qkv_proj and gate_up_proj, 48 of 64 dims
    rotated, LongRoPE's long factors and attention factor in the table): fused.cu's rope over
    the rotary part only, in bf16 and fp16, prefill then graph-shaped decode against the CPU
    backend's logits."""
    from ringserve.gpu.settings import StepLimits

    model_dir = tiny_phi3(tmp_path, default_model_dir)
    host = HostRunner(model_dir, cuda_host, dtype=dtype)
    assert host.ropes["full_attention"][0].shape[1] == 24
    assert host.config.rotary_dim == 48 < host.config.head_dim
    tables = np.random.default_rng(3).permutation(NUM_BLOCKS)[:3 * 4].reshape(3, 4).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE),
                      StepLimits(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN))
    decode_against_cpu(cpu, host, PACKED_PROMPTS, tables, BLOCK_SIZE, 2, graph=True)


def test_a_gemma3_forward_matches_the_cpu_backend(tmp_path, cuda_host, default_model_dir):
    """A tiny random Gemma 3 (tools/tiny_models.py; head_dim 64, two layers: one sliding with a
    window of 16, the 61-token prompt runs past it, one full on the other RoPE base):
    fused.cu's rms_norm (the attention and MLP outputs' norms) and gelu_tanh_mul, the
    embedding scale, attention.cu's window, in bf16 (what auto serves a float32 Gemma in; fp16
    is refused: dtypes.FP16_UNSTABLE), prefill then graph-shaped decode against the CPU
    backend's logits."""
    import json

    from ringserve.tools.tiny_models import make_tiny_model

    config = json.loads((Path(__file__).parent / "data" / "gemma3_tiny" / "config.json").read_text())
    config |= dict(head_dim=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                   sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_dir = make_tiny_model("gemma3", tmp_path / "gemma3", config=tmp_path / "config.json",
                                tokenizer_dir=default_model_dir)
    host = HostRunner(model_dir, cuda_host)
    assert host.dtype == "bfloat16" and [layer.sliding_window for layer in host.weights.layers] == [16, 0]
    tables = np.random.default_rng(3).permutation(NUM_BLOCKS)[:3 * 4].reshape(3, 4).astype(np.int32)
    cpu = ModelRunner(model_dir, DeviceConfig(device="cpu"),
                      CacheConfig(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE))
    decode_against_cpu(cpu, host, PACKED_PROMPTS, tables, BLOCK_SIZE, 2, graph=True)
