"""The CUDA runner's host-side arithmetic, pure Python so that CI tests it without a GPU:
which batch sizes get a CUDA graph, how a decode batch is padded up to one, how the KV pool
is sized from free memory, and how many key splits a paged-attention launch uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ringserve.gpu.batch import Batch
from ringserve.gpu.settings import StepLimits

MAX_CAPTURED_BATCH = 512  # graphs beyond this cost capture time and memory for little gain


def graph_batch_sizes(max_num_seqs: int, cap: int = MAX_CAPTURED_BATCH) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_num_seqs (rounded up to a multiple of 8 so the
    largest batch has a graph), at most cap."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs {max_num_seqs} must be at least 1")
    top = min(cap, max_num_seqs if max_num_seqs <= 8 else -(-max_num_seqs // 8) * 8)
    sizes = [s for s in (1, 2, 4, 8) if s <= top]
    if sizes[-1] < top and top <= 8:
        sizes.append(top)
    sizes += list(range(16, top + 1, 8))
    return sizes


def padded_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_reqs, or None (run eagerly)."""
    for s in sizes:
        if s >= num_reqs:
            return s
    return None


def is_decode_only(batch: Batch) -> bool:
    """Every request schedules exactly one token: the shape CUDA graphs are captured for."""
    return batch.num_tokens == batch.num_reqs


def verify_batch_sizes(max_num_seqs: int, max_num_verify_seqs: int) -> list[int]:
    """Speculative decoding: the ladder of verify graphs, the decode ladder's sizes up to the
    most requests a step that speculates runs (disable_by_batch_size; larger steps decode)."""
    if max_num_verify_seqs < 1:
        raise ValueError(f"max_num_verify_seqs {max_num_verify_seqs} must be at least 1")
    return graph_batch_sizes(min(max_num_seqs, max_num_verify_seqs))


@dataclass
class PaddedStep:
    """A batch padded to a captured graph's shape (GraphTable.shape: T tokens, B requests, R
    rows of logits): padded tokens write nowhere (slot -1), belong to a padded request with no
    keys (seq_len 0: the first padded request owns them all, those after it none), and their
    logits rows (row 0 again) are dropped.

    block_tables stays the real [n, width] rows: they are copied into the top-left corner of
    the graph's [B, max_blocks] device table and the rest keeps what earlier steps left
    there. Nothing reads it: a padded row has no keys, and a real row reads only the blocks
    of its seq_len, all within width. (A full-width host table would be B x max_blocks,
    e.g. 8 MB per step at 256 requests and a 128k context.)"""
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    logits_indices: np.ndarray
    block_tables: np.ndarray  # [n, width], the batch's own
    num_real: int


def pad_step(batch: Batch, shape: tuple[int, int, int], max_blocks: int) -> PaddedStep:
    """batch padded to shape (T, B, R). The padded tokens need a padded request to own them:
    fewer requests than B, or no padded token."""
    T, B, R = shape
    n, t, rows = batch.num_reqs, batch.num_tokens, batch.logits_indices
    if n > B or t > T or len(rows) > R or (n == B and t < T):
        raise ValueError(f"pad_step: {t} tokens for {n} requests ({len(rows)} rows) into {shape}")
    width = batch.block_tables.shape[1]
    if width > max_blocks:
        raise ValueError(f"pad_step: {width} blocks per request exceed the graph's {max_blocks}")

    def grow(a: np.ndarray, size: int, fill: int) -> np.ndarray:
        out = np.full(size, fill, np.int32)
        out[:len(a)] = a
        return out

    return PaddedStep(
        input_ids=grow(batch.input_ids, T, 0), positions=grow(batch.positions, T, 0),
        slot_mapping=grow(batch.slot_mapping, T, -1),
        query_start_loc=grow(batch.query_start_loc, B + 1, T),
        seq_lens=grow(batch.seq_lens, B, 0), logits_indices=grow(rows, R, 0),
        block_tables=batch.block_tables, num_real=n)


def pad_decode(batch: Batch, size: int, max_blocks: int) -> PaddedStep:
    """A decode batch padded to a decode graph of `size` requests."""
    if not is_decode_only(batch):
        raise ValueError(f"pad_decode: {batch.num_tokens} tokens for {batch.num_reqs} requests")
    return pad_step(batch, (size, size, size), max_blocks)


class GraphTable:
    """Which sizes have a captured graph; the runner stores its graph objects here and asks
    which one a batch replays. query_len: the tokens per request a size is captured for, 1 for
    decode graphs, 1 + K for speculative decoding's verify graphs (vLLM's uniform decode query
    length), whose size n holds n requests of up to 1 + K tokens each: n x (1 + K) tokens and
    rows of logits, and n + 1 request slots (the last owns the padding tokens)."""

    def __init__(self, sizes: list[int], query_len: int = 1):
        if query_len < 1:
            raise ValueError(f"query_len {query_len} must be at least 1")
        self.sizes = sorted(sizes)
        self.query_len = query_len
        self.graphs: dict[int, Any] = {}  # the runner's buffers.CapturedGraph records
        self.capture_seconds: dict[int, float] = {}

    def add(self, size: int, graph: Any, seconds: float) -> None:
        if size not in self.sizes:
            raise ValueError(f"size {size} is not on the ladder {self.sizes}")
        self.graphs[size] = graph
        self.capture_seconds[size] = seconds

    def shape(self, size: int) -> tuple[int, int, int]:
        """(tokens, requests, rows of logits) of the graph of `size`."""
        q = self.query_len
        return (size, size, size) if q == 1 else (size * q, size + 1, size * q)

    def fit(self, batch: Batch) -> int | None:
        """The smallest size whose shape holds this batch, captured or not. A decode table takes
        decode batches only; a verify table any step of at most n requests and n x (1 + K)
        tokens."""
        if self.query_len == 1 and not is_decode_only(batch):
            return None
        return next((s for s in self.sizes if batch.num_reqs <= s
                     and batch.num_tokens <= s * self.query_len), None)

    def pick(self, batch: Batch) -> int | None:
        """The size whose graph runs this batch, or None (eager)."""
        if not self.graphs:
            return None
        size = self.fit(batch)
        return size if size in self.graphs else None

    def pad(self, batch: Batch, size: int, max_blocks: int) -> PaddedStep:
        return pad_step(batch, self.shape(size), max_blocks)


def graph_tables(limits: StepLimits) -> tuple[GraphTable, GraphTable]:
    """The decode ladder up to max_num_seqs and the verify ladder (empty without speculative
    decoding) for these step limits, nothing captured yet."""
    k = limits.num_speculative_tokens
    verify = verify_batch_sizes(limits.max_num_seqs, limits.max_num_verify_seqs) if k else []
    return GraphTable(graph_batch_sizes(limits.max_num_seqs)), GraphTable(verify, 1 + k)


def shared_shape(tables: list[GraphTable]) -> tuple[int, int, int]:
    """(tokens, requests, rows of logits) of the one set of step buffers every graph of these
    tables takes its views from: the largest of each over all their sizes."""
    shapes = [t.shape(size) for t in tables for size in t.sizes]
    if not shapes:
        raise ValueError("shared_shape: no graph sizes")
    T, B, R = (max(dim) for dim in zip(*shapes, strict=True))
    return T, B, R


def kv_bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       itemsize: int) -> int:
    """K and V of one block over all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def num_kv_blocks(*, total_bytes: int, used_bytes_after_profile: int, bytes_per_block: int,
                  gpu_memory_utilization: float) -> int:
    """vLLM's rule: the process may use gpu_memory_utilization of the device; what the weights
    and the profiling forward's peak left of that share goes to the KV pool."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization} must be in (0, 1]")
    budget = int(total_bytes * gpu_memory_utilization) - used_bytes_after_profile
    if budget < bytes_per_block:
        raise ValueError(
            f"no room for the KV cache: {gpu_memory_utilization:.0%} of {total_bytes / 2**30:.1f} GiB "
            f"is {total_bytes * gpu_memory_utilization / 2**30:.1f} GiB and the model's forward "
            f"already uses {used_bytes_after_profile / 2**30:.1f} GiB; raise --gpu-memory-utilization")
    return budget // bytes_per_block


def window_splits(windows, *, num_tokens: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                  partition_size: int = 512) -> dict[int, int]:
    """Each sliding window's split count (> 0 in `windows`, the layers' ModelConfig
    .layer_windows): a windowed layer's queries read at most `window` keys, so it is planned
    from min(max_seq_len, window); planned from max_seq_len (a long max_model_len) it split a
    1k window into up to 16 shares of 64 keys, each block's partials written and combined."""
    return {w: attention_splits(num_tokens=num_tokens, num_kv_heads=num_kv_heads,
                                max_seq_len=min(max_seq_len, w), num_sms=num_sms,
                                partition_size=partition_size)
            for w in sorted(set(windows)) if w > 0}


def attention_splits(*, num_tokens: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                     partition_size: int = 512, max_splits: int = 16) -> int:
    """Key splits for the paged-attention RawKernel: split only when the (token, KV head)
    blocks fill less than two waves of SMs and the context is longer than one partition."""
    blocks = num_tokens * num_kv_heads
    if blocks >= 2 * num_sms or max_seq_len <= partition_size:
        return 1
    want = -(-2 * num_sms // max(blocks, 1))
    return max(1, min(max_splits, want, -(-max_seq_len // partition_size)))
