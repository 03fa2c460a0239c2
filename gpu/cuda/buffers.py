"""The CUDA backend's side of gpu/models/ that CI runs without CuPy: the dense weight store,
the step buffers a forward (and a CUDA graph) runs over, and the attention launch plan. On a GPU
xp is cupy (gpu/cuda/runner.py); in tests/test_cuda_forward_host.py it is numpy.

Weights, activations and KV cache in the serving dtype (gpu/cuda/dtypes.py: fp16, or bfloat16
as uint16 bits); the residual stream h is float32 (one fused add + RMSNorm kernel per residual
step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ringserve.gpu.bfloat16 import to_bfloat16
from ringserve.gpu.cuda.dtypes import SERVING_DTYPES
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.weights import GGMLTensor


class DenseStore:
    """model.WeightStore: every weight as one contiguous array of xp in the serving dtype
    (arrays stacked along rows: fused QKV and gate-up are one GEMM each). "float16": F16 as it
    is, F32 and BF16 narrowed (the runner first refuses values fp16 cannot hold:
    dtypes.check_fp16_range); "bfloat16": BF16 bits as they are, F32 and F16 rounded to nearest
    even, all as uint16."""

    def __init__(self, xp, dtype: str = "float16"):
        if dtype not in SERVING_DTYPES:
            raise ValueError(f"dense store: dtype {dtype!r}, expected one of {', '.join(SERVING_DTYPES)}")
        self.xp, self.dtype = xp, dtype
        self._cast = self._fp16 if dtype == "float16" else self._bf16

    def linear(self, arrays: Sequence[Any]) -> Any:
        xp = self.xp
        return xp.ascontiguousarray(xp.concatenate([self._cast(a) for a in arrays]))

    def _fp16(self, a: Any) -> Any:
        """One tensor as fp16 on the device. NOTE: a host tensor is made fp16 by numpy first: a
        GGMLTensor (gpu/loader/weights.py) is numpy's through __array__, which CuPy's asarray reaches
        only through numpy.array(copy=False) (cupy/_core/core.pyx _array_default)."""
        if isinstance(a, self.xp.ndarray):
            return a.astype(self.xp.float16, copy=False)
        return self.xp.asarray(np.asarray(a, dtype=np.float16))

    def _bf16(self, a: Any) -> Any:
        """One tensor as bfloat16 bits on the device: a BF16 tensor's own bits (exact), anything
        else rounded from its float32 values (on the device for an array already there)."""
        if isinstance(a, GGMLTensor) and a.ggml_type == "BF16":
            return self.xp.asarray(np.asarray(a.raw).view(np.uint16).reshape(a.shape))
        if isinstance(a, self.xp.ndarray):
            return to_bfloat16(self.xp, a)
        return self.xp.asarray(to_bfloat16(np, np.asarray(a, dtype=np.float32)))

    vector = linear


class PinnedStaging:
    """Host->device inputs through page-locked memory. A copy from pageable memory is staged by
    the driver, which waits for the stream to reach it: the host would wait for the previous
    step's kernels and the engine's overlapped loop (launch N, host work, wait N) would not
    overlap. Each copy takes the next of `slots` pinned buffers in turn (grown as needed) and
    records an event after it; a buffer is written again only once its last copy is done
    (normally long done: a step waits for its tokens before the next one is staged).

    alloc(nbytes) -> a pinned uint8 numpy array (cupy.cuda.alloc_pinned_memory on a GPU);
    event() -> an event with record(stream) and synchronize() (cupy.cuda.Event)."""

    def __init__(self, alloc: Callable[[int], np.ndarray], event: Callable[[], Any], slots: int = 4):
        self.alloc, self.event = alloc, event
        self.buffers: list[np.ndarray | None] = [None] * slots
        self.events: list[Any] = [None] * slots
        self.next = 0

    def stage(self, src: np.ndarray) -> np.ndarray:
        """src copied into the next pinned buffer (a view of it with src's dtype and shape)."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.events[i] is not None:
            self.events[i].synchronize()  # its previous copy has read it
        buf = self.buffers[i]
        if buf is None or buf.nbytes < src.nbytes:
            buf = self.buffers[i] = self.alloc(max(4096, 1 << (src.nbytes - 1).bit_length()))
        host = buf[:src.nbytes].view(src.dtype).reshape(src.shape)
        host[...] = src
        self._last = i
        return host

    def issued(self, stream: Any) -> None:
        """The copy from the buffer stage() gave last is enqueued on stream."""
        if self.events[self._last] is None:
            self.events[self._last] = self.event()
        self.events[self._last].record(stream)


class HostCopies(Protocol):
    """The copies StepBuffers.load needs (CudaOps; HostOps in CI)."""

    def copy_in(self, dst, src: np.ndarray) -> None:
        """dst[:len(src)] = src (host int32 to the device)."""

    def copy_in_corner(self, dst, src: np.ndarray) -> None:
        """dst[:rows, :cols] = src, src [rows, cols] on the host."""


class StepBuffers:
    """Every activation of one forward over T tokens and B requests (static for a graph), in the
    serving dtype but for the float32 residual stream h and logits.
    xp: the array module the device allocates with (cupy; numpy on the host).

    The step's small int32 inputs share one block, so that a step loads them in one copy:
    [input_ids T | positions T | slot_mapping T | query_start_loc B+1 | seq_lens B |
    logits_indices R]; the block table has its own copy (a corner of a wide table). R, the rows
    of logits, is B but in a verify step (speculative decoding: 1 + k rows per request)."""

    # Views of `inputs` (set by name in __init__), numpy or cupy int32 arrays.
    input_ids: Any
    positions: Any
    slot_mapping: Any
    query_start_loc: Any
    seq_lens: Any
    logits_indices: Any

    PER_TOKEN = ("input_ids", "positions", "slot_mapping", "h", "x", "delta", "qkv", "attn",
                 "gate_up", "act")
    # Every row goes through the last layer (CpuStepBuffers narrows to the rows that need logits
    # there): a graph's shapes are fixed, and a GPU's prefill is not where its time goes.
    output_rows = None
    PER_REQUEST = ("seq_lens", "block_tables")
    PER_ROW = ("logits_indices", "last", "logits16", "logits")

    def __init__(self, c: ModelConfig, T: int, B: int, max_blocks: int, xp, dtype: Any = np.float16,
                 R: int | None = None):
        """dtype: the activations' storage (dtypes.SERVING_DTYPES: float16, or uint16 bf16 bits).
        R: the rows of logits (None: B, one per request)."""
        R = B if R is None else R
        self.inputs = xp.zeros(3 * T + 2 * B + 1 + R, xp.int32)
        self.offsets = {"input_ids": 0, "positions": T, "slot_mapping": 2 * T,
                        "query_start_loc": 3 * T, "seq_lens": 3 * T + B + 1,
                        "logits_indices": 3 * T + 2 * B + 1}
        for name, n in (("input_ids", T), ("positions", T), ("slot_mapping", T),
                        ("query_start_loc", B + 1), ("seq_lens", B), ("logits_indices", R)):
            setattr(self, name, self.inputs[self.offsets[name]:self.offsets[name] + n])
        self.slot_mapping[...] = -1
        self.block_tables = xp.full((B, max_blocks), -1, xp.int32)
        self.h = xp.empty((T, c.hidden_size), xp.float32)
        self.x = xp.empty((T, c.hidden_size), dtype)
        self.delta = xp.empty((T, c.hidden_size), dtype)
        self.qkv = xp.empty((T, c.q_size + 2 * c.kv_size), dtype)
        self.attn = xp.empty((T, c.q_size), dtype)
        self.gate_up = xp.empty((T, 2 * c.intermediate_size), dtype)
        self.act = xp.empty((T, c.intermediate_size), dtype)
        self.last = xp.empty((R, c.hidden_size), dtype)
        self.logits16 = xp.empty((R, c.vocab_size), dtype)
        self.logits = xp.empty((R, c.vocab_size), xp.float32)

    @property
    def mlp_rows(self) -> tuple[slice, ...]:
        """The MLP runs over all T rows at once (models/ops.gated_mlp): its [T, 2 I] activations
        are small beside a GPU's memory, and one launch per linear is what a graph wants."""
        return (slice(0, self.x.shape[0]),)

    def leading(self, T: int, B: int, R: int | None = None) -> StepBuffers:
        """Views of the first T tokens, B requests and R rows of logits (None: B). Every graph
        (decode and verify sizes) takes its buffers from one set, the largest of each: graphs
        replay one at a time on one stream, and the memory of the smaller sizes' activations and
        logits is not spent again."""
        view = object.__new__(StepBuffers)
        view.inputs, view.offsets = self.inputs, self.offsets
        for name in self.PER_TOKEN:
            setattr(view, name, getattr(self, name)[:T])
        for name in self.PER_REQUEST:
            setattr(view, name, getattr(self, name)[:B])
        for name in self.PER_ROW:
            setattr(view, name, getattr(self, name)[:B if R is None else R])
        view.query_start_loc = self.query_start_loc[:B + 1]
        return view

    def load(self, b, ops: HostCopies) -> None:
        """Copy a Batch (or a plan.PaddedStep) into the leading rows: the int32 inputs in one
        copy of the whole block (rows past this view's get slot -1 and seq_len 0: they write and
        read nothing), the block table into its top-left [B, width] corner (the columns past
        width are never read)."""
        host = np.zeros(len(self.inputs), np.int32)
        o = self.offsets
        host[o["slot_mapping"]:o["query_start_loc"]] = -1
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                     "logits_indices"):
            values = getattr(b, name)
            host[o[name]:o[name] + len(values)] = values
        ops.copy_in(self.inputs, host)
        tables = np.ascontiguousarray(b.block_tables, np.int32)
        if tables.size:
            ops.copy_in_corner(self.block_tables, tables)


@dataclass
class AttentionLaunch:
    """How one forward's paged attention is launched (gpu/cuda/plan.attention_splits)."""
    splits: int
    workspace: tuple      # split-K partials and tickets (PagedAttention.workspace), Nones for 1 split
    # One token per request (a decode graph, or an eager decode): attention.cu's launch does
    # RoPE and the K/V write too (paged_attention_rope), one launch where two were.
    decode_only: bool = False
    # A sliding window's own split count (plan.window_splits: its queries read at most window
    # keys); `splits` for full attention and any window not here. The workspace fits `splits`.
    window_splits: dict[int, int] = field(default_factory=dict)

    def splits_for(self, window: int) -> int:
        return self.window_splits.get(window, self.splits) if window > 0 else self.splits


@dataclass
class CapturedGraph:
    """One captured decode graph and the step-scoped buffers its launches point at.

    A CUDA graph keeps raw device addresses, not references: whatever it reads or writes must
    stay allocated for as long as it can replay. An array whose last reference goes returns its
    memory to CuPy's pool, which hands it to the next allocation, or to the driver on
    free_all_blocks (and on CuPy's own retry after an out-of-memory error): the next replay
    would write into someone else's array or into unmapped memory (a sticky error, the end of
    the engine). So the record holds its graph's per-step buffers (views of the runner's one
    StepBuffers) and its attention launch (the split-K workspace); the runner holds the rest
    (weights, KV caches, RoPE tables, the cuBLAS and quant workspaces) for its own life, which
    is the graphs' (tests/test_cuda_graph_memory.py checks every captured launch's operands)."""
    graph: Any            # cupy.cuda.graph.Graph
    buffers: StepBuffers
    attention: AttentionLaunch

    def launch(self, stream: Any) -> None:
        self.graph.launch(stream)
