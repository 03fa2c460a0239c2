"""Engine arguments: the same names as the `ringserve serve` flags, in snake_case."""
from __future__ import annotations

from dataclasses import dataclass

from ringserve.gpu.cuda.launch import ATTENTION_BACKENDS

# Tokens per step when max_num_batched_tokens is not given; longer prompts are chunked.
CUDA_MAX_NUM_BATCHED_TOKENS = 8192
# The CPU's is small so that a step stays short: every running request waits for the whole
# step for its next token. Measured (docs/engine.md, the default model, 2 cores): an 8,000-token
# prompt is one 84-166 s step at 8192, 4 steps of up to 37 s at 2048, 16 of 3.6-9 s at 512;
# its total cost is the same at any budget. 512 = 2 x the default max_num_seqs: all running
# sequences decode every step with room left for a prompt chunk.
CPU_MAX_NUM_BATCHED_TOKENS = 512


@dataclass
class EngineConfig:
    model: str | None = None                 # name, HF folder or .gguf (gpu.model_store.resolve_model)
    max_model_len: int | None = None         # None: the model's max_position_embeddings
    max_num_seqs: int = 256                  # sequences per step
    max_num_batched_tokens: int | None = None  # tokens per step (longer prompts are chunked);
                                             # None: by device, see *_MAX_NUM_BATCHED_TOKENS
    block_size: int = 16                     # tokens per KV-cache block
    num_gpu_blocks_override: int | None = None  # pool size in blocks; None: from the memory budget
    gpu_memory_utilization: float = 0.9      # cuda: share of GPU memory for weights + KV pool
    kv_cache_memory_bytes: int | None = None  # cpu: bytes for the KV pool (None: the runner's default)
    enable_prefix_caching: bool = True
    device: str = "auto"                     # auto: cuda when CuPy sees a GPU, else cpu (gpu/devices.py)
    dtype: str = "auto"                      # auto: float32 on cpu, float16 on cuda
    enforce_eager: bool = False              # cuda: no CUDA graphs for decode
    attention_backend: str = "auto"          # cuda paged attention: auto/rawkernel (CUDA C) or numba
    seed: int = 0                            # seeds the generator of requests without their own seed

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            from ringserve.gpu.devices import resolve_device
            self.max_num_batched_tokens = (CUDA_MAX_NUM_BATCHED_TOKENS if resolve_device(self.device) == "cuda"
                                           else CPU_MAX_NUM_BATCHED_TOKENS)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto, rawkernel or numba, got {self.attention_backend!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
