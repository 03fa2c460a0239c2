"""The model runner: what the engine calls once per step (docs/design.md §1 station 5).

A runner owns the weights and the paged KV cache (allocated once, never resized) and turns a
Batch into sampled tokens. Two runners, one face (`Runner`), one model (gpu/model.py):
gpu/cpu_runner.py CpuModelRunner (numpy + Numba) and gpu/cuda/runner.py CudaModelRunner (CuPy),
built by `ModelRunner(model_dir, device=...)`. This module holds what both share and imports
neither backend until it is asked for one (the CUDA one imports CuPy).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ringserve.gpu.batch import Batch
from ringserve.gpu.config import ModelConfig
from ringserve.gpu.cuda.dtypes import CUDA_DTYPES
from ringserve.gpu.devices import cuda_stack_problem, cupy_installed, resolve_device
from ringserve.gpu.model import LlamaWeights
from ringserve.gpu.prompt_logprobs import PromptLogprobsSpec
from ringserve.gpu.sampler import SamplerOutput, SamplingMetadata
from ringserve.gpu.settings import CUDA_MAX_NUM_BATCHED_TOKENS, CacheConfig, DeviceConfig, SchedulerConfig


class StepHandle(Protocol):
    def result(self) -> SamplerOutput: ...


class Runner(Protocol):
    """The face of both runners."""
    device: str            # "cpu" or "cuda"
    asynchronous: bool     # submit() returns before the step is computed (CUDA only enqueues it)
    config: ModelConfig
    block_size: int
    num_blocks: int
    weights: LlamaWeights
    kv_caches: list          # per layer (k, v), as the backend allocated them

    def execute(self, batch: Batch, logits_indices: np.ndarray | None = None) -> np.ndarray:
        """float32 logits at rows logits_indices of the super-sequence [len, vocab]; by default
        one row per request at its last scheduled token [B, vocab]. Writes this step's K/V into
        the cache at batch.slot_mapping."""

    def submit(self, batch: Batch, rows: np.ndarray, metadata: SamplingMetadata,
               prompt_logprobs: PromptLogprobsSpec | None = None) -> StepHandle:
        """One engine step: the forward, then one token sampled for each of `rows` (indices of
        the batch's requests whose last token this step computes) with `metadata` (their rows
        in the same order). Returns something whose result() is the SamplerOutput: on the CPU
        it is computed here; on CUDA everything is enqueued on the GPU and only the token ids
        come back, so the caller can do host work until it asks for result().
        prompt_logprobs: also score tokens at these rows of the super-sequence (the result's
        .prompt_logprobs, in the spec's order)."""


@dataclass(frozen=True)
class MemoryReport:
    """What a runner holds: why a model fits or not (the engine publishes it: the launcher's
    start-up line, /metrics)."""
    weight_bytes: dict[str, int]    # by storage type (gpu/model.py storage)
    kv_cache_bytes: int

    @classmethod
    def of(cls, runner: Runner) -> MemoryReport:
        kv = sum(int(k.nbytes) + int(v.nbytes) for k, v in runner.kv_caches)
        return cls(runner.weights.nbytes_by_type(), kv)


def ModelRunner(model_dir: str | Path, *, device: str = "cpu",  # noqa: N802
                dtype: str = DeviceConfig.dtype, block_size: int = CacheConfig.block_size,
                num_blocks: int | None = None,
                kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes,
                kv_cache_dtype: str = CacheConfig.kv_cache_dtype,
                num_threads: int | None = None, widen_packed: bool = False,
                cpu_activation_dtype: str = DeviceConfig.cpu_activation_dtype,
                gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
                max_num_seqs: int = SchedulerConfig.max_num_seqs,
                max_num_batched_tokens: int = CUDA_MAX_NUM_BATCHED_TOKENS,
                max_model_len: int | None = None, enforce_eager: bool = DeviceConfig.enforce_eager,
                attention_backend: str = DeviceConfig.attention_backend) -> Runner:
    """The runner for `device` (named as a class: the engine, LLM and the tools construct it).
    The settings' defaults are gpu/settings.py's; the engine passes its EngineConfig's
    (engine/core.py _make_runner). device "cpu" unless asked (tests compare against CPU
    references).
    device "auto": cuda when CuPy sees a GPU, else cpu (gpu/devices.py). dtype on CUDA: auto
    (the checkpoint's bfloat16 or float16; float32 and quantized checkpoints in float16),
    float16 or bfloat16 (gpu/cuda/dtypes.py); kv_cache_dtype there: auto or the same.
    kv_cache_memory_bytes, num_threads, cpu_activation_dtype and widen_packed (the float path
    for comparisons: gpu/cpu_runner.py) are the CPU backend's; the arguments after them the
    CUDA backend's (KV pool from free memory, graph ladder up to max_num_seqs, the profiling
    forward's size, graphs off, paged-attention kernel)."""
    device = resolve_device(device)
    if device == "cuda":
        if dtype not in CUDA_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported by the CUDA backend "
                             f"({', '.join(CUDA_DTYPES)})")
        if kv_cache_dtype not in CUDA_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported by the CUDA backend "
                             f"({', '.join(CUDA_DTYPES)}: its KV cache is in the serving dtype)")
        if not cupy_installed():
            raise ValueError("device 'cuda' needs CuPy: pip install -e '.[cuda]' "
                             "(docs/deploy.md)")
        if (problem := cuda_stack_problem()) is not None:  # LLM and the tools too, not only serve
            raise ValueError(problem)
        from ringserve.gpu.cuda.runner import CudaModelRunner
        return CudaModelRunner.from_dir(
            model_dir, block_size=block_size, num_blocks=num_blocks,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enforce_eager=enforce_eager, attention_backend=attention_backend, dtype=dtype,
            kv_cache_dtype=kv_cache_dtype)
    from ringserve.gpu.cpu_runner import CpuModelRunner
    return CpuModelRunner(model_dir, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
                          kv_cache_memory_bytes=kv_cache_memory_bytes,
                          kv_cache_dtype=kv_cache_dtype,
                          num_threads=num_threads, widen_packed=widen_packed,
                          activation_dtype=cpu_activation_dtype)
