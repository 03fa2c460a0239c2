"""The CUDA model runner: the face of gpu/runner.py's ModelRunner (execute(batch) -> float32
logits [B, V]) on one GPU. fp16 weights and KV cache, float32 residual stream and accumulation.

GEMMs are cuBLAS through CuPy with fused QKV and gate-up weights; the fused math is CUDA C
(fused.cu, attention.cu); the indexing is Numba CUDA (numba_kernels.py), launched on the same
CuPy stream through numba.cuda.external_stream so that a CUDA graph captures it too. Decode
batches replay graphs captured for the ladder in gpu/cuda/plan.py; everything a graph touches
is allocated before its capture.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import cupy as cp
import numpy as np
from numba import cuda as nb_cuda

from ringserve.gpu.batch import Batch
from ringserve.gpu.config import ModelConfig
from ringserve.gpu.cuda import numba_kernels as nk
from ringserve.gpu.cuda import plan
from ringserve.gpu.cuda.attention import PagedAttention
from ringserve.gpu.cuda.fused import FusedKernels
from ringserve.gpu.cuda import sampling_kernels as sk
from ringserve.gpu.cuda.sampler import CudaSampler, PendingSample
from ringserve.gpu.prompt_logprobs import SLICE_ROWS, PromptLogprobsSpec, WithPromptLogprobs
from ringserve.gpu.rope import cos_sin, inv_freq
from ringserve.gpu.sampler import Logprobs, SamplingMetadata

log = logging.getLogger(__name__)


def _nb(x):
    """A Numba view of a CuPy array, without the CAI stream sync (illegal during capture)."""
    return nb_cuda.as_cuda_array(x, sync=False)


@dataclass
class Layer:
    input_norm: cp.ndarray
    qkv: cp.ndarray
    qkv_bias: cp.ndarray | None
    o: cp.ndarray
    post_norm: cp.ndarray
    gate_up: cp.ndarray
    down: cp.ndarray


class StepBuffers:
    """Every activation of one forward over T tokens and B requests (static for a graph)."""

    PER_TOKEN = ("input_ids", "positions", "slot_mapping", "h", "x", "delta", "qkv", "attn",
                 "gate_up", "act")
    PER_REQUEST = ("seq_lens", "block_tables", "logits_indices", "last", "logits16", "logits")

    def __init__(self, c: ModelConfig, T: int, B: int, max_blocks: int):
        self.input_ids = cp.zeros(T, cp.int32)
        self.positions = cp.zeros(T, cp.int32)
        self.slot_mapping = cp.full(T, -1, cp.int32)
        self.query_start_loc = cp.zeros(B + 1, cp.int32)
        self.seq_lens = cp.zeros(B, cp.int32)
        self.block_tables = cp.full((B, max_blocks), -1, cp.int32)
        self.logits_indices = cp.zeros(B, cp.int32)
        self.h = cp.empty((T, c.hidden_size), cp.float32)
        self.x = cp.empty((T, c.hidden_size), cp.float16)
        self.delta = cp.empty((T, c.hidden_size), cp.float16)
        self.qkv = cp.empty((T, c.q_size + 2 * c.kv_size), cp.float16)
        self.attn = cp.empty((T, c.q_size), cp.float16)
        self.gate_up = cp.empty((T, 2 * c.intermediate_size), cp.float16)
        self.act = cp.empty((T, c.intermediate_size), cp.float16)
        self.last = cp.empty((B, c.hidden_size), cp.float16)
        self.logits16 = cp.empty((B, c.vocab_size), cp.float16)
        self.logits = cp.empty((B, c.vocab_size), cp.float32)

    def leading(self, T: int, B: int) -> StepBuffers:
        """Views of the first T tokens and B requests. Every graph size takes its buffers from
        the largest one's: graphs replay one at a time on one stream, and the memory of the
        smaller sizes' activations and logits is not spent again."""
        view = object.__new__(StepBuffers)
        for name in self.PER_TOKEN:
            setattr(view, name, getattr(self, name)[:T])
        for name in self.PER_REQUEST:
            setattr(view, name, getattr(self, name)[:B])
        view.query_start_loc = self.query_start_loc[:B + 1]
        return view

    def load(self, b) -> None:
        """Copy a Batch (or a padded decode) into the buffers' leading rows, on the current
        stream. The block table goes into the top-left [B, width] corner with one 2-D copy;
        the columns past width are never read (plan.PaddedDecode)."""
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
            src = np.ascontiguousarray(getattr(b, name), np.int32)
            getattr(self, name)[:len(src)].set(src)
        self.logits_indices[:len(b.seq_lens)].set(np.ascontiguousarray(b.query_start_loc[1:] - 1, np.int32))
        tables = np.ascontiguousarray(b.block_tables, np.int32)
        rows, width = tables.shape
        if rows and width:
            dst = self.block_tables
            cp.cuda.runtime.memcpy2DAsync(dst.data.ptr, dst.strides[0], tables.ctypes.data,
                                          tables.strides[0], width * 4, rows,
                                          cp.cuda.runtime.memcpyHostToDevice,
                                          cp.cuda.get_current_stream().ptr)


class CudaModelRunner:
    def __init__(self, config: ModelConfig, weights: dict, *, block_size: int = 16,
                 num_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 attention_backend: str = "auto"):
        """weights: HF names -> numpy or CuPy arrays (gpu_check makes them on the GPU).
        attention_backend: "rawkernel" (attention.cu, the fast path; also "auto") or "numba"."""
        if attention_backend not in ("auto", "rawkernel", "numba"):
            raise ValueError(f"attention_backend {attention_backend!r}: auto, rawkernel or numba")
        attention_backend = "rawkernel" if attention_backend == "auto" else attention_backend
        c = self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len or c.max_position_embeddings
        self.max_blocks = -(-self.max_model_len // block_size)
        self.attention_backend = attention_backend
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.nb_stream = nb_cuda.external_stream(self.stream.ptr)
        self.fused = FusedKernels()
        self.attention = PagedAttention(c.head_dim, c.num_attention_heads // c.num_key_value_heads)
        self.num_sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.sampler = CudaSampler(threads=1024, stream=self.nb_stream)
        self._load_weights(weights)
        cos, sin = cos_sin(np.arange(self.max_model_len), inv_freq(c))
        self.cos, self.sin = cp.asarray(cos), cp.asarray(sin)
        self.scale = c.head_dim ** -0.5
        self.eps = c.rms_norm_eps

        if num_blocks is None:
            num_blocks = self._profile_num_blocks(max_num_batched_tokens, gpu_memory_utilization)
        self.num_blocks = int(num_blocks)
        shape = (self.num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches = [(cp.zeros(shape, cp.float16), cp.zeros(shape, cp.float16))
                          for _ in range(c.num_hidden_layers)]
        self.graphs = plan.GraphTable(plan.graph_batch_sizes(max_num_seqs))
        self._graph_buffers: dict[int, StepBuffers] = {}  # views of one set (capture_graphs)
        if not enforce_eager:
            self.capture_graphs()

    @classmethod
    def from_dir(cls, model_dir: str | Path, **kwargs) -> CudaModelRunner:
        from ringserve.gpu.weights import load_weights
        return cls(ModelConfig.from_dir(model_dir), load_weights(model_dir), **kwargs)

    def _load_weights(self, w: dict) -> None:
        c = self.config

        def f16(*names):
            return cp.ascontiguousarray(cp.concatenate([cp.asarray(w[n], cp.float16) for n in names]))

        self.embed = f16("model.embed_tokens.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else f16("lm_head.weight")
        self.final_norm = f16("model.norm.weight")
        self.layers = []
        for i in range(c.num_hidden_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            self.layers.append(Layer(
                input_norm=f16(p + "input_layernorm.weight"),
                qkv=f16(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                qkv_bias=f16(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                if c.attention_bias else None,
                o=f16(a + "o_proj.weight"), post_norm=f16(p + "post_attention_layernorm.weight"),
                gate_up=f16(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=f16(p + "mlp.down_proj.weight")))

    def _profile_num_blocks(self, max_tokens: int, utilization: float) -> int:
        """Run the largest forward once (over a 1-block cache, writing nothing) and give the KV
        pool what the weights and that forward's peak left of the allowed share."""
        c = self.config
        T = min(max_tokens, self.max_model_len)
        tiny = [(cp.zeros((1, self.block_size, c.num_key_value_heads, c.head_dim), cp.float16),) * 2
                for _ in range(c.num_hidden_layers)]
        batch = Batch(np.zeros(T, np.int32), np.arange(T, dtype=np.int32), np.full(T, -1, np.int32),
                      np.array([0, T], np.int32), np.array([T], np.int32),
                      np.zeros((1, -(-T // self.block_size)), np.int32))
        self._eager(batch, tiny)
        self.stream.synchronize()
        free, total = cp.cuda.runtime.memGetInfo()
        per_block = plan.kv_bytes_per_block(num_layers=c.num_hidden_layers, block_size=self.block_size,
                                            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                            itemsize=2)
        return plan.num_kv_blocks(total_bytes=total, used_bytes_after_profile=total - free,
                                  bytes_per_block=per_block, gpu_memory_utilization=utilization)

    # The forward over buffers already loaded with the step's arrays.
    def _forward(self, buf: StepBuffers, caches, splits: int, max_seq_len: int, workspace) -> None:
        c, s, f = self.config, self.stream, self.fused
        threads = 128
        nk.embedding(_nb(buf.input_ids), _nb(self.embed), _nb(buf.h), threads=threads, stream=self.nb_stream)
        f.add_rms_norm(buf.h, None, self.layers[0].input_norm, buf.x, self.eps, s)
        for i, (layer, (kc, vc)) in enumerate(zip(self.layers, caches)):
            cp.matmul(buf.x, layer.qkv.T, out=buf.qkv)
            if layer.qkv_bias is not None:
                buf.qkv += layer.qkv_bias
            f.rope(buf.qkv, buf.positions, self.cos, self.sin,
                   c.num_attention_heads + c.num_key_value_heads, c.head_dim, s)
            nk.store_kv(_nb(buf.qkv), _nb(buf.slot_mapping), _nb(kc), _nb(vc),
                        c.num_attention_heads, threads=threads, stream=self.nb_stream)
            args = (buf.qkv, kc, vc, buf.positions, buf.query_start_loc, buf.seq_lens, buf.block_tables)
            if self.attention_backend == "rawkernel":
                self.attention(*args, self.scale, buf.attn, s, splits=splits,
                               max_seq_len=max_seq_len, workspace=workspace)
            else:
                nk.paged_attention(*(_nb(a) for a in args), self.scale, _nb(buf.attn),
                                   threads=threads, stream=self.nb_stream)
            cp.matmul(buf.attn, layer.o.T, out=buf.delta)
            f.add_rms_norm(buf.h, buf.delta, layer.post_norm, buf.x, self.eps, s)
            cp.matmul(buf.x, layer.gate_up.T, out=buf.gate_up)
            f.silu_mul(buf.gate_up, buf.act, s)
            cp.matmul(buf.act, layer.down.T, out=buf.delta)
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            f.add_rms_norm(buf.h, buf.delta, nxt, buf.x, self.eps, s)
        nk.gather_rows(_nb(buf.x), _nb(buf.logits_indices), _nb(buf.last), threads=threads,
                       stream=self.nb_stream)
        cp.matmul(buf.last, self.lm_head.T, out=buf.logits16)
        buf.logits[...] = buf.logits16

    def _eager(self, batch: Batch, caches) -> StepBuffers:
        with self.stream:
            buf = StepBuffers(self.config, batch.num_tokens, batch.num_reqs, batch.block_tables.shape[1])
            buf.load(batch)
            max_len = int(batch.seq_lens.max())
            splits = plan.attention_splits(num_tokens=batch.num_tokens,
                                           num_kv_heads=self.config.num_key_value_heads,
                                           max_seq_len=max_len, num_sms=self.num_sms)
            ws = self.attention.workspace(batch.num_tokens, self.config.num_attention_heads, splits)
            self._forward(buf, caches, splits, max_len, ws)
            return buf

    def capture_graphs(self) -> None:
        """One graph per ladder size over views of one set of buffers (the largest size's) and
        one attention workspace (the largest any size needs): nothing is allocated per size,
        and nothing during a capture."""
        t0 = time.perf_counter()
        c = self.config
        splits = {size: plan.attention_splits(num_tokens=size, num_kv_heads=c.num_key_value_heads,
                                              max_seq_len=self.max_model_len, num_sms=self.num_sms)
                  for size in self.graphs.sizes}
        largest = self.graphs.sizes[-1]
        with self.stream:
            shared = StepBuffers(c, largest, largest, self.max_blocks)
            # The kernels index the workspace by their own launch's (T, H, splits): any buffer
            # of at least T * H * splits rows of each size serves them all.
            ws = self.attention.workspace(largest, c.num_attention_heads, max(splits.values()))
            shared.query_start_loc.set(np.arange(largest + 1, dtype=np.int32))
            shared.logits_indices.set(np.arange(largest, dtype=np.int32))
        for size in reversed(self.graphs.sizes):
            t = time.perf_counter()
            buf = shared.leading(size, size)
            workspace = ws if splits[size] > 1 else (None, None)
            with self.stream:
                # warm-up: compiles, cuBLAS plans; slots -1 and seq_lens 0 write and read nothing
                self._forward(buf, self.kv_caches, splits[size], self.max_model_len, workspace)
                self.stream.synchronize()
                self.stream.begin_capture()
                self._forward(buf, self.kv_caches, splits[size], self.max_model_len, workspace)
                graph = self.stream.end_capture()
            self._graph_buffers[size] = buf
            self.graphs.add(size, graph, time.perf_counter() - t)
        self.stream.synchronize()
        log.info("captured %d CUDA graphs (batch sizes %s) in %.2f s", len(self.graphs.sizes),
                 self.graphs.sizes, time.perf_counter() - t0)

    def _launch(self, batch: Batch) -> tuple[cp.ndarray, StepBuffers]:
        """Enqueue the forward on self.stream; the logits [B, V] float32 on the device and the
        buffers holding every token's final hidden state (.x). A graph's buffers are static:
        valid until the next launch, which the stream orders after everything enqueued on them."""
        size = self.graphs.pick(batch)
        if size is not None and batch.block_tables.shape[1] <= self.max_blocks:
            buf = self._graph_buffers[size]
            with self.stream:
                buf.load(plan.pad_decode(batch, size, self.max_blocks))
                self.graphs.graphs[size].launch(self.stream)
            return buf.logits[:batch.num_reqs], buf
        with self.stream:
            buf = self._eager(batch, self.kv_caches)
        return buf.logits, buf

    def _logits_at(self, x: cp.ndarray, rows: np.ndarray) -> cp.ndarray:
        """float32 logits [len(rows), V] of final hidden states x at `rows` (enqueued)."""
        with self.stream:
            h = x[cp.asarray(np.asarray(rows, np.int64))]
            return cp.matmul(h, self.lm_head.T).astype(cp.float32)

    def execute(self, batch: Batch, logits_indices: np.ndarray | None = None) -> np.ndarray:
        """float32 logits at rows logits_indices of the super-sequence (default: each request's
        last scheduled token, [B, vocab]); writes K/V."""
        if batch.num_tokens == 0:
            return np.empty((batch.num_reqs, self.config.vocab_size), np.float32)
        logits, buf = self._launch(batch)
        if logits_indices is not None:
            logits = self._logits_at(buf.x, logits_indices)
        out = logits.get(stream=self.stream)
        self.stream.synchronize()
        return out

    def submit(self, batch: Batch, rows: np.ndarray, metadata: SamplingMetadata,
               prompt_logprobs: PromptLogprobsSpec | None = None):
        """The forward, then sampling on the device for `rows` (the batch's requests whose last
        token this step computes), all enqueued on self.stream: only the token ids (and the
        logprobs asked for) come back, into pinned memory. Returns at once; result() waits.
        prompt_logprobs: also score tokens at those rows of the super-sequence, on the device
        (gpu/cuda/sampling_kernels.logprobs over SLICE_ROWS rows of logits at a time)."""
        logits, buf = self._launch(batch)
        if len(rows) == 0:  # chunked prefills only: nothing to sample, the forward still runs
            event = nb_cuda.event()
            event.record(self.nb_stream)
            step = PendingSample(event, np.zeros(0, np.int32), None)
        else:
            if len(rows) < batch.num_reqs:
                with self.stream:
                    logits = logits[cp.asarray(np.asarray(rows, np.int64))]
            step = self.sampler.sample_async(_nb(logits), metadata)
        if prompt_logprobs is None:
            return step
        return WithPromptLogprobs(step, self._prompt_logprobs(buf.x, prompt_logprobs))

    def _prompt_logprobs(self, x: cp.ndarray, spec: PromptLogprobsSpec):
        """Enqueue the logprobs of spec's tokens at spec's rows; returns fetch() -> Logprobs."""
        P, V = len(spec), self.config.vocab_size
        n = 1 + min(spec.num_top, V)
        with self.stream:
            ids = cp.empty((P, n), cp.int32)
            vals = cp.empty((P, n), cp.float32)
            rank = cp.empty(P, cp.int32)
            targets = cp.asarray(np.asarray(spec.token_ids, np.int32))
            for s in range(0, P, SLICE_ROWS):
                e = min(P, s + SLICE_ROWS)
                logits = self._logits_at(x, spec.rows[s:e])
                sk.logprobs(_nb(logits), _nb(targets[s:e]), _nb(ids[s:e]), _nb(vals[s:e]),
                            _nb(rank[s:e]), threads=self.sampler.threads, stream=self.nb_stream)

        def fetch() -> Logprobs:
            out = Logprobs(ids.get(stream=self.stream), vals.get(stream=self.stream),
                           rank.get(stream=self.stream))
            self.stream.synchronize()
            return out
        return fetch
