"""The model runner: what the engine calls once per step (DESIGN.md §1 station 5).

It owns the weights and the paged KV cache (allocated once, never resized) and turns a
Batch into logits. The CPU backend is numpy; a CUDA backend will sit behind the same face.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ringserve.gpu.batch import Batch
from ringserve.gpu.config import ModelConfig
from ringserve.gpu.cpu_model import CpuLlama, KVCache
from ringserve.gpu.weights import load_weights

DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30  # 1 GiB of K and V over all layers
CPU_DTYPES = {"auto": np.float32, "float32": np.float32}


class ModelRunner:
    def __init__(self, model_dir: str | Path, *, device: str = "cpu", dtype: str = "float32",
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None):
        if device == "cuda":
            raise ValueError("device 'cuda': the CUDA backend is not built yet; use device='cpu'")
        if device != "cpu":
            raise ValueError(f"device {device!r} is not supported (cpu or cuda)")
        if dtype not in CPU_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported by the CPU backend "
                             f"(it computes in float32: {', '.join(CPU_DTYPES)})")
        if block_size <= 0:
            raise ValueError(f"block_size {block_size} must be positive")
        self.device = device
        self.config = ModelConfig.from_dir(model_dir)
        self.model = CpuLlama(self.config, load_weights(model_dir), dtype=CPU_DTYPES[dtype])
        self.block_size = block_size

        if num_blocks is None:
            budget = DEFAULT_KV_CACHE_MEMORY_BYTES if kv_cache_memory_bytes is None else kv_cache_memory_bytes
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

    def execute(self, batch: Batch) -> np.ndarray:
        """float32 logits [B, vocab], one row per request at its last scheduled token;
        writes this step's K/V into the cache at batch.slot_mapping."""
        return self.model.forward(batch, self.kv_caches)
