"""The launch census of one CUDA decode step (or speculative decoding's verify step), without a GPU:
the model's definition (gpu/models model_definition: its forward, the sequence CudaModelRunner
captures) over CensusOps, a model.ModelOps over shape-only arrays that records, for each op, the
launches gpu/cuda/step_plan.py says CudaOps makes (kernel, grid, block) and the bytes each reads and
writes (weights, KV cache, activations). The step buffers are the runner's own StepBuffers over a
shape-only array module; the weights are the definition's, fused from the config's expected HF
shapes. tests/test_step_census.py checks the list against the launches the host-compiled forward
(tests/test_cuda_forward_host.py HostOps) really makes.

Bytes are what each kernel must move at least (every operand read or written once); what a kernel
reads twice (L2 misses) or what cuBLAS adds (its own split-K reduce at small M) is not here: the
census is the floor a step's time is measured against (tools/step_census.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ringserve.gpu.cuda import launch, plan, step_plan
from ringserve.gpu.cuda.buffers import AttentionLaunch, StepBuffers
from ringserve.gpu.cuda.dtypes import SERVING_DTYPES
from ringserve.gpu.cuda.step_plan import Launch
from ringserve.gpu.loader.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from ringserve.gpu.loader.weights import expected_shapes
from ringserve.gpu.models import model_definition


@dataclass(frozen=True)
class Shaped:
    """An array's shape and dtype, nothing else (slicing rows gives the leading rows' shape)."""
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key: Any) -> Shaped:
        if isinstance(key, slice):
            return Shaped((len(range(*key.indices(self.shape[0]))), *self.shape[1:]), self.dtype)
        return self  # [...]

    def __setitem__(self, key: Any, value: Any) -> None:
        pass  # no values to set

    def astype(self, dtype: Any) -> Shaped:
        return Shaped(self.shape, np.dtype(dtype))

    def __add__(self, other: Any) -> Shaped:  # a weight offset at load (Gemma's 1 + w norms)
        return self


class ShapedModule:
    """The few array-module calls StepBuffers makes (numpy's names), returning Shaped."""
    int32, float32 = np.dtype(np.int32), np.dtype(np.float32)

    @staticmethod
    def empty(shape, dtype) -> Shaped:
        return Shaped(tuple(np.atleast_1d(shape).tolist()), np.dtype(dtype))

    zeros = empty

    @staticmethod
    def full(shape, fill, dtype) -> Shaped:
        return ShapedModule.empty(shape, dtype)


@dataclass(frozen=True)
class PackedShape(Shaped):
    """A weight kept packed (QuantStore's planes): its GGUF/checkpoint type, plane kind and the
    bytes its planes hold (what a step reads of it)."""
    qtype: str = ""
    kind: str = ""
    packed_nbytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.packed_nbytes


@dataclass(frozen=True)
class SplitShape:
    """A fused weight whose parts differ in type (QuantStore's SplitWeight): each part its launch."""
    parts: tuple
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class ShapedStore:
    """model.WeightStore over Shaped: stacked rows in the serving dtype (as DenseStore); a
    linear with PackedShape parts stacked per run of one type (as QuantStore's fuse_packed)."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype

    def linear(self, arrays) -> Any:
        rows = sum(a.shape[0] for a in arrays)
        if not any(isinstance(a, PackedShape) for a in arrays):
            return Shaped((rows, *arrays[0].shape[1:]), self.dtype)
        parts: list = []
        for a in arrays:
            last = parts[-1] if parts else None
            if isinstance(a, PackedShape) and isinstance(last, PackedShape) and last.qtype == a.qtype:
                parts[-1] = PackedShape((last.shape[0] + a.shape[0], *a.shape[1:]), self.dtype, a.qtype,
                                        a.kind, last.packed_nbytes + a.packed_nbytes)
            else:
                parts.append(a if isinstance(a, PackedShape) else Shaped(a.shape, self.dtype))
        shape = (rows, *arrays[0].shape[1:])
        return parts[0] if len(parts) == 1 else SplitShape(tuple(parts), shape, self.dtype)

    def vector(self, arrays) -> Shaped:
        return Shaped((sum(a.shape[0] for a in arrays), *arrays[0].shape[1:]), self.dtype)


@dataclass
class Traffic:
    weights: int = 0
    kv_read: int = 0
    kv_written: int = 0
    act_read: int = 0
    act_written: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_read + self.kv_written + self.act_read + self.act_written


def partial_bytes(num_tokens: int, num_heads: int, head_dim: int, splits: int) -> int:
    """One layer's split-K partials (acc, max, sum: float32) each way; none for one split."""
    return num_tokens * num_heads * splits * (head_dim + 2) * 4 if splits > 1 else 0


@dataclass
class Row:
    """One launch of the step: the model op that made it, the layer (None outside the layers)."""
    op: str
    launch: Launch
    layer: int | None
    traffic: Traffic = field(default_factory=Traffic)


class CensusOps:
    """model.ModelOps over Shaped arrays: each op appends its launches (step_plan's, as
    CudaOps makes them) and their bytes. context: keys each request attends to this step (its
    cached tokens and the new one)."""

    def __init__(self, c: ModelConfig, weights: Any, attention_backend: str, context: int,
                 block_size: int = 16):
        self.c, self.backend, self.context, self.block_size = c, attention_backend, context, block_size
        self.num_heads, self.kvh, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.layer_of = {id(layer.qkv): i for i, layer in enumerate(weights.layers)}
        self.lm_head = weights.lm_head
        self.layer: int | None = None
        self.rows: list[Row] = []

    def _add(self, op: str, launch: Launch, **traffic: int) -> None:
        self.rows.append(Row(op, launch, self.layer, Traffic(**traffic)))

    def embedding(self, ids, table, out) -> None:
        T, n = out.shape
        if isinstance(table, PackedShape):  # QuantLinear.embedding: T rows dequantized
            self._add("embedding", step_plan.quant_embedding(table.kind, T, n, out),
                      weights=table.nbytes * T // table.shape[0], act_read=ids.nbytes, act_written=out.nbytes)
            return
        self._add("embedding", step_plan.numba_rows("gather_rows_kernel", T),
                  weights=T * n * table.itemsize, act_read=ids.nbytes, act_written=out.nbytes)

    def linear(self, x, weight, out) -> None:
        if id(weight) in self.layer_of:  # a layer's first op: the QKV projection
            self.layer = self.layer_of[id(weight)]
        elif weight is self.lm_head:
            self.layer = None
        for part in weight.parts if isinstance(weight, SplitShape) else (weight,):
            # NOTE: a part of a split weight reads all of x and writes its own columns of out
            written = out.nbytes * part.shape[0] // weight.shape[0]
            if not isinstance(part, PackedShape):
                self._add("linear", step_plan.gemm(), weights=part.nbytes, act_read=x.nbytes,
                          act_written=written)
                continue
            launches = step_plan.quant_linear(part.kind, x, part.shape[0])
            for i, one in enumerate(launches):  # the weight's bytes once, on its first launch
                self._add("linear", one, weights=part.nbytes if i == 0 else 0,
                          act_read=x.nbytes // len(launches), act_written=written // len(launches))

    def add_bias(self, x, bias) -> None:
        self._add("add_bias", step_plan.add_bias(x), weights=bias.nbytes, act_read=x.nbytes,
                  act_written=x.nbytes)

    def add_rms_norm(self, h, delta, weight, out) -> None:
        added = delta is not None
        self._add("add_rms_norm", step_plan.add_rms_norm(h, out), weights=weight.nbytes,
                  act_read=h.nbytes + (delta.nbytes if added else 0),
                  act_written=(h.nbytes if added else 0) + out.nbytes)

    def qk_norm(self, qkv, weight) -> None:
        T = qkv.shape[0]
        nbytes = T * (self.num_heads + self.kvh) * self.head_dim * qkv.itemsize
        self._add("qk_norm", step_plan.qk_norm(qkv, self.num_heads + self.kvh), weights=weight.nbytes,
                  act_read=nbytes, act_written=nbytes)

    def attention(self, buf, cos, sin, k_cache, v_cache, launch: AttentionLaunch, window: int) -> None:
        """CudaOps.attention's launches: rope_store_kv then attention, or one fused attention
        launch (a decode-only step on the RawKernel: q and the own k/v read from qkv, rotated
        in registers, k/v written; the cache supplies the other context - 1 keys)."""
        qkv, out = buf.qkv, buf.attn
        T, B, half = qkv.shape[0], buf.seq_lens.shape[0], cos.shape[1]
        q = T * self.num_heads * self.head_dim * qkv.itemsize
        new_kv = 2 * T * self.kvh * self.head_dim * qkv.itemsize  # the step's own k and v
        rope_inputs = 2 * T * half * cos.itemsize + 2 * T * 4  # cos, sin rows; positions, slots
        fused = step_plan.fuses_rope(self.backend, launch.decode_only)
        if not fused:
            plan = step_plan.rope_store_kv(qkv, self.num_heads, self.kvh, self.head_dim, half)
            self._add("rope_store_kv", plan, act_read=q + new_kv + rope_inputs, act_written=q,
                      kv_written=new_kv)
        keys = min(self.context, window) if window > 0 else self.context
        kv = 2 * T * keys * self.kvh * self.head_dim * k_cache.itemsize  # each token its request's keys
        tables = B * -(-keys // self.block_size) * 4 + 4 * (3 * T + 2 * B + 1)
        splits = launch.splits_for(window)
        attn = step_plan.attention(self.backend, qkv, self.num_heads, self.kvh, self.head_dim, splits, fused)
        # split: the partials written, then read back by the last block of each (token, KV head)
        partials = partial_bytes(T, self.num_heads, self.head_dim, splits)
        if fused:  # the own k/v from qkv, not the cache; written once
            self._add("attention", attn, kv_read=kv - new_kv, kv_written=new_kv,
                      act_read=q + new_kv + rope_inputs + tables + partials,
                      act_written=partials + out.nbytes)
        else:
            self._add("attention", attn, kv_read=kv, act_read=q + tables + partials,
                      act_written=partials + out.nbytes)

    def silu_mul(self, gate_up, out) -> None:
        self._add("silu_mul", step_plan.silu_mul(out), act_read=gate_up.nbytes, act_written=out.nbytes)

    def gelu_tanh_mul(self, gate_up, out) -> None:
        self._add("gelu_tanh_mul", step_plan.gelu_tanh_mul(out), act_read=gate_up.nbytes,
                  act_written=out.nbytes)

    def rms_norm(self, x, weight) -> None:
        self._add("rms_norm", step_plan.rms_norm(x), weights=weight.nbytes, act_read=x.nbytes,
                  act_written=x.nbytes)

    def scale_embedding(self, h, factor: float) -> None:
        self._add("scale_embedding", step_plan.scale_embedding(), act_read=h.nbytes, act_written=h.nbytes)

    def gather_rows(self, x, rows, out) -> None:
        self.layer = None
        self._add("gather_rows", step_plan.numba_rows("gather_rows_kernel", rows.shape[0]),
                  act_read=out.nbytes + rows.nbytes, act_written=out.nbytes)

    def to_float32(self, src, out) -> None:
        self._add("to_float32", step_plan.to_float32(src), act_read=src.nbytes, act_written=out.nbytes)


@dataclass
class Census:
    config: ModelConfig
    dtype: str
    batch: int
    context: int
    splits: int
    attention_backend: str
    rows: list[Row]
    speculative_tokens: int = 0   # K: a verify step, 1 + K tokens and rows of logits a request
    window_splits: dict[int, int] = field(default_factory=dict)  # a sliding window's own splits

    @property
    def num_tokens(self) -> int:
        return self.batch * (1 + self.speculative_tokens)

    @property
    def partial_bytes(self) -> int:
        """The split-K partials over the step, both ways (written, read back by the combine)."""
        c = self.config
        return 2 * sum(partial_bytes(self.num_tokens, c.num_attention_heads, c.head_dim,
                                     self.window_splits.get(w, self.splits) if w else self.splits)
                       for w in c.layer_windows)

    @property
    def per_layer(self) -> int:
        return sum(1 for r in self.rows if r.layer == 0)

    def total(self) -> Traffic:
        t = Traffic()
        for r in self.rows:
            for name in vars(t):
                setattr(t, name, getattr(t, name) + getattr(r.traffic, name))
        return t


# packed(HF name, shape) -> (type, plane kind, bytes of its planes), or None for a dense weight
Packed = Callable[[str, tuple], "tuple[str, str, int] | None"]


def decode_census(c: ModelConfig, *, batch: int, context: int, splits: int, dtype: str = "float16",
                  attention_backend: str = "rawkernel", max_blocks: int = 1,
                  speculative_tokens: int = 0, window_splits: dict[int, int] | None = None,
                  packed: Packed | None = None) -> Census:
    """The launches of one decode step of `batch` requests, each attending to `context` keys,
    as a graph replays it (T = B = batch; splits: the graph's, step_plan.graph_splits), or with
    speculative_tokens K of the verify step as its graph replays it (plan.GraphTable.shape:
    batch x (1 + K) tokens and rows of logits, batch + 1 request slots); packed: which weights
    are kept packed (quant.cu's launches) and their bytes."""
    T, B, R = plan.GraphTable([batch], 1 + speculative_tokens).shape(batch)
    act = np.dtype(SERVING_DTYPES[dtype])
    hf: dict[str, Shaped] = {}
    for name, shape in expected_shapes(c).items():
        p = packed(name, shape) if packed else None
        hf[name] = PackedShape(shape, np.dtype(np.float16), *p) if p else Shaped(shape, np.dtype(np.float16))
    model = model_definition(c)
    weights = model.fuse(c, hf, ShapedStore(act))
    buf = StepBuffers(c, T, B, max_blocks, ShapedModule, act, R)
    kv = Shaped((1, 16, c.num_key_value_heads, c.head_dim), act)
    half = (c.rotary_dim or c.head_dim) // 2
    table = Shaped((context, half), np.dtype(np.float32))
    ops = CensusOps(c, weights, attention_backend, context)
    launch = AttentionLaunch(splits, (None, None, None), speculative_tokens == 0, dict(window_splits or {}))
    model.forward(ops, weights, buf, [(kv, kv)] * c.num_hidden_layers, launch,
                  {FULL_ATTENTION: (table, table), SLIDING_ATTENTION: (table, table)})
    return Census(c, dtype, batch, context, splits, attention_backend, ops.rows, speculative_tokens,
                  dict(window_splits or {}))


def census_for(config: ModelConfig, *, batch: int, context: int, dtype: str, max_model_len: int,
               num_sms: int, attention_backend: str = "auto", speculative_tokens: int = 0,
               packed: Packed | None = None) -> Census:
    """The census of the decode graph CudaModelRunner captures for `batch` requests (with
    speculative_tokens K: its verify graph): its attention kernel (launch.attention_backend_for)
    and split counts (step_plan.graph_splits, graph_window_splits)."""
    backend = launch.attention_backend_for(attention_backend, config.head_dim)
    shape = dict(tokens=batch * (1 + speculative_tokens), num_kv_heads=config.num_key_value_heads,
                 max_model_len=max_model_len, num_sms=num_sms)
    splits = step_plan.graph_splits(**shape)
    windows = step_plan.graph_window_splits(**shape, windows=config.layer_windows)
    raw = backend == "rawkernel"
    return decode_census(config, batch=batch, context=context, dtype=dtype, attention_backend=backend,
                         splits=splits if raw else 1, speculative_tokens=speculative_tokens,
                         window_splits=windows if raw else {}, packed=packed)
