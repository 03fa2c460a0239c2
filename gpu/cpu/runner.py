"""The CPU model runner: the checkpoint's model (gpu/models: Llama or Gemma 3) over
gpu/cpu/ops.py CpuOps, numpy + Numba.

It owns the weights and the paged KV cache (allocated once, never resized), computes a step in
submit() before it returns, and samples on the host (gpu/sampling/sampler.py).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numba
import numpy as np
from threadpoolctl import ThreadpoolController

from ringserve.gpu.batch import Batch
from ringserve.gpu.cpu.attention import paged_attention_parallel
from ringserve.gpu.cpu.int8_kernels import has_vnni
from ringserve.gpu.cpu.kv_dtypes import KV_CACHE_DTYPES as CPU_KV_STORAGE
from ringserve.gpu.cpu.memory import map_large_blocks, page_out_library
from ringserve.gpu.cpu.ops import PARALLEL_ROWS, CpuOps, CpuStepBuffers, CpuWeightStore, KVCache
from ringserve.gpu.cpu.prefill_attention import SERVED_MIN_TOKENS
from ringserve.gpu.devices import cpu_threads_per_engine, host_memory_available
from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.weights import load_weights
from ringserve.gpu.models import model_definition
from ringserve.gpu.models.ops import compute_logits
from ringserve.gpu.rope import rope_tables_by_type
from ringserve.gpu.sampling.prompt_logprobs import PromptLogprobsSpec, host_prompt_logprobs
from ringserve.gpu.sampling.sampler import CompletedStep, SamplingMetadata, sample_on_host
from ringserve.gpu.settings import (
    CPU_ACTIVATION_DTYPES,
    CPU_DTYPES,
    CPU_KV_CACHE_DTYPES,
    CPU_KV_CACHE_MEMORY_BYTES,
    CacheConfig,
    DeviceConfig,
    StepLimits,
)

_BLAS = ThreadpoolController()
log = logging.getLogger(__name__)
# A fresh compile of the CPU kernels (an empty Numba cache): the default model's warm-up took
# 6.3 s on the 2-core dev machine (shared, 2026-12), and the first request 10.7 s in issue 31;
# the tiled prefill attention (a parallel region) adds ~8 s of CPU (2026-12-05). Since the
# warm-up compiles it and RoPE's parallel kernel too (rather than the first long prompt, in the
# serving engine): 23.5 s on the 1B shape's Q4_K_M, the first start ready after 45 s (2026-12-06).
COMPILE_ESTIMATE_S = 25


class CpuModelRunner:
    device = "cpu"
    asynchronous = False  # submit() computes the step before it returns

    def __init__(self, model_dir: str | Path, device: DeviceConfig, cache: CacheConfig,
                 limits: StepLimits | None = None, *, widen_packed: bool = False):
        """The settings it reads, checked by DeviceConfig.check_backend (gpu/runner.py
        ModelRunner): device.dtype (CPU_DTYPES), device.cpu_threads (Numba's and BLAS's threads
        for a step; default_num_threads() by default), device.cpu_activation_dtype ("int8"
        multiplies quantized weights by int8 activation blocks, gpu/cpu/int8_kernels.py, needs
        AVX-512 VNNI; "float32" exactly; "auto": int8 where the CPU can); cache.block_size,
        cache.kv_cache_dtype (gpu/cpu/kv_dtypes.py) and the pool: cache.num_gpu_blocks_override
        blocks, else as many as cache.kv_cache_memory_bytes holds; limits.max_model_len (None:
        max_position_embeddings) picks LongRoPE's factors (gpu/rope.py), and with
        limits.max_num_batched_tokens which kernels the warm-up loads. widen_packed: GGUF blocks and
        16-bit weights widened to dtype as well (the float path, for comparisons), not kept
        packed."""
        map_large_blocks()  # NOTE: freed step activations go back to the system (memory.py)
        self.kv_cache_dtype = CPU_KV_CACHE_DTYPES[cache.kv_cache_dtype]
        block_size, num_blocks, num_threads = cache.block_size, cache.num_gpu_blocks_override, \
            device.cpu_threads
        self.config = c = ModelConfig.from_dir(model_dir)
        self.model_dir = Path(model_dir)  # its tokenizer.json: the engine's structured outputs
        self.num_threads = default_num_threads() if num_threads is None else num_threads
        if not 1 <= self.num_threads <= numba_max_threads():
            raise ValueError(f"num_threads {num_threads} must be between 1 and "
                             f"{numba_max_threads()} (NUMBA_NUM_THREADS)")
        self.block_size = block_size
        if num_blocks is None:
            budget = cache.kv_cache_memory_bytes
            budget = CPU_KV_CACHE_MEMORY_BYTES if budget is None else budget
            num_blocks = budget // self.bytes_per_block
        if num_blocks <= 0:
            raise ValueError(f"the KV cache holds no block: {num_blocks} blocks of {self.bytes_per_block} "
                             f"bytes; give --kv-cache-memory-bytes at least {self.bytes_per_block} "
                             f"(one block of --block-size {block_size} tokens) or --num-gpu-blocks-override")
        self.num_blocks = int(num_blocks)
        hf = load_weights(model_dir)
        self.int8_activations = int8_activations(device.cpu_activation_dtype)
        store = CpuWeightStore(CPU_DTYPES[device.dtype], widen_packed, self.int8_activations)
        check_fits(sum(store.nbytes(t) for t in hf.values()), self.num_blocks * self.bytes_per_block,
                   self.num_blocks)
        self.model = model_definition(c)
        self.weights = self.model.fuse(c, hf, store)
        del hf
        self.ops = CpuOps(c, parallel=self.num_threads > 1)
        self.kv_caches = [KVCache.allocate(self.num_blocks, block_size, c, self.kv_cache_dtype, store.arena)
                          for _ in range(c.num_hidden_layers)]
        self.max_model_len = (limits and limits.max_model_len) or c.max_position_embeddings
        # the most tokens in a step, and of one request in a step (None: no bound)
        self.max_step_tokens = limits.max_num_batched_tokens if limits else None
        self.max_chunk_tokens = limits.max_chunk_tokens if limits else None
        self._ropes = rope_tables_by_type(c, 0, self.max_model_len)
        self.warm_up()

    def warm_up(self) -> None:
        """Every kernel of a step compiled (or loaded from Numba's cache) now, not on the first
        request: forwards whose slots are -1 (they write nothing). The first start on a
        machine compiles them, which takes a while: say so before, so that nobody waits on a
        silent engine."""
        first = not kernels_cached()
        if first:
            log.info("compiling kernels (first start only, ~%d s; later starts load them from "
                     "Numba's cache)", COMPILE_ESTIMATE_S)
        t0 = time.perf_counter()
        # Every kernel a step of this server can take (one loaded later would fault LLVM's pages
        # back in after page_out_library below): a decode and a prefill (linears pick their
        # kernels by size; the row-wise kernels from PARALLEL_ROWS on take their parallel twins) ...
        step = min(self.max_step_tokens or PARALLEL_ROWS, PARALLEL_ROWS)
        for tokens in sorted({1, step}):
            self.execute(self._warm_up_batch(tokens))
        # ... and the tiled prefill attention, where a prompt chunk can reach SERVED_MIN_TOKENS,
        # by itself on one layer's cache (a whole forward that long would take seconds on an 8B)
        if min(self.max_model_len, self.max_chunk_tokens or self.max_model_len) >= SERVED_MIN_TOKENS:
            buf = CpuStepBuffers(self.config, self._warm_up_batch(SERVED_MIN_TOKENS))
            buf.qkv.fill(0)
            cos, sin = next(iter(self.rope_tables(SERVED_MIN_TOKENS).values()))
            self.ops.attention(buf, cos, sin, *self.kv_caches[0], None, 0)
        log.info("kernels %s in %.2f s", "compiled" if first else "loaded", time.perf_counter() - t0)
        page_out_library("libllvmlite.so")  # NOTE: LLVM's code, idle from here on (memory.py)

    def _warm_up_batch(self, tokens: int) -> Batch:
        """A prompt of `tokens` tokens whose slots are -1: a forward over it writes nothing."""
        return Batch(np.zeros(tokens, np.int32), np.arange(tokens, dtype=np.int32),
                     np.full(tokens, -1, np.int32), np.array([0, tokens], np.int32),
                     np.array([tokens], np.int32),
                     # NOTE: a table as long as the keys read (all block 0): the attention
                     # reads every key of seq_lens, whatever the block size
                     np.zeros((1, -(-tokens // self.block_size)), np.int32))

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over all layers."""
        c = self.config
        return (2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim
                * np.dtype(CPU_KV_STORAGE[self.kv_cache_dtype]).itemsize)

    def rope_tables(self, max_position: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """cos and sin by layer type (gpu/rope.py rope_tables_by_type) for positions
        0..max_position at least, computed once (grown by doubling)."""
        have = len(next(iter(self._ropes.values()))[0])
        if max_position >= have:
            n = max(max_position + 1, 2 * have, self.config.max_position_embeddings)
            self._ropes = rope_tables_by_type(self.config, n, self.max_model_len)
        return self._ropes

    def _hidden_states(self, batch: Batch, output_rows: np.ndarray | None = None) -> np.ndarray:
        """Every token's final-normed hidden state [T, hidden], or output_rows' (sorted, unique)
        [len(output_rows), hidden]; writes the step's K/V."""
        # NOTE: per calling thread in Numba; also at 1: the tiled prefill attention is a parallel
        # region whatever the setting, and would otherwise take all NUMBA_NUM_THREADS
        numba.set_num_threads(self.num_threads)
        ropes = self.rope_tables(int(batch.positions.max()))
        buf = CpuStepBuffers(self.config, batch, output_rows)
        self.model.hidden_states(self.ops, self.weights, buf, self.kv_caches, None, ropes)
        return buf.x

    def _logits(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """float32 logits [len(rows), vocab] of hidden states x at rows."""
        rows = np.asarray(rows)
        last = np.empty((len(rows), x.shape[1]), np.float32)
        out = np.empty((len(rows), self.config.vocab_size), np.float32)
        compute_logits(self.ops, self.weights, x, rows, last, out, out)
        return out

    def execute(self, batch: Batch, logits_indices: np.ndarray | None = None) -> np.ndarray:
        """float32 logits at rows logits_indices of the super-sequence [len, vocab]; by default
        one row per request at its last scheduled token [B, vocab]. Writes this step's K/V into
        the cache at batch.slot_mapping."""
        # BLAS (the many-token matmuls) gets the same threads as our kernels, no more: OpenBLAS
        # threads spin while they wait, and a second process on a busy core made a step ~4x
        # slower (docs/bench_forward.md). Per call, so that nothing leaks into the process.
        rows = np.asarray(batch.logits_indices if logits_indices is None else logits_indices)
        kept = np.unique(rows)  # NOTE: the last layer runs for these rows only (CpuStepBuffers)
        with _BLAS.limit(limits=self.num_threads, user_api="blas"):
            x = self._hidden_states(batch, kept)
            return self._logits(x, np.searchsorted(kept, rows))  # x's row of each asked row

    def submit(self, batch: Batch, rows: np.ndarray, metadata: SamplingMetadata,
               prompt_logprobs: PromptLogprobsSpec | None = None) -> CompletedStep:
        """ModelRunner.submit, computed here: the forward, then `rows` sampled on the host.
        prompt_logprobs: the logits of those rows too, SLICE_ROWS at a time."""
        if prompt_logprobs is None:
            return sample_on_host(self.execute(batch), rows, metadata)
        with _BLAS.limit(limits=self.num_threads, user_api="blas"):
            x = self._hidden_states(batch)
            step = sample_on_host(self._logits(x, batch.logits_indices), rows, metadata)
            step.output.prompt_logprobs = host_prompt_logprobs(lambda r: self._logits(x, r),
                                                               prompt_logprobs)
        return step


def kernels_cached() -> bool:
    """Whether Numba's on-disk cache holds the CPU kernels (the attention kernel's index file
    stands for them all): false on a machine's first start, or after the kernels changed."""
    # NOTE: Numba has no public way to ask; its FunctionCache's index path is read where it exists.
    cache_file = getattr(getattr(paged_attention_parallel, "_cache", None), "_cache_file", None)
    index = getattr(cache_file, "_index_path", None)
    return index is not None and os.path.exists(index)


def numba_max_threads() -> int:
    """NUMBA_NUM_THREADS: the most threads a parallel region may use (set by numba at import)."""
    return numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # numba sets it at run time


def check_fits(weight_bytes: int, kv_bytes: int, num_blocks: int) -> None:
    """Refuse, in one line, a model whose weights (as stored) and KV pool do not fit the memory
    this process may take (the pool is allocated lazily: it would fail later, mid-serving)."""
    available = host_memory_available()
    if weight_bytes + kv_bytes > available:
        raise ModelError(f"the model does not fit in memory: its weights take {_gib(weight_bytes)} as "
                         f"stored and the KV cache {_gib(kv_bytes)} ({num_blocks} blocks), "
                         f"{_gib(weight_bytes + kv_bytes)} in all, but {_gib(available)} are "
                         f"available; give a smaller --kv-cache-memory-bytes or "
                         f"--num-gpu-blocks-override, or a smaller model")


def int8_activations(activation_dtype: str) -> bool:
    """Whether quantized weights multiply int8 activations (DeviceConfig.cpu_activation_dtype)."""
    if activation_dtype not in CPU_ACTIVATION_DTYPES:
        raise ValueError(f"cpu_activation_dtype {activation_dtype!r}: expected one of "
                         f"{', '.join(CPU_ACTIVATION_DTYPES)}")
    if activation_dtype == "int8" and not has_vnni():  # the engine's one line at start (server/launch.py)
        raise ModelError("--cpu-activation-dtype int8 needs a CPU with AVX-512 VNNI, which this one "
                         "lacks; use auto or float32")
    return activation_dtype == "int8" or (activation_dtype == "auto" and has_vnni())


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def default_num_threads(engines: int = 1) -> int:
    """The cores this process may run on, shared by `engines` CPU engines (at least 1, at most
    Numba's thread pool), as llama.cpp's -t defaults to the cores.

    Only a linear worth ~100 us of one thread's work is split (gpu/cpu/ops.py
    PARALLEL_MIN_MACS): a parallel region waits for its slowest thread, and the HTTP workers
    share the cores. Measured serving over HTTP with the workers and the client on the same 2
    cores (docs/bench_quant.md): 2 threads give the default model the same tok/s as 1 at
    concurrency 1 and 4 and 1.14-1.16x at 16 and 64, and the Llama-3.2-1B shape 1.4-1.5x
    everywhere. (Before that threshold, every linear split, 2 threads lost 20-35 % on the small
    model: the default was half the cores.)"""
    return min(cpu_threads_per_engine(engines), numba_max_threads())
