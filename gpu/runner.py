"""The model runner: what the engine calls once per step (DESIGN.md §1 station 5).

It owns the weights and the paged KV cache (allocated once, never resized) and turns a
Batch into logits. The CPU backend is numpy + Numba; the CUDA backend (gpu/cuda/runner.py) sits
behind the same face when device is "cuda" (or "auto" on a machine where CuPy sees a GPU).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
from threadpoolctl import ThreadpoolController

from ringserve.gpu.batch import Batch
from ringserve.gpu.config import ModelConfig
from ringserve.gpu.cpu_model import CpuLlama, KVCache
from ringserve.gpu.devices import cupy_installed, resolve_device
from ringserve.gpu.prompt_logprobs import PromptLogprobsSpec, host_prompt_logprobs
from ringserve.gpu.sampler import SamplerOutput, SamplingMetadata, sample
from ringserve.gpu.settings import (CPU_KV_CACHE_MEMORY_BYTES, CUDA_MAX_NUM_BATCHED_TOKENS,
                                    CacheConfig, DeviceConfig, SchedulerConfig)
from ringserve.gpu.weights import load_weights

_BLAS = ThreadpoolController()
# dtype -> how the CPU backend stores weights; it always computes in float32. "bfloat16" is an
# option that halves the bytes a decode step streams (its logits differ from float32's by bf16
# rounding of the weights); float32 is the default and matches transformers.
CPU_DTYPES = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16"}
CUDA_DTYPES = ("auto", "float16")  # fp16 weights and KV cache, float32 accumulation


@dataclass
class CompletedStep:
    """A step whose sampled tokens are already on the host (the CPU backend computes in submit;
    the CUDA backend returns a gpu.cuda.sampler.PendingSample with the same result())."""
    output: SamplerOutput

    def result(self) -> SamplerOutput:
        return self.output


class ModelRunner:
    def __init__(self, model_dir: str | Path, *, device: str = "cpu",
                 dtype: str = DeviceConfig.dtype, block_size: int = CacheConfig.block_size,
                 num_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes,
                 num_threads: int | None = None,
                 gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs,
                 max_num_batched_tokens: int = CUDA_MAX_NUM_BATCHED_TOKENS,
                 max_model_len: int | None = None, enforce_eager: bool = DeviceConfig.enforce_eager,
                 attention_backend: str = DeviceConfig.attention_backend):
        """The settings' defaults are gpu/settings.py's; the engine passes its EngineConfig's
        (engine/core.py _make_runner). device "cpu" unless asked (tests compare against CPU
        references); "auto": cuda when CuPy sees a GPU, else cpu (gpu/devices.py). The arguments
        after num_threads are the CUDA backend's (KV pool from free memory, graph ladder up to
        max_num_seqs, the profiling forward's size, graphs off, paged-attention kernel)."""
        self.device = resolve_device(device)
        self._cuda = None
        # submit() returns before the step is computed: the CUDA backend only enqueues it.
        self.asynchronous = self.device == "cuda"
        if self.device == "cuda":
            if dtype not in CUDA_DTYPES:
                raise ValueError(f"dtype {dtype!r} is not supported by the CUDA backend "
                                 f"({', '.join(CUDA_DTYPES)})")
            if not cupy_installed():
                raise ValueError("device 'cuda' needs CuPy: pip install -e '.[cuda]' "
                                 "(docs/deploy.md)")
            from ringserve.gpu.cuda.runner import CudaModelRunner
            self._cuda = CudaModelRunner.from_dir(
                model_dir, block_size=block_size, num_blocks=num_blocks,
                gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                enforce_eager=enforce_eager, attention_backend=attention_backend)
            self.config = self._cuda.config
            self.block_size = self._cuda.block_size
            self.num_blocks = self._cuda.num_blocks
            return
        if dtype not in CPU_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported by the CPU backend "
                             f"({', '.join(CPU_DTYPES)})")
        if block_size <= 0:
            raise ValueError(f"block_size {block_size} must be positive")
        self.config = ModelConfig.from_dir(model_dir)
        self.num_threads = default_num_threads() if num_threads is None else num_threads
        if not 1 <= self.num_threads <= numba.config.NUMBA_NUM_THREADS:
            raise ValueError(f"num_threads {num_threads} must be between 1 and "
                             f"{numba.config.NUMBA_NUM_THREADS} (NUMBA_NUM_THREADS)")
        self.model = CpuLlama(self.config, load_weights(model_dir), weight_dtype=CPU_DTYPES[dtype],
                              num_threads=self.num_threads)
        self.block_size = block_size

        if num_blocks is None:
            budget = CPU_KV_CACHE_MEMORY_BYTES if kv_cache_memory_bytes is None else kv_cache_memory_bytes
            num_blocks = budget // self.bytes_per_block
        if num_blocks <= 0:
            raise ValueError(f"the KV cache holds no block: {num_blocks} blocks "
                             f"({self.bytes_per_block} bytes per block)")
        self.num_blocks = int(num_blocks)
        self.kv_caches = [KVCache.allocate(self.num_blocks, block_size, self.config, self.model.dtype)
                          for _ in range(self.config.num_hidden_layers)]

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over all layers."""
        c = self.config
        return (2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim
                * self.model.dtype.itemsize)

    def execute(self, batch: Batch, logits_indices: np.ndarray | None = None) -> np.ndarray:
        """float32 logits at rows logits_indices of the super-sequence [len, vocab]; by default
        one row per request at its last scheduled token [B, vocab]. Writes this step's K/V into
        the cache at batch.slot_mapping."""
        if self._cuda is not None:
            return self._cuda.execute(batch, logits_indices)
        # BLAS (the many-token matmuls) gets the same threads as our kernels, no more: OpenBLAS
        # threads spin while they wait, and a second process on a busy core made a step ~4x
        # slower (docs/bench_forward.md). Per call, so that nothing leaks into the process.
        with _BLAS.limit(limits=self.num_threads, user_api="blas"):
            return self.model.forward(batch, self.kv_caches, logits_indices)

    def submit(self, batch: Batch, rows: np.ndarray, metadata: SamplingMetadata,
               prompt_logprobs: PromptLogprobsSpec | None = None):
        """One engine step: the forward, then one token sampled for each of `rows` (indices of
        the batch's requests whose last token this step computes) with `metadata` (their rows
        in the same order). Returns something whose result() is the SamplerOutput: on the CPU
        it is computed here; on CUDA everything is enqueued on the GPU and only the token ids
        come back, so the caller can do host work until it asks for result().
        prompt_logprobs: also score tokens at these rows of the super-sequence (the result's
        .prompt_logprobs, in the spec's order)."""
        if self._cuda is not None:
            return self._cuda.submit(batch, rows, metadata, prompt_logprobs)
        if prompt_logprobs is None:
            return sample_on_host(self.execute(batch), rows, metadata)
        with _BLAS.limit(limits=self.num_threads, user_api="blas"):
            x = self.model.hidden_states(batch, self.kv_caches)
            step = sample_on_host(self.model.logits(x[batch.logits_indices]), rows, metadata)
            step.output.prompt_logprobs = host_prompt_logprobs(
                lambda r: self.model.logits(x[r]), prompt_logprobs)
        return step


def sample_on_host(logits: np.ndarray, rows: np.ndarray, metadata: SamplingMetadata | None) -> CompletedStep:
    """Sample `rows` of host logits [B, V] with gpu/sampler.py (the CPU backend's submit)."""
    if len(rows) == 0:
        return CompletedStep(SamplerOutput(np.zeros(0, np.int32)))
    if len(rows) < len(logits):
        logits = logits[rows]
    return CompletedStep(sample(logits, metadata))


def default_num_threads() -> int:
    """Half the cores this process may run on (at least 1, at most Numba's thread pool).

    The other half is left to the frontend's workers. A step runs ~120 parallel regions, and
    each one waits for its slowest thread: on the 2-core VM, with another process busy on both
    cores, a 2-thread batch-1 decode step took ~960 ms against ~28 ms with 1 thread; with a core
    to spare, 2 threads gained 1.4x (27.5 -> 19.5 ms). See docs/bench_forward.md."""
    return max(1, min(len(os.sched_getaffinity(0)) // 2, numba.config.NUMBA_NUM_THREADS))
