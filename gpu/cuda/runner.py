"""The CUDA model runner: gpu/runner.py's Runner face on one GPU. Weights, activations and KV
cache in the serving dtype (gpu/cuda/dtypes.py: by default a bfloat16 checkpoint in bf16, the
others in fp16; a GGUF or AWQ/GPTQ checkpoint's packed planes read by quant.cu:
gpu/cuda/quant_linear.py), float32 residual stream and accumulation.

The model is the checkpoint's (gpu/models: Llama or Gemma 3) forward over CudaOps: GEMMs are
cuBLAS on the runner's own handle (gpu/cuda/gemm.py, nvmath-python's binding: CuPy's refuses to
run during a capture) with fused QKV and gate-up weights; the fused math is CUDA C (fused.cu,
attention.cu); the indexing is Numba CUDA (numba_kernels.py), launched on the same CuPy stream
through numba.cuda.external_stream so that a CUDA graph captures it too. Decode batches replay
graphs captured for the ladder in gpu/cuda/plan.py, and with speculative decoding its verify
steps (1 + K tokens and rows of logits per request) replay graphs of their own ladder;
everything a graph touches is allocated before its capture, an allocation during one raises
(gpu/cuda/capture.py), and everything it touches is held for the graph's life, by the runner
or by the graph's record (buffers.CapturedGraph). Set-up (weights, RoPE tables, KV pool) ends
with a device synchronize, and every kernel is compiled and run once before the first request
(warm_up)."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import cupy as cp
import numpy as np
from numba import cuda as nb_cuda

from ringserve.gpu.batch import Batch
from ringserve.gpu.cuda import capture, launch, plan, step_plan
from ringserve.gpu.cuda import numba_kernels as nk
from ringserve.gpu.cuda import sampling_kernels as sk
from ringserve.gpu.cuda.attention import PagedAttention
from ringserve.gpu.cuda.buffers import AttentionLaunch, CapturedGraph, PinnedStaging, StepBuffers
from ringserve.gpu.cuda.dtypes import SERVING_DTYPES, serving_dtype
from ringserve.gpu.cuda.fused import FusedKernels
from ringserve.gpu.cuda.gemm import WORKSPACE_BYTES, CublasGemm
from ringserve.gpu.cuda.quant_linear import (
    LARGE_BATCH,
    WORKSPACE_ELEMENTS,
    QuantLinear,
    QuantStore,
    keeps_blocks,
)
from ringserve.gpu.cuda.sampler import CudaSampler, PendingSample, warmup_metadata
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.quant import QuantWeight
from ringserve.gpu.models import model_definition
from ringserve.gpu.rope import rope_tables_by_type
from ringserve.gpu.sampling.prompt_logprobs import SLICE_ROWS, PromptLogprobsSpec, WithPromptLogprobs
from ringserve.gpu.sampling.sampler import Logprobs, SamplingMetadata
from ringserve.gpu.settings import CacheConfig, DeviceConfig, StepLimits

log = logging.getLogger(__name__)
NUMBA_THREADS = step_plan.NUMBA_THREADS


def _nb(x):
    """A Numba view of a CuPy array, without the CAI stream sync (illegal during capture)."""
    return nb_cuda.as_cuda_array(x, sync=False)


def _ptr(x) -> int:
    return x.data.ptr


def _pinned(nbytes: int) -> np.ndarray:
    return np.frombuffer(cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)


def _event():
    return cp.cuda.Event(disable_timing=True)


def _empty_step() -> Batch:
    """No requests and no tokens: padded to a graph's shape it writes and reads nothing (what
    a graph is warmed and captured over)."""
    return Batch(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(1, np.int32),
                 np.zeros(0, np.int32), np.zeros((0, 1), np.int32))


class CudaOps:
    """model.ModelOps (and buffers.HostCopies) on one CuPy stream: RawKernels, Numba kernels
    (on the same stream via external_stream) and cuBLAS on its own handle (CublasGemm: never a
    CuPy GEMM, which raises during capture); everything is enqueued, nothing waits."""

    def __init__(self, c: ModelConfig, stream: cp.cuda.Stream, attention_backend: str,
                 packed: bool = False, act_dtype=np.float16):
        """packed: the model keeps weights packed (quant.cu, and a static workspace in the
        activations' dtype act_dtype, float16 or uint16 bf16 bits, where LARGE_BATCH is "dequant")."""
        try:
            from nvmath.bindings import cublas
        except ImportError as e:
            raise ImportError(f"the CUDA runner's GEMMs need nvmath-python (the `cuda` extra: "
                              f"pip install -e '.[cuda]'): {e}") from e
        self.stream = stream
        self.gemm_workspace = cp.empty(WORKSPACE_BYTES, cp.uint8)
        self.gemm = CublasGemm(cublas, stream.ptr, self.gemm_workspace.data.ptr, WORKSPACE_BYTES, _ptr)
        self.staging = PinnedStaging(_pinned, _event)
        self.nb_stream = nb_cuda.external_stream(stream.ptr)
        self.fused = FusedKernels()
        self.quant: QuantLinear | None = None
        if packed:
            from ringserve.gpu.cuda.quant import QuantKernels
            # NOTE: the workspace only where the table runs dequantize + cuBLAS (the tiled GEMM needs none)
            workspace = cp.empty(WORKSPACE_ELEMENTS, act_dtype) if LARGE_BATCH == "dequant" else None
            self.quant = QuantLinear(QuantKernels(stream).call, self.gemm, workspace)
        self.paged = PagedAttention(c.head_dim, c.num_attention_heads // c.num_key_value_heads)
        self.attention_backend = attention_backend
        self.scale, self.eps = c.attention_scale, c.rms_norm_eps
        self.head_dim, self.num_heads = c.head_dim, c.num_attention_heads
        self.num_rot_heads = c.num_attention_heads + c.num_key_value_heads  # q and k heads

    def copy_in(self, dst, src: np.ndarray) -> None:
        host = self.staging.stage(src)  # NOTE: pinned, or the copy waits for the stream
        dst[:len(src)].set(host, stream=self.stream)
        self.staging.issued(self.stream)

    def copy_in_corner(self, dst, src: np.ndarray) -> None:
        rows, cols = src.shape
        host = self.staging.stage(src)
        cp.cuda.runtime.memcpy2DAsync(dst.data.ptr, dst.strides[0], host.ctypes.data, host.strides[0],
                                      cols * host.itemsize, rows, cp.cuda.runtime.memcpyHostToDevice,
                                      self.stream.ptr)
        self.staging.issued(self.stream)

    def embedding(self, ids, table, out) -> None:
        if isinstance(table, QuantWeight):  # a packed table (QuantStore)
            assert self.quant is not None
            self.quant.embedding(ids, table, out)
            return
        nk.embedding(_nb(ids), _nb(table), _nb(out), threads=NUMBA_THREADS, stream=self.nb_stream)

    def linear(self, x, weight, out) -> None:
        if self.quant is not None:  # packed weights: quant.cu, or the GEMM for fp16 ones
            self.quant(x, weight, out)
        else:
            self.gemm(x, weight, out)

    def add_bias(self, x, bias) -> None:
        self.fused.add_bias(x, bias, self.stream)

    def add_rms_norm(self, h, delta, weight, out) -> None:
        self.fused.add_rms_norm(h, delta, weight, out, self.eps, self.stream)

    def rms_norm(self, x, weight) -> None:
        self.fused.rms_norm(x, weight, self.eps, self.stream)

    def scale_embedding(self, h, factor: float) -> None:
        # NOTE: step_plan.scale_embedding: a CuPy elementwise kernel, in place (nothing allocated: graph-safe)
        with self.stream:
            cp.multiply(h, np.float32(factor), out=h)

    def qk_norm(self, qkv, weight) -> None:
        self.fused.qk_norm(qkv, weight, self.num_heads, self.num_rot_heads, self.head_dim, self.eps,
                           self.stream)

    def attention(self, buf: StepBuffers, cos, sin, k_cache, v_cache, launch: AttentionLaunch,
                  window: int) -> None:
        """A decode-only step on the RawKernel: one attention.cu launch (RoPE and the K/V write
        in it); otherwise fused.cu's rope_store_kv (q rotated in place in buf.qkv, k and v into
        the caches), then the attention kernel."""
        args = (buf.qkv, k_cache, v_cache, buf.positions, buf.query_start_loc, buf.seq_lens,
                buf.block_tables)
        if step_plan.fuses_rope(self.attention_backend, launch.decode_only):
            self.paged(*args, self.scale, buf.attn, self.stream, splits=launch.splits_for(window),
                       workspace=launch.workspace, window=window, rope=(buf.slot_mapping, cos, sin))
            return
        self.fused.rope_store_kv(buf.qkv, buf.positions, buf.slot_mapping, cos, sin, k_cache, v_cache,
                                 self.num_heads, self.head_dim, self.stream)
        if self.attention_backend == "rawkernel":
            self.paged(*args, self.scale, buf.attn, self.stream, splits=launch.splits_for(window),
                       workspace=launch.workspace, window=window)
        else:
            q, k, v, positions, qsl, seq_lens, tables = (_nb(a) for a in args)
            nk.paged_attention(q, k, v, positions, qsl, seq_lens, tables, self.scale, _nb(buf.attn),
                               window=window, threads=NUMBA_THREADS, stream=self.nb_stream)

    def silu_mul(self, gate_up, out) -> None:
        self.fused.silu_mul(gate_up, out, self.stream)

    def gelu_tanh_mul(self, gate_up, out) -> None:
        self.fused.gelu_tanh_mul(gate_up, out, self.stream)

    def gather_rows(self, x, indices, out) -> None:
        nk.gather_rows(_nb(x), _nb(indices), _nb(out), threads=NUMBA_THREADS, stream=self.nb_stream)

    def to_float32(self, src, out) -> None:
        self.fused.to_float32(src, out, self.stream)


class CudaModelRunner:
    device = "cuda"
    asynchronous = True  # submit() only enqueues the step

    def __init__(self, config: ModelConfig, weights: dict, device: DeviceConfig, cache: CacheConfig,
                 limits: StepLimits, *, mirror: CudaModelRunner | None = None, defer_kv_cache: bool = False):
        """weights: HF names -> numpy or CuPy arrays (gpu_check makes them on the GPU).
        The settings it reads (gpu/settings.py): device.attention_backend ("rawkernel":
        attention.cu, the fast path; "numba"; "auto": the RawKernel where it handles the head
        size, gpu/cuda/launch.attention_backend_for), device.dtype (auto, float16 or bfloat16:
        gpu/cuda/dtypes.py), device.enforce_eager; cache.kv_cache_dtype (auto or the serving
        dtype: the kernels read the cache in the activations' type), cache.block_size and the
        pool: cache.num_gpu_blocks_override blocks, else what cache.gpu_memory_utilization leaves
        after a profiling forward of limits.max_num_batched_tokens; graphs up to
        limits.max_num_seqs, block tables for limits.max_model_len.
        A draft model for speculative decoding (engine/draft_proposer.py: its KV pool mirrors the
        target's block ids) is built first with defer_kv_cache (weights and its graphs' step
        buffers, no pool: allocate_kv_cache later), then the target with mirror=the draft: the
        target runs on the draft's stream, its profile sees the draft's weights and buffers as
        used and sizes the pool for both (the two caches' bytes per block), and it allocates the
        draft's pool of as many blocks."""
        block_size, num_blocks = cache.block_size, cache.num_gpu_blocks_override
        attention_backend = launch.attention_backend_for(device.attention_backend, config.head_dim)
        self.dtype = serving_dtype(device.dtype, weights, config.architecture)
        if cache.kv_cache_dtype not in ("auto", self.dtype):
            raise ValueError(f"kv_cache_dtype {cache.kv_cache_dtype!r}: the CUDA backend's KV cache is in "
                             f"the serving dtype, here {self.dtype} (--kv-cache-dtype auto)")
        act = self.act_dtype = SERVING_DTYPES[self.dtype]
        c = self.config = config
        self.block_size = block_size
        self.max_model_len = limits.max_model_len or c.max_position_embeddings
        self.max_blocks = -(-self.max_model_len // block_size)
        # NOTE: one stream for a target and its draft: the draft's forwards, the verify step and
        # the next catch-up are ordered without events
        self.stream: cp.cuda.Stream = cp.cuda.Stream(non_blocking=True) if mirror is None else mirror.stream
        packed = any(keeps_blocks(t) for t in weights.values())
        self.ops = CudaOps(c, self.stream, attention_backend, packed=packed, act_dtype=act)
        self.nb_stream = self.ops.nb_stream
        self.num_sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.sampler = CudaSampler(threads=1024, stream=self.nb_stream)
        # NOTE: the set-up's arrays are made on the runner's stream, but weights the caller made
        # (gpu_check: on the legacy default stream) and CuPy's pageable uploads may still be in
        # flight, and a non-blocking stream does not wait for the default one: hence a device
        # synchronize before fusing reads them, before the first forward (the profile) and at
        # the end.
        cp.cuda.Device().synchronize()
        with self.stream:
            self.model = model_definition(c)
            self.weights = self.model.fuse(c, weights, QuantStore(cp, self.dtype))
            # one (cos, sin) per layer type, held for the graphs' life
            self.ropes = {kind: (cp.asarray(cos), cp.asarray(sin)) for kind, (cos, sin)
                          in rope_tables_by_type(c, self.max_model_len, self.max_model_len).items()}
        cp.cuda.Device().synchronize()
        log.info("weights, activations and KV cache in %s", self.dtype)

        # CapturedGraph records: decode steps', and speculative decoding's verify steps' (none without it)
        self.graphs, self.verify_graphs = plan.graph_tables(limits)
        self.enforce_eager = device.enforce_eager
        self.capture_failures: dict[int, str] = {}  # batch size -> why it runs eager
        self.verify_capture_failures: dict[int, str] = {}
        self.num_blocks = 0
        self.kv_caches: list[tuple] = []   # per layer (k, v): allocate_kv_cache
        # the graphs' one set of step buffers and attention workspace (capture_graphs)
        self._graph_buffers: tuple[StepBuffers, tuple] | None = None
        if defer_kv_cache:
            if not self.enforce_eager:  # NOTE: now, so that the target's profile counts them
                self._graph_buffers = self._allocate_graph_buffers()
            return
        if num_blocks is None:
            rows = 1 if device.enforce_eager else plan.shared_shape([self.graphs, self.verify_graphs])[2]
            num_blocks = self._profile_num_blocks(limits.max_num_batched_tokens, rows,
                                                  cache.gpu_memory_utilization,
                                                  0 if mirror is None else mirror.kv_bytes_per_block)
        self.allocate_kv_cache(int(num_blocks))
        if mirror is not None:
            mirror.allocate_kv_cache(self.num_blocks)

    @property
    def kv_bytes_per_block(self) -> int:
        c = self.config
        return plan.kv_bytes_per_block(num_layers=c.num_hidden_layers, block_size=self.block_size,
                                       num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, itemsize=2)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The KV pool of num_blocks blocks, then the graphs captured over it and every kernel
        warmed (the end of the set-up; a deferred draft's, once its target sized the pool)."""
        c = self.config
        self.num_blocks = num_blocks
        shape = (num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        with self.stream:
            self.kv_caches = [(cp.zeros(shape, self.act_dtype), cp.zeros(shape, self.act_dtype))
                              for _ in range(c.num_hidden_layers)]
        cp.cuda.Device().synchronize()
        if not self.enforce_eager:
            self.capture_graphs()
        self.warm_up()

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: DeviceConfig, cache: CacheConfig,
                 limits: StepLimits, **kw) -> CudaModelRunner:
        """kw: mirror, defer_kv_cache (a draft model and its target: __init__)."""
        from ringserve.gpu.loader.weights import load_weights
        runner = cls(ModelConfig.from_dir(model_dir), load_weights(model_dir), device, cache, limits, **kw)
        runner.model_dir = Path(model_dir)  # its tokenizer.json: the engine's structured outputs
        return runner

    model_dir: Path | None = None  # set by from_dir

    def _profile_num_blocks(self, max_tokens: int, rows: int, utilization: float,
                            mirror_per_block: int) -> int:
        """Run the largest forward once (over a 1-block cache, writing nothing), with logits at
        as many of its tokens as the graphs' shared buffers have rows (up to `rows`: a verify
        ladder's n x (1 + K) rows of vocab-wide logits are its largest buffers), and give the
        KV pool what the weights and that forward's peak left of the allowed share (each block
        also costs mirror_per_block: a draft model's block of the same id)."""
        c = self.config
        T = min(max_tokens, self.max_model_len)
        with self.stream:
            tiny = [(cp.zeros((1, self.block_size, c.num_key_value_heads, c.head_dim), self.act_dtype),) * 2
                    for _ in range(c.num_hidden_layers)]
        batch = Batch(np.zeros(T, np.int32), np.arange(T, dtype=np.int32), np.full(T, -1, np.int32),
                      np.array([0, T], np.int32), np.array([T], np.int32),
                      np.zeros((1, -(-T // self.block_size)), np.int32),
                      sample_indices=np.arange(T - min(T, rows), T, dtype=np.int32))
        self._eager(batch, tiny)
        self.stream.synchronize()
        free, total = cp.cuda.runtime.memGetInfo()
        return plan.num_kv_blocks(total_bytes=total, used_bytes_after_profile=total - free,
                                  bytes_per_block=self.kv_bytes_per_block + mirror_per_block,
                                  gpu_memory_utilization=utilization)

    def _forward(self, buf: StepBuffers, caches, attention: AttentionLaunch) -> None:
        self.model.forward(self.ops, self.weights, buf, caches, attention, self.ropes)

    def _eager(self, batch: Batch, caches) -> StepBuffers:
        with self.stream:
            buf = StepBuffers(self.config, batch.num_tokens, batch.num_reqs,
                              batch.block_tables.shape[1], cp, self.act_dtype, len(batch.logits_indices))
            buf.load(batch, self.ops)
            shape = dict(num_tokens=batch.num_tokens, num_kv_heads=self.config.num_key_value_heads,
                         max_seq_len=int(batch.seq_lens.max()), num_sms=self.num_sms)
            splits = plan.attention_splits(**shape)
            ws = self.ops.paged.workspace(batch.num_tokens, self.config.num_attention_heads, splits)
            self._forward(buf, caches, AttentionLaunch(
                splits, ws, plan.is_decode_only(batch),
                plan.window_splits(self.config.layer_windows, **shape)))
            return buf

    def capture_graphs(self) -> None:
        """One graph per ladder size (decode, and verify with speculative decoding) over views
        of one set of buffers (the largest tokens, requests and rows any size needs) and one
        attention workspace (the largest any size needs): nothing is allocated per size, and
        nothing during a capture. Each size's record (CapturedGraph) holds its views and its
        attention launch, workspace included: a graph keeps only their addresses."""
        t0 = time.perf_counter()
        c = self.config
        splits = self._graph_splits()
        shared, ws = self._graph_buffers or self._allocate_graph_buffers()
        self._graph_buffers = None  # NOTE: the graphs' records hold them from here

        def capture_size(table: plan.GraphTable, size: int):
            buf = shared.leading(*table.shape(size))
            buf.load(table.pad(_empty_step(), size, self.max_blocks), self.ops)  # slots -1, no keys
            split = splits[id(table), size]
            windows = step_plan.graph_window_splits(
                tokens=table.shape(size)[0], num_kv_heads=c.num_key_value_heads,
                max_model_len=self.max_model_len, num_sms=self.num_sms, windows=c.layer_windows)
            # NOTE: a verify graph's requests have 1 + K query tokens each: not the decode-only
            # kernel (RoPE and the KV write inside attention read one token a request).
            attention = AttentionLaunch(split, ws if split > 1 else (None, None, None),
                                        decode_only=table is self.graphs, window_splits=windows)
            with self.stream:
                # warm-up: compiles, cuBLAS plans; slots -1 and seq_lens 0 write and read nothing
                self._forward(buf, self.kv_caches, attention)
                self.stream.synchronize()
                graph = capture.capture(
                    self.stream, lambda: self._forward(buf, self.kv_caches, attention),
                    lambda: cp.cuda.using_allocator(capture.refuse_allocation))
            return CapturedGraph(graph, buf, attention)

        self.capture_failures = capture.capture_ladder(self.graphs, lambda n: capture_size(self.graphs, n))
        self.verify_capture_failures = capture.capture_ladder(
            self.verify_graphs, lambda n: capture_size(self.verify_graphs, n))
        self.stream.synchronize()
        failed = [str(n) for n in sorted(self.capture_failures)] + [
            f"verify {n}" for n in sorted(self.verify_capture_failures)]
        verify = self.verify_graphs
        log.info("captured %d CUDA graphs (batch sizes %s%s) in %.2f s%s",
                 len(self.graphs.graphs) + len(verify.graphs), sorted(self.graphs.graphs),
                 f"; verify {sorted(verify.graphs)} of {verify.query_len} tokens a request" if verify.sizes
                 else "", time.perf_counter() - t0, f"; eager for {', '.join(failed)}" if failed else "")

    def _graph_splits(self) -> dict[tuple[int, int], int]:
        """(id(table), size) -> the split-K count its graph's attention is captured with."""
        c = self.config
        return {(id(t), size): step_plan.graph_splits(
            tokens=t.shape(size)[0], num_kv_heads=c.num_key_value_heads, max_model_len=self.max_model_len,
            num_sms=self.num_sms) for t in (self.graphs, self.verify_graphs) for size in t.sizes}

    def _allocate_graph_buffers(self) -> tuple[StepBuffers, tuple]:
        """The one set of step buffers every graph takes views of (the largest tokens, requests
        and rows any size needs) and the one attention workspace."""
        c = self.config
        T_max, B_max, R_max = plan.shared_shape([self.graphs, self.verify_graphs])
        with self.stream:
            shared = StepBuffers(c, T_max, B_max, self.max_blocks, cp, self.act_dtype, R_max)
            # The kernels index the workspace by their own launch's (T, H, splits): any buffer
            # of at least T * H * splits rows of each size serves them all.
            ws = self.ops.paged.workspace(T_max, c.num_attention_heads, max(self._graph_splits().values()))
        self.stream.synchronize()
        return shared, ws

    def warm_up(self) -> None:
        """Every kernel compiled (NVRTC modules are at construction; Numba JITs at first launch)
        and run once now, not on the first request: a one-token eager forward (slot -1: writes
        nothing) sampled with every sampling path and scored for prompt logprobs."""
        # Said first: Numba CUDA keeps no on-disk cache here, so every start compiles (seconds)
        log.info("compiling kernels (Numba CUDA, every start) and warming them")
        t0 = time.perf_counter()
        batch = Batch(np.zeros(1, np.int32), np.zeros(1, np.int32), np.full(1, -1, np.int32),
                      np.array([0, 1], np.int32), np.array([1], np.int32), np.zeros((1, 1), np.int32))
        for meta in warmup_metadata(self.config.vocab_size):
            spec = PromptLogprobsSpec(np.zeros(1, np.int64), np.zeros(1, np.int32), 1)
            self.submit(batch, np.arange(1), meta, spec).result()
        self.stream.synchronize()
        log.info("kernels compiled and warmed in %.2f s", time.perf_counter() - t0)

    def _launch(self, batch: Batch) -> tuple[cp.ndarray, StepBuffers]:
        """Enqueue the forward on self.stream; the logits [rows, V] float32 on the device (rows:
        batch.logits_indices) and the buffers holding every token's final hidden state (.x). A
        graph's buffers are static: valid until the next launch, which the stream orders after
        everything enqueued on them."""
        if batch.block_tables.shape[1] <= self.max_blocks:
            for table in (self.graphs, self.verify_graphs):
                size = table.pick(batch)
                if size is None:
                    continue
                captured: CapturedGraph = table.graphs[size]
                buf = captured.buffers
                with self.stream:
                    buf.load(table.pad(batch, size, self.max_blocks), self.ops)
                    captured.launch(self.stream)
                return buf.logits[:len(batch.logits_indices)], buf
        with self.stream:
            buf = self._eager(batch, self.kv_caches)
        return buf.logits, buf

    def _logits_at(self, x: cp.ndarray, rows: np.ndarray) -> cp.ndarray:
        """float32 logits [len(rows), V] of final hidden states x at `rows` (enqueued)."""
        with self.stream:
            # NOTE: gathered by the runner's own kernel into a buffer of its own (as the forward's
            # logits rows are), not CuPy's fancy indexing
            h = cp.empty((len(rows), x.shape[1]), x.dtype)
            self.ops.gather_rows(x, cp.asarray(np.asarray(rows, np.int32)), h)
            raw = cp.empty((len(rows), self.config.vocab_size), self.act_dtype)
            self.ops.linear(h, self.weights.lm_head, raw)
            out = cp.empty(raw.shape, cp.float32)
            self.ops.to_float32(raw, out)
            return out

    def execute(self, batch: Batch, logits_indices: np.ndarray | None = None) -> np.ndarray:
        """float32 logits at rows logits_indices of the super-sequence (default:
        batch.logits_indices, each request's last scheduled token [B, vocab], or a verify step's
        rows); writes K/V."""
        if logits_indices is not None:  # NOTE: the step (its graph, or eager) computes these rows only
            batch = replace(batch, sample_indices=np.asarray(logits_indices, np.int32))
        if batch.num_tokens == 0:
            return np.empty((len(batch.logits_indices), self.config.vocab_size), np.float32)
        logits, _ = self._launch(batch)
        out = logits.get(stream=self.stream)
        self.stream.synchronize()
        return out

    def submit(self, batch: Batch, rows: np.ndarray, metadata: SamplingMetadata,
               prompt_logprobs: PromptLogprobsSpec | None = None):
        """The forward, then sampling on the device for `rows` (of the batch's rows of logits:
        the requests whose last token this step computes; in a verify step each one's 1 + k
        rows, sampled as the CPU's sampler does), all enqueued on self.stream: only the token
        ids (and the logprobs asked for) come back, into pinned memory. Returns at once; result() waits.
        prompt_logprobs: also score tokens at those rows of the super-sequence, on the device
        (gpu/cuda/sampling_kernels.logprobs over SLICE_ROWS rows of logits at a time)."""
        logits, buf = self._launch(batch)
        if len(rows) == 0:  # chunked prefills only: nothing to sample, the forward still runs
            event = nb_cuda.event()
            event.record(self.nb_stream)
            step = PendingSample(event, np.zeros(0, np.int32), None)
        else:
            if len(rows) < len(logits):
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
