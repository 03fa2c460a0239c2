"""The CUDA backend's Llama forward as a sequence of device primitives, free of CuPy so that the
same sequence runs in CI: on a GPU the primitives are CuPy RawKernels, Numba CUDA kernels and
cuBLAS (gpu/cuda/runner.py CudaOps); in tests/test_cuda_forward_host.py they are the same CUDA
C kernels compiled for the host, with numpy standing in for cuBLAS, checked against the CPU
backend's logits.

fp16 weights, activations and KV cache; the residual stream h is float32 (one fused
add + RMSNorm kernel per residual step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from ringserve.gpu.config import ModelConfig


@dataclass
class Layer:
    input_norm: Any
    qkv: Any             # [q + 2 kv, hidden]: q_proj, k_proj, v_proj stacked (one GEMM)
    qkv_bias: Any | None
    o: Any
    post_norm: Any
    gate_up: Any         # [2 I, hidden]: gate_proj then up_proj (one GEMM, silu_mul splits it)
    down: Any


@dataclass
class LlamaWeights:
    embed: Any
    lm_head: Any
    final_norm: Any
    layers: list[Layer]

    @classmethod
    def fuse(cls, c: ModelConfig, w: dict, fp16: Callable[[list], Any]) -> LlamaWeights:
        """From HF tensor names; fp16(arrays) concatenates arrays along rows into one fp16
        device array."""
        def get(*names):
            return fp16([w[n] for n in names])

        embed = get("model.embed_tokens.weight")
        layers = []
        for i in range(c.num_hidden_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            layers.append(Layer(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=get(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                qkv_bias=get(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                if c.attention_bias else None,
                o=get(a + "o_proj.weight"), post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=get(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=get(p + "mlp.down_proj.weight")))
        return cls(embed, embed if c.tie_word_embeddings else get("lm_head.weight"),
                   get("model.norm.weight"), layers)


class StepBuffers:
    """Every activation of one forward over T tokens and B requests (static for a graph).
    xp: the array module the device allocates with (cupy; numpy on the host).

    The step's small int32 inputs share one block, so that a step loads them in one copy:
    [input_ids T | positions T | slot_mapping T | query_start_loc B+1 | seq_lens B |
    logits_indices B]; the block table has its own copy (a corner of a wide table)."""

    PER_TOKEN = ("input_ids", "positions", "slot_mapping", "h", "x", "delta", "qkv", "attn",
                 "gate_up", "act")
    PER_REQUEST = ("seq_lens", "block_tables", "logits_indices", "last", "logits16", "logits")

    def __init__(self, c: ModelConfig, T: int, B: int, max_blocks: int, xp):
        self.inputs = xp.zeros(3 * T + 3 * B + 1, xp.int32)
        self.offsets = {"input_ids": 0, "positions": T, "slot_mapping": 2 * T,
                        "query_start_loc": 3 * T, "seq_lens": 3 * T + B + 1,
                        "logits_indices": 3 * T + 2 * B + 1}
        for name, n in (("input_ids", T), ("positions", T), ("slot_mapping", T),
                        ("query_start_loc", B + 1), ("seq_lens", B), ("logits_indices", B)):
            setattr(self, name, self.inputs[self.offsets[name]:self.offsets[name] + n])
        self.slot_mapping[...] = -1
        self.block_tables = xp.full((B, max_blocks), -1, xp.int32)
        self.h = xp.empty((T, c.hidden_size), xp.float32)
        self.x = xp.empty((T, c.hidden_size), xp.float16)
        self.delta = xp.empty((T, c.hidden_size), xp.float16)
        self.qkv = xp.empty((T, c.q_size + 2 * c.kv_size), xp.float16)
        self.attn = xp.empty((T, c.q_size), xp.float16)
        self.gate_up = xp.empty((T, 2 * c.intermediate_size), xp.float16)
        self.act = xp.empty((T, c.intermediate_size), xp.float16)
        self.last = xp.empty((B, c.hidden_size), xp.float16)
        self.logits16 = xp.empty((B, c.vocab_size), xp.float16)
        self.logits = xp.empty((B, c.vocab_size), xp.float32)

    def leading(self, T: int, B: int) -> StepBuffers:
        """Views of the first T tokens and B requests. Every graph size takes its buffers from
        the largest one's: graphs replay one at a time on one stream, and the memory of the
        smaller sizes' activations and logits is not spent again."""
        view = object.__new__(StepBuffers)
        view.inputs, view.offsets = self.inputs, self.offsets
        for name in self.PER_TOKEN:
            setattr(view, name, getattr(self, name)[:T])
        for name in self.PER_REQUEST:
            setattr(view, name, getattr(self, name)[:B])
        view.query_start_loc = self.query_start_loc[:B + 1]
        return view

    def load(self, b, ops: DeviceOps) -> None:
        """Copy a Batch (or a plan.PaddedDecode) into the leading rows: the int32 inputs in one
        copy of the whole block (rows past this view's get slot -1 and seq_len 0: they write and
        read nothing), the block table into its top-left [B, width] corner (the columns past
        width are never read)."""
        host = np.zeros(len(self.inputs), np.int32)
        o = self.offsets
        host[o["slot_mapping"]:o["query_start_loc"]] = -1
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
            values = getattr(b, name)
            host[o[name]:o[name] + len(values)] = values
        host[o["logits_indices"]:o["logits_indices"] + len(b.seq_lens)] = b.query_start_loc[1:] - 1
        ops.copy_in(self.inputs, host)
        tables = np.ascontiguousarray(b.block_tables, np.int32)
        if tables.size:
            ops.copy_in_corner(self.block_tables, tables)


@dataclass
class AttentionLaunch:
    """How one forward's paged attention is launched (gpu/cuda/plan.attention_splits)."""
    splits: int
    max_seq_len: int      # bounds every request's length (max_model_len in a graph)
    workspace: tuple      # split-K partials (PagedAttention.workspace), (None, None) for 1 split


class DeviceOps(Protocol):
    """The primitives llama_forward runs on, all enqueued in order on one stream."""

    def copy_in(self, dst, src: np.ndarray) -> None:
        """dst[:len(src)] = src (host int32 to the device)."""

    def copy_in_corner(self, dst, src: np.ndarray) -> None:
        """dst[:rows, :cols] = src, src [rows, cols] on the host."""

    def embedding(self, ids, table, out) -> None: ...
    def matmul(self, x, weight, out) -> None:
        """out = x @ weight.T (fp16 in and out, float32 accumulation)."""

    def add_bias(self, x, bias) -> None: ...
    def add_rms_norm(self, h, delta, weight, out, eps: float) -> None:
        """h += delta (None: nothing to add); out = RMSNorm(h) * weight."""

    def rope(self, qkv, positions, cos, sin, num_rot_heads: int, head_dim: int) -> None: ...
    def store_kv(self, qkv, slot_mapping, k_cache, v_cache, num_heads: int) -> None: ...
    def attention(self, buf: StepBuffers, k_cache, v_cache, launch: AttentionLaunch) -> None:
        """buf.attn = paged attention of buf.qkv's q heads over the cache."""

    def silu_mul(self, gate_up, out) -> None: ...
    def gather_rows(self, x, indices, out) -> None: ...
    def to_float32(self, src, out) -> None: ...


def llama_forward(ops: DeviceOps, c: ModelConfig, w: LlamaWeights, buf: StepBuffers, caches,
                  attention: AttentionLaunch, cos, sin) -> None:
    """The forward over buffers already loaded with the step's arrays: K/V written into caches
    at buf.slot_mapping, float32 logits of each request's last token in buf.logits."""
    ops.embedding(buf.input_ids, w.embed, buf.h)
    ops.add_rms_norm(buf.h, None, w.layers[0].input_norm, buf.x, c.rms_norm_eps)
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(w.layers, caches)):
        ops.matmul(buf.x, layer.qkv, buf.qkv)
        if layer.qkv_bias is not None:
            ops.add_bias(buf.qkv, layer.qkv_bias)
        ops.rope(buf.qkv, buf.positions, cos, sin, c.num_attention_heads + c.num_key_value_heads,
                 c.head_dim)
        ops.store_kv(buf.qkv, buf.slot_mapping, k_cache, v_cache, c.num_attention_heads)
        ops.attention(buf, k_cache, v_cache, attention)
        ops.matmul(buf.attn, layer.o, buf.delta)
        ops.add_rms_norm(buf.h, buf.delta, layer.post_norm, buf.x, c.rms_norm_eps)
        ops.matmul(buf.x, layer.gate_up, buf.gate_up)
        ops.silu_mul(buf.gate_up, buf.act)
        ops.matmul(buf.act, layer.down, buf.delta)
        # the next layer's input norm, or the final norm: buf.x is then the final hidden state
        norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
        ops.add_rms_norm(buf.h, buf.delta, norm, buf.x, c.rms_norm_eps)
    ops.gather_rows(buf.x, buf.logits_indices, buf.last)
    ops.matmul(buf.last, w.lm_head, buf.logits16)
    ops.to_float32(buf.logits16, buf.logits)
