"""The CPU backend's side of gpu/models/ops.py: its weight store, step buffers, KV cache and ops, in
numpy and Numba, over the batch contract of gpu/batch.py.

One step is one padding-free super-sequence of T tokens from B requests. The projections and the
MLP run as matmuls over all T tokens at once. Attention (gpu/cpu/attention.py) runs after this
step's K/V have been written into the paged cache at ``slot_mapping`` and reads keys and values
only through each request's block table — so a request sees its own past (from earlier steps
or earlier in this chunk) and nothing of anyone else's.

Where the time goes (docs/bench_forward.md): a decode step streams every weight once, so the
linears (gpu/cpu/linear.py) are bandwidth kernels; norms, RoPE and SiLU are fused Numba passes
(gpu/cpu/kernels.py) over buffers allocated once per step. Activations, K/V and sums are float32.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numba
import numpy as np

from ringserve.gpu.batch import Batch
from ringserve.gpu.bfloat16 import to_bfloat16, widen_bfloat16
from ringserve.gpu.cpu.attention import PARALLEL_KEY_READS, paged_attention_parallel
from ringserve.gpu.cpu.kernels import (
    add_rms_norm,
    gelu_tanh_mul,
    gelu_tanh_mul_parallel,
    qk_norm,
    rms_norm,
    rope_store_kv,
    rope_store_kv_parallel,
    silu_mul,
    silu_mul_parallel,
)
from ringserve.gpu.cpu.kv_dtypes import KV_CACHE_DTYPES
from ringserve.gpu.cpu.linear import linear
from ringserve.gpu.cpu.memory import HugePageArena
from ringserve.gpu.cpu.packed import PackedWeight, fuse_packed, packed_linear, packed_nbytes, packed_rows
from ringserve.gpu.cpu.prefill_attention import SERVED_MIN_TOKENS as TILED_MIN_TOKENS
from ringserve.gpu.cpu.prefill_attention import prefill_attention
from ringserve.gpu.cpu.tasks import task_counter
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.packing import is_packed

F32 = np.float32
# Multiply-adds below which a linear runs on one thread even when the step has several: ~100 us
# of one thread's work (int8 kernels at batch 1), against a parallel region's fork and join.
PARALLEL_MIN_MACS = 4 << 20
# Token rows from which the row-wise kernels (RoPE and the K/V write, the norms, the MLP's
# activation) run over the step's threads: ~30 us of one thread's work at the 1B shape's widths
PARALLEL_ROWS = 64
WEIGHT_DTYPES = ("float32", "bfloat16")


class CpuWeightStore:
    """model.WeightStore. A linear weight (and the embedding) stored packed (GGUF blocks, F16,
    BF16) stays in its type (gpu/cpu/packed.py: 4-9x fewer bytes than float32 for a decode step
    to stream); one stored as float32 is kept float32, or as bfloat16 bits in uint16 with
    --dtype bfloat16 (cpu_linear widens them on the fly). Norms and biases are float32. Packed
    weights and vectors live on huge pages (gpu/cpu/memory.py: 5-10 % off a decode step here)."""

    def __init__(self, weight_dtype: str = "float32", widen_packed: bool = False, int8: bool = False):
        """widen_packed: widen packed weights to weight_dtype too (the float path, for
        comparisons: tests, bench_forward). int8: integer GGUF kinds in the tiles of
        gpu/cpu/int8_kernels.py, multiplied by int8 activations (llama.cpp's numerics)."""
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype {weight_dtype!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
        self.bfloat16 = weight_dtype == "bfloat16"
        self.widen_packed = widen_packed
        self.int8 = int8
        self.arena = HugePageArena()

    def linear(self, arrays: Sequence[Any]) -> np.ndarray | PackedWeight:
        if not self.widen_packed and any(is_packed(a) for a in arrays):
            return self.arena.place(fuse_packed(arrays, self.int8))
        # NOTE: always a fresh array of our own, even of one tensor: a decode step streams
        # these, and a view into the loaded file's buffer may sit at any alignment. numpy
        # advises huge pages itself for arrays of 4 MiB and up, as a float matrix is
        w = np.concatenate([np.asarray(a, dtype=F32) for a in arrays])
        return to_bfloat16(np, w) if self.bfloat16 else w

    def nbytes(self, tensor) -> int:
        """What memory will hold for one HF tensor once stored (the start-up fit check): a
        matrix as this store keeps linear weights, a vector (norm, bias) as float32."""
        if len(tensor.shape) == 2 and is_packed(tensor) and not self.widen_packed:
            return packed_nbytes(tensor, self.int8)
        size = int(np.prod(tensor.shape))
        return size * (2 if self.bfloat16 and len(tensor.shape) == 2 else 4)

    def vector(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        return self.arena.place(np.concatenate([np.asarray(a, dtype=F32) for a in arrays]))


class KVCache(NamedTuple):
    """One layer's paged cache; a slot s is row s of the [num_blocks * block_size, ...] view."""
    k: np.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: np.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim]

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, config: ModelConfig,
                 dtype: str = "float32", arena: HugePageArena | None = None) -> KVCache:
        """dtype: a KV_CACHE_DTYPES name (gpu/cpu/kv_dtypes.py: 16-bit types are kept as bits).
        arena: where the pool lives (huge pages: attention reads it every step), else numpy's."""
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        storage = KV_CACHE_DTYPES[dtype]
        zeros = np.zeros if arena is None else arena.zeros
        return cls(zeros(shape, storage), zeros(shape, storage))


# Token rows of one MLP block (CpuStepBuffers.mlp_rows). PERF: blocks re-read the MLP's weights
# (each block is still bound by the int8 multiply-adds, not by that read), and the 512-token
# step's MLP activations are 12 MB on Llama-3.2-1B, not 48.
MLP_ROWS = 128


class CpuStepBuffers:
    """Every activation of one step over the batch's T tokens, float32 (np.empty: allocated per
    step, nothing to clear); the integer inputs are the Batch's own arrays."""

    def __init__(self, c: ModelConfig, batch: Batch, output_rows: np.ndarray | None = None):
        """output_rows: the rows whose final hidden state is read (sorted, unique), None: all."""
        T = batch.num_tokens
        b = batch
        self.input_ids, self.positions, self.slot_mapping = b.input_ids, b.positions, b.slot_mapping
        self.query_start_loc, self.seq_lens, self.block_tables = (b.query_start_loc, b.seq_lens,
                                                                  b.block_tables)
        # a request with this many query tokens (a prompt chunk) takes the tiled attention; the
        # others' tokens the per-token loop, which reads ~key_reads (token, key) pairs a layer
        num_tokens = np.diff(b.query_start_loc)
        looped = num_tokens < TILED_MIN_TOKENS
        self.tiled_attention = not looped.all()
        self.key_reads = int(num_tokens[looped] @ b.seq_lens[looped].astype(np.int64))
        self.h = np.empty((T, c.hidden_size), F32)       # the residual stream
        self.x = np.empty_like(self.h)                   # the normed input of the next linear
        self.delta = np.empty_like(self.h)               # attention / MLP output, added to h
        self.qkv = np.empty((T, c.q_size + 2 * c.kv_size), F32)
        self.q = np.empty((T, c.num_attention_heads, c.head_dim), F32)  # rotated by rope_store_kv
        self.attn = np.empty((T, c.q_size), F32)
        self.attn_heads = self.attn.reshape(self.q.shape)  # the same memory, as attention writes it
        # NOTE: the MLP in blocks of MLP_ROWS token rows: a 512-token step's [T, 2 I] and [T, I]
        # float32 (48 MB on a 1B) were the largest part of a serving engine's peak memory
        self.mlp_rows = _row_blocks(T)
        self.gate_up = np.empty((min(T, MLP_ROWS), 2 * c.intermediate_size), F32)
        self.act = np.empty((min(T, MLP_ROWS), c.intermediate_size), F32)
        self.output_rows = None if output_rows is None or len(output_rows) == T else output_rows

    def keep_output_rows(self) -> None:
        """From the last layer's o projection on, only output_rows: h and attn gathered into their
        first rows, x and delta narrowed to them (buf.x then holds the kept rows in order).
        PERF: a prompt's other rows feed nothing past the last layer's K/V (llama.cpp's
        inp_out_ids): its last o, gate_up and down run for one row, not 128 (~6 % of a 16-layer
        model's prefill). The int8 tiles give a row the same bits whatever rows run beside it;
        float weights past SMALL_ROWS rows go through sgemm, which rounds by row count (~1e-6)."""
        rows = self.output_rows
        assert rows is not None, "once a step"
        n = len(rows)
        self.h, self.attn = self.h[rows], self.attn[rows]
        self.x, self.delta = self.x[:n], self.delta[:n]
        self.mlp_rows = _row_blocks(n)
        self.output_rows = None


def _row_blocks(T: int) -> tuple[slice, ...]:
    return tuple(slice(i, min(i + MLP_ROWS, T)) for i in range(0, T, MLP_ROWS))


class CpuOps:
    """model.ModelOps in numpy and Numba. parallel: split the decode-size linears over Numba's
    threads (the caller sets their number; gpu/cpu/linear.py)."""

    def __init__(self, c: ModelConfig, parallel: bool = False):
        self.parallel = parallel
        # NOTE: float32 scalars, else Numba compiles float64 variants (other rounding, slower)
        self.scale = F32(c.attention_scale)
        self.eps = F32(c.rms_norm_eps)
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads

    def embedding(self, ids, table, out) -> None:
        if not isinstance(table, np.ndarray):
            packed_rows(table, ids, out)
        elif table.dtype == np.uint16:  # bfloat16 bits
            out[...] = widen_bfloat16(np, table[ids])
        else:
            np.take(table, ids, axis=0, out=out)

    def linear(self, x, weight, out) -> None:
        # PERF: a parallel region waits for its slowest thread, and one descheduled by the HTTP
        # workers stalls it: only a linear worth far more than that wait is split
        n, k = weight.shape
        parallel = self.parallel and x.shape[0] * n * k >= PARALLEL_MIN_MACS
        if isinstance(weight, np.ndarray):
            linear(x, weight, out, parallel=parallel)
        else:
            packed_linear(x, weight, out, parallel)

    def add_bias(self, x, bias) -> None:
        x += bias

    def _rows_parallel(self, x) -> bool:
        return self.parallel and len(x) >= PARALLEL_ROWS

    def _norm_threads(self, x) -> int:
        return numba.get_num_threads() if self._rows_parallel(x) else 1

    def add_rms_norm(self, h, delta, weight, out) -> None:
        if delta is None:
            rms_norm(h, weight, self.eps, out, self._norm_threads(h))
        else:
            add_rms_norm(h, delta, weight, self.eps, out, self._norm_threads(h))

    def rms_norm(self, x, weight) -> None:
        # NOTE: in place: each value is read before it is written
        rms_norm(x, weight, self.eps, x, self._norm_threads(x))

    def scale_embedding(self, h, factor: float) -> None:
        h *= F32(factor)

    def qk_norm(self, qkv, weight) -> None:
        qk_norm(qkv, self.num_heads, self.num_kv_heads, weight, self.eps)

    def attention(self, buf: CpuStepBuffers, cos, sin, k_cache, v_cache, launch: None, window: int) -> None:
        # PERF: one pass: q rotated into buf.q, k rotated and v copied straight into the cache; over
        # the threads for a long chunk
        rope = rope_store_kv_parallel if self._rows_parallel(buf.positions) else rope_store_kv
        rope(buf.qkv, buf.positions, cos, sin, buf.slot_mapping, k_cache, v_cache, buf.q)
        args = (buf.q, k_cache, v_cache, buf.positions, buf.query_start_loc, buf.seq_lens,
                buf.block_tables, self.scale, window, buf.attn_heads)
        # decodes and short chunks: the per-token loop, over the threads where they read many keys.
        # NOTE: one compiled driver for every step, on one thread or more: a token's result must not
        # depend on the batch (two drivers' copies of the same body, optimized apart, differed)
        # PERF: a region of one thread costs ~3 us, a fork and join 10-20
        threads = None if self.parallel and buf.key_reads >= PARALLEL_KEY_READS else 1
        counter = task_counter(len(buf.positions) * k_cache.shape[2], threads)
        paged_attention_parallel(*args, TILED_MIN_TOKENS - 1, counter)
        if buf.tiled_attention:
            # PERF: prompt chunks by query tiles over all threads: each key read once per tile,
            # not once per query token
            prefill_attention(*args, TILED_MIN_TOKENS)

    def silu_mul(self, gate_up, out) -> None:
        (silu_mul_parallel if self._rows_parallel(out) else silu_mul)(gate_up, out)

    def gelu_tanh_mul(self, gate_up, out) -> None:
        (gelu_tanh_mul_parallel if self._rows_parallel(out) else gelu_tanh_mul)(gate_up, out)

    def gather_rows(self, x, rows, out) -> None:
        np.take(x, rows, axis=0, out=out)

    def to_float32(self, src, out) -> None:
        if src is not out:
            out[...] = src
