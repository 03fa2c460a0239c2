"""The model runner: what the engine calls once per step (docs/design.md §1 station 5).

A runner owns the weights and the paged KV cache (allocated once, never resized) and turns a
Batch into sampled tokens. Two runners, one face (`Runner`), one model definition per family (gpu/models/):
gpu/cpu/runner.py CpuModelRunner (numpy + Numba) and gpu/cuda/runner.py CudaModelRunner (CuPy),
built by `ModelRunner(model_dir, device, cache, limits)` from the settings objects
(gpu/settings.py). This module holds what both share and imports
neither backend until it is asked for one (the CUDA one imports CuPy); the backends import
nothing of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ringserve.gpu.batch import Batch
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.models import Weights
from ringserve.gpu.sampling.prompt_logprobs import PromptLogprobsSpec
from ringserve.gpu.sampling.sampler import SamplerOutput, SamplingMetadata
from ringserve.gpu.settings import CacheConfig, DeviceConfig, StepLimits


class StepHandle(Protocol):
    def result(self) -> SamplerOutput: ...


class Runner(Protocol):
    """The face of both runners."""
    device: str            # "cpu" or "cuda"
    asynchronous: bool     # submit() returns before the step is computed (CUDA only enqueues it)
    config: ModelConfig
    block_size: int
    num_blocks: int
    weights: Weights
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
    weight_bytes: dict[str, int]    # by storage type (gpu/models/ops.py storage)
    kv_cache_bytes: int

    @classmethod
    def of(cls, runner: Runner) -> MemoryReport:
        kv = sum(int(k.nbytes) + int(v.nbytes) for k, v in runner.kv_caches)
        return cls(runner.weights.nbytes_by_type(), kv)


def ModelRunner(model_dir: str | Path, device: DeviceConfig | None = None,  # noqa: N802
                cache: CacheConfig | None = None, limits: StepLimits | None = None, *,
                widen_packed: bool = False, mirror: Runner | None = None,
                defer_kv_cache: bool = False) -> Runner:
    """The runner for `device` (named as a class: the engine, LLM and the tools construct it),
    built from the settings objects whole: the engine passes its EngineConfig's parts
    (engine/core.py _make_runners). device: DeviceConfig(device="cpu") unless given (tests
    compare against CPU references); "auto" is cuda when CuPy sees a GPU, else cpu, and
    DeviceConfig.check_backend refuses what the backend cannot serve. cache: CacheConfig()
    unless given. limits: the largest step (the CUDA backend's graph ladder, profiling forward
    and block tables); the CPU backend reads only its max_model_len (LongRoPE's factors).
    widen_packed: the CPU backend's float path for comparisons (gpu/cpu/runner.py).
    defer_kv_cache, mirror (CUDA): a draft model's runner, its pool left for later, and its
    target's, which sizes one pool for both and allocates the draft's (gpu/cuda/runner.py); on
    the CPU the pool is set bytes, so the engine builds the draft after with the target's blocks."""
    device = DeviceConfig(device="cpu") if device is None else device
    cache = CacheConfig() if cache is None else cache
    if device.check_backend(cache) == "cuda":
        if limits is None:
            raise ValueError("the CUDA runner needs its StepLimits (max_num_seqs, max_num_batched_tokens)")
        from ringserve.gpu.cuda.runner import CudaModelRunner
        return CudaModelRunner.from_dir(model_dir, device, cache, limits, mirror=mirror,
                                        defer_kv_cache=defer_kv_cache)
    if mirror is not None or defer_kv_cache:
        raise ValueError("mirror and defer_kv_cache are the CUDA runner's")
    from ringserve.gpu.cpu.runner import CpuModelRunner
    return CpuModelRunner(model_dir, device, cache, limits, widen_packed=widen_packed)
