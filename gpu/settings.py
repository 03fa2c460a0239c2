"""The runner's settings: the device (DeviceConfig), the KV cache (CacheConfig), the largest
step it must be ready for (StepLimits). vLLM's DeviceConfig and CacheConfig.

Each setting field holds its default, its help text (metadata "help") and, where it has a fixed
set of values, its choices (metadata "choices"); each class checks its fields in __post_init__,
and DeviceConfig also the checks that depend on the backend it resolves to (check_backend).
engine/config.py's EngineConfig holds one of each of the first two (and makes the StepLimits
from its SchedulerConfig); `ringserve serve` generates its flags from their fields
(server/config.py add_arguments), and the runners take these objects whole. Importing this
module loads neither numba nor CuPy: the CLI builds its --help from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.gpu.devices import DEVICES, cuda_stack_problem, cupy_installed, resolve_device

CPU_KV_CACHE_MEMORY_BYTES = 1 << 30  # the CPU pool when neither its size nor its bytes are given
# Every dtype some backend takes; each takes a subset (CPU_DTYPES, CUDA_DTYPES).
DTYPES = ("auto", "float32", "bfloat16", "float16")
CUDA_DTYPES = ("auto", "float16", "bfloat16")   # --dtype on cuda (float32: no; gpu/cuda/dtypes.py)
ATTENTION_BACKENDS = ("auto", "rawkernel", "numba")  # --attention-backend (gpu/cuda/launch.py)
KV_CACHE_DTYPES = DTYPES  # the same names (vLLM's flag; its fp8 types are not here)
CPU_ACTIVATION_DTYPES = ("auto", "int8", "float32")
# dtype -> how the CPU backend stores float32 weights; it always computes in float32. "bfloat16"
# is an option that halves the bytes a decode step streams (its logits differ from float32's by
# bf16 rounding of the weights); float32 is the default and matches transformers. Weights stored
# in another type (GGUF blocks, F16, BF16) stay in it whatever the dtype (gpu/cpu/packed.py).
CPU_DTYPES = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16"}
CPU_KV_CACHE_DTYPES = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


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

    def check_backend(self, cache: CacheConfig) -> str:
        """The backend this resolves to ("cpu" or "cuda": gpu/devices.py resolve_device), after
        the checks that depend on it: its dtypes (the weights' and `cache`'s) and, on CUDA, that
        CuPy and a working CUDA stack are installed. ValueError, one line, otherwise."""
        device = resolve_device(self.device)
        name, dtypes, kv_dtypes, kv_note = (
            ("CPU", CPU_DTYPES, CPU_KV_CACHE_DTYPES, "") if device == "cpu" else
            ("CUDA", CUDA_DTYPES, CUDA_DTYPES, ": its KV cache is in the serving dtype"))
        if self.dtype not in dtypes:
            raise ValueError(f"dtype {self.dtype!r} is not supported by the {name} backend "
                             f"({', '.join(dtypes)})")
        if cache.kv_cache_dtype not in kv_dtypes:
            raise ValueError(f"kv_cache_dtype {cache.kv_cache_dtype!r} is not supported by the {name} "
                             f"backend ({', '.join(kv_dtypes)}{kv_note})")
        if device == "cpu":
            return device
        if not cupy_installed():
            raise ValueError("device 'cuda' needs CuPy: pip install -e '.[cuda]' (docs/deploy.md)")
        if (problem := cuda_stack_problem()) is not None:  # LLM and the tools too, not only serve
            raise ValueError(problem)
        return device


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


@dataclass(frozen=True)
class StepLimits:
    """The largest step the runner must be ready for, as the scheduler bounds it (engine/config.py
    SchedulerConfig, EngineConfig.step_limits): the CUDA runner captures its graph ladder up to
    max_num_seqs, sizes its KV pool after a profiling forward of max_num_batched_tokens, and its
    block tables for max_model_len (None: the model's max_position_embeddings). With speculative
    decoding (num_speculative_tokens K > 0) it also captures verify graphs, 1 + K tokens and rows
    of logits per request, for steps of up to max_num_verify_seqs requests (the engine's
    disable_by_batch_size: larger steps do not speculate). The CPU runner reads max_model_len
    (which LongRoPE factors, gpu/rope.py) and max_chunk_tokens (which kernels its warm-up loads).
    long_prefill_token_threshold: the scheduler's cap on one request's prompt chunk (0: none)."""
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None = None
    num_speculative_tokens: int = 0
    max_num_verify_seqs: int = 0
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        _at_least(self, 1, "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        _at_least(self, 0, "num_speculative_tokens", "max_num_verify_seqs", "long_prefill_token_threshold")

    @property
    def max_chunk_tokens(self) -> int:
        """The most tokens one request computes in a step: a prompt chunk within the step's
        budget, the cap, and the context (engine/scheduler.py _chunk)."""
        budget = self.max_num_batched_tokens
        return min(budget, self.long_prefill_token_threshold or budget, self.max_model_len or budget)
