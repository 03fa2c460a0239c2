"""The engine settings that the model runner reads too: the device, the KV cache, the
scheduler's budgets (vLLM's DeviceConfig, CacheConfig, SchedulerConfig).

Each field holds a setting's default, its help text (metadata "help") and, where it has a fixed
set of values, its choices (metadata "choices"); each class checks its fields in __post_init__.
engine/config.py's EngineConfig is their union plus the model fields; `ringserve serve`
generates its flags from them (server/config.py add_arguments) and the runners' keyword
defaults are these fields' defaults. They live in gpu/, the lowest layer that both the engine
and the runners may import (docs/design.md §2). Importing this module loads neither numba nor
CuPy: the CLI builds its --help from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.gpu.cuda.launch import ATTENTION_BACKENDS
from ringserve.gpu.devices import DEVICES

# Tokens per step when max_num_batched_tokens is not given; longer prompts are chunked.
CUDA_MAX_NUM_BATCHED_TOKENS = 8192
# The CPU's is small so that a step stays short: every running request waits for the whole
# step for its next token. Measured (docs/engine.md, the default model, 2 cores): an 8,000-token
# prompt is one 84-166 s step at 8192, 4 steps of up to 37 s at 2048, 16 of 3.6-9 s at 512;
# its total cost is the same at any budget. 512 = 2 x the default max_num_seqs: all running
# sequences decode every step with room left for a prompt chunk.
CPU_MAX_NUM_BATCHED_TOKENS = 512
CPU_KV_CACHE_MEMORY_BYTES = 1 << 30  # the CPU pool when neither its size nor its bytes are given
# Every dtype some backend takes; each takes a subset (gpu/cpu_runner.py CPU_DTYPES,
# gpu/cuda/dtypes.py CUDA_DTYPES).
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = DTYPES  # the same names (vLLM's flag; its fp8 types are not here)
CPU_ACTIVATION_DTYPES = ("auto", "int8", "float32")


def max_num_batched_tokens_for(device: str) -> int:
    """The default tokens per step on a resolved device ("cpu" or "cuda")."""
    return CUDA_MAX_NUM_BATCHED_TOKENS if device == "cuda" else CPU_MAX_NUM_BATCHED_TOKENS


def _at_least(obj, low: int, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < low:
            raise ValueError(f"{name} must be at least {low}, got {value}.")


def _one_of(obj, name: str, choices: tuple[str, ...]) -> None:
    if getattr(obj, name) not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(obj, name)!r}.")


@dataclass(kw_only=True)
class DeviceConfig:
    device: str = field(default="auto", metadata={
        "choices": DEVICES,
        "help": "backend: auto is cuda when CuPy is installed and a GPU is visible, else cpu"})
    dtype: str = field(default="auto", metadata={
        "choices": DTYPES,
        "help": "weights (on cuda also activations and the KV cache): auto is float32 on cpu (which "
                "also takes bfloat16 weights); on cuda the checkpoint's bfloat16 or float16, float16 "
                "for a float32 or quantized one (vLLM's rule)"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "cuda: no CUDA graphs for decode (debugging; slower)"})
    cpu_threads: int | None = field(default=None, metadata={
        "help": "cpu: threads an engine step runs on (llama.cpp's -t); default: the cores this "
                "process may use, shared by --engines (docs/bench_quant.md)"})
    cpu_activation_dtype: str = field(default="auto", metadata={
        "choices": CPU_ACTIVATION_DTYPES,
        "help": "cpu: what quantized (GGUF integer) weights multiply: int8 blocks of the activations "
                "through AVX-512 VNNI dot products, as llama.cpp (2.3-12x the float kernels), or float32 "
                "(exact: gguf-py's dequantized weights); auto is int8 where the CPU has VNNI"})
    attention_backend: str = field(default="auto", metadata={
        "choices": ATTENTION_BACKENDS,
        "help": "cuda paged attention: rawkernel is the tuned CUDA C kernel, numba the "
                "fallback; auto is rawkernel where it handles the model's head size"})

    def __post_init__(self) -> None:
        _one_of(self, "device", DEVICES)
        _one_of(self, "dtype", DTYPES)
        _one_of(self, "attention_backend", ATTENTION_BACKENDS)
        _one_of(self, "cpu_activation_dtype", CPU_ACTIVATION_DTYPES)
        _at_least(self, 1, "cpu_threads")


@dataclass(kw_only=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "cuda: the share of GPU memory for the weights, one step's activations and "
                "the KV pool, in (0, 1]"})
    num_gpu_blocks_override: int | None = field(default=None, metadata={
        "help": "KV pool size in blocks (default: from --gpu-memory-utilization on cuda, "
                "from --kv-cache-memory-bytes on cpu)"})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": f"cpu: bytes for the KV pool, K and V over all layers (default "
                f"{CPU_KV_CACHE_MEMORY_BYTES >> 30} GiB)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of a prompt prefix seen before"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "choices": KV_CACHE_DTYPES,
        "help": "the KV cache's storage type: auto is float32 on cpu, the serving dtype on cuda "
                "(its only one); on cpu bfloat16 or float16 halve the cache's bytes (attention "
                "reads them widened to float32)"})

    def __post_init__(self) -> None:
        _at_least(self, 1, "block_size", "num_gpu_blocks_override", "kv_cache_memory_bytes")
        _one_of(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}.")


@dataclass(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata={
        "help": "most sequences in one engine step (the CUDA graph ladder goes up to it)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": f"most tokens in one engine step; longer prompts are prefilled in chunks "
                f"(default: {CUDA_MAX_NUM_BATCHED_TOKENS} on cuda, {CPU_MAX_NUM_BATCHED_TOKENS} "
                f"on cpu, where it keeps a step short: docs/engine.md)"})

    def __post_init__(self) -> None:
        _at_least(self, 1, "max_num_seqs", "max_num_batched_tokens")
