"""Launcher for attention.cu (the paged-attention RawKernel, with split-K for long decodes, combined
in the same launch).
q, the KV cache and out in fp16 or bf16 (uint16 bits): the kernels of their element type
(attention.cu's plain and _bf16 instantiations)."""
from __future__ import annotations

import cupy as cp
import numpy as np

from ringserve.gpu.cuda import launch, step_plan, toolchain


class PagedAttention:
    def __init__(self, head_dim: int, group: int):
        self.head_dim, self.group = head_dim, group
        module = cp.RawModule(code=toolchain.source("attention.cu"), backend="nvrtc",
                              options=toolchain.options(dict(HEAD_DIM=head_dim, GQA_GROUP=group)))
        self._kernels = {name + s: module.get_function(name + s) for s in launch.SUFFIXES.values()
                         for name in ("paged_attention", "paged_attention_rope")}

    def workspace(self, num_tokens: int, num_heads: int, splits: int):
        """For `splits` > 1 (allocate before a graph capture, not during): the partial results
        and a zeroed ticket per (token, KV head), which the kernel leaves zeroed after each launch."""
        if splits == 1:
            return None, None, None
        return (cp.empty((num_tokens, num_heads, splits, self.head_dim), cp.float32),
                cp.empty((num_tokens, num_heads, splits, 2), cp.float32),
                cp.zeros((num_tokens, num_heads // self.group), cp.int32))

    def __call__(self, qkv, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
                 scale: float, out, stream, splits: int = 1, workspace=(None, None, None),
                 window: int = 0, rope: tuple | None = None) -> None:
        """splits > 1: each query's keys (from its first: 0, or its window's) in `splits` equal
        shares, one block each, combined by the last block of each (token, KV head) to finish;
        the shares are the kernel's, from each request's own length. window 0: full attention,
        else a sliding window (a launch argument: one graph node per layer, the same kernel).
        rope (slot_mapping, cos, sin), one token per request only: qkv as the QKV GEMM left it,
        rotated here and its k/v written at slot_mapping (paged_attention_rope; else
        rope_store_kv has run)."""
        num_blocks, block_size, kvh, d = k_cache.shape
        null = np.uint64(0)
        # NOTE: the cache and out must be qkv's element type (the runner's)
        attn = step_plan.attention("rawkernel", qkv, kvh * self.group, kvh, d, splits, rope is not None)
        extra = () if rope is None else (rope[0], rope[1], rope[2], np.int32(rope[1].shape[1]))
        self._kernels[attn.kernel](attn.grid, attn.block, (
            qkv, np.int32(qkv.shape[1]), k_cache, v_cache, positions, query_start_loc, seq_lens,
            block_tables, np.int32(block_tables.shape[1]), np.int32(seq_lens.shape[0]),
            np.int32(kvh), np.int32(block_size), np.float32(scale), np.int32(window), out,
            *(null if a is None else a for a in workspace), *extra), stream=stream)
