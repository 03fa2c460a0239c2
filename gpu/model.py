"""The Llama model, written once: the HF -> fused weight mapping and the layer sequence, over a
backend's ops. The CPU backend runs it over gpu/cpu/ops.py CpuOps (numpy + Numba, float32
activations); the CUDA backend over gpu/cuda/runner.py CudaOps (cuBLAS, CUDA C, Numba CUDA;
fp16 or bf16 activations), and CI over tests/test_cuda_forward_host.py HostOps (the same CUDA C
compiled for the host). Nothing here imports numpy's or CuPy's arrays: a weight, a buffer or a
cache is whatever its backend made it.

What a backend decides, through its objects, and the sequence never sees:
- WeightStore: how a (fused) weight is kept: float32 or bfloat16 bits on the CPU, fp16 or bf16 bits on CUDA;
  a quantized format (packed blocks) is another store plus an ops.linear that reads it.
- step buffers (`buf`): every activation of one step, in the backend's dtypes (the residual
  stream h is float32 on both).
- which ops it fuses: rope_store_kv is one Numba pass on the CPU (rotated q to its own buffer,
  k/v straight into the cache), one fused.cu kernel on CUDA (q rotated in place, k/v into the
  cache); which kernel and geometry each CUDA op launches is gpu/cuda/step_plan.py's (what
  tools/step_census.py lists).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol, Sequence

from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.weights import check_weights


class WeightStore(Protocol):
    """Turns HF tensors (numpy or the backend's arrays) into the arrays the ops read."""

    def linear(self, arrays: Sequence[Any]) -> Any:
        """A [out, in] weight for ops.linear (and ops.embedding): arrays stacked along rows."""

    def vector(self, arrays: Sequence[Any]) -> Any:
        """A norm weight or bias: arrays concatenated."""


@dataclass
class Layer:
    input_norm: Any
    qkv: Any             # [q + 2 kv, hidden]: q_proj, k_proj, v_proj stacked (one linear)
    qkv_bias: Any | None  # [q + 2 kv] (Qwen2)
    qk_norm: Any | None   # [2 head_dim]: q_norm then k_norm, each over every head (Qwen3)
    o: Any               # [hidden, q]
    post_norm: Any
    gate_up: Any         # [2 I, hidden]: gate_proj then up_proj (one linear, silu_mul splits it)
    down: Any            # [hidden, I]
    sliding_window: int = 0  # attention window (ModelOps.attention), 0: full attention


@dataclass
class LlamaWeights:
    embed: Any           # [vocab, hidden], a linear weight: it is also the tied lm_head
    lm_head: Any
    final_norm: Any
    layers: list[Layer]

    @classmethod
    def fuse(cls, c: ModelConfig, w: dict, store: WeightStore) -> LlamaWeights:
        """From HF tensor names (checked first: gpu/loader/weights.py check_weights)."""
        check_weights(w, c)

        def linear(*names: str) -> Any:
            return store.linear([w[n] for n in names])

        def vector(*names: str) -> Any:
            return store.vector([w[n] for n in names])

        embed = linear("model.embed_tokens.weight")
        layers = []
        for i, window in enumerate(c.layer_windows):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            # Phi-3 stores both fused in our layouts: one tensor each, taken as it is
            qkv = (a + "qkv_proj.weight",) if c.fused_projections else (
                a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
            gate_up = (p + "mlp.gate_up_proj.weight",) if c.fused_projections else (
                p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            layers.append(Layer(
                input_norm=vector(p + "input_layernorm.weight"),
                qkv=linear(*qkv),
                qkv_bias=vector(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                if c.attention_bias else None,
                qk_norm=vector(a + "q_norm.weight", a + "k_norm.weight") if c.qk_norm else None,
                o=linear(a + "o_proj.weight"),
                post_norm=vector(p + "post_attention_layernorm.weight"),
                gate_up=linear(*gate_up),
                down=linear(p + "mlp.down_proj.weight"),
                sliding_window=window))
        return cls(embed, embed if c.tie_word_embeddings else linear("lm_head.weight"),
                   vector("model.norm.weight"), layers)

    def nbytes_by_type(self) -> dict[str, int]:
        """What the weights take in memory, by storage type: a GGUF type name ("Q4_K") for a
        packed weight, F32 / F16 / BF16 (bits in uint16) for an array; a tied lm_head once."""
        unique = {id(w): w for w in (self.embed, self.lm_head, self.final_norm,
                                     *(getattr(layer, f.name) for layer in self.layers
                                       for f in fields(Layer) if f.name != "sliding_window"))
                  if w is not None}
        out: dict[str, int] = {}
        for w in unique.values():
            for kind, nbytes in storage(w):
                out[kind] = out.get(kind, 0) + nbytes
        return out


_ARRAY_TYPES = {"float32": "F32", "float16": "F16", "uint16": "BF16"}


def storage(w: Any) -> list[tuple[str, int]]:
    """(storage type, bytes) of one weight: a packed weight says its own (`parts`: a fused
    weight of several types; `qtype` and `nbytes`: one type); an array, its dtype."""
    parts = getattr(w, "parts", None)
    if parts is not None:
        return [s for part in parts for s in storage(part)]
    qtype = getattr(w, "qtype", None)
    if qtype is not None:
        return [(qtype, int(w.nbytes))]
    return [(_ARRAY_TYPES.get(str(w.dtype), str(w.dtype)), int(w.nbytes))]


class ModelOps(Protocol):
    """The primitives the sequence runs on (on CUDA all enqueued in order on one stream).
    Shapes: T tokens of the step; buf.qkv [T, q + 2 kv], buf.attn [T, q], the rest [T, n]."""

    def embedding(self, ids, table, out) -> None:
        """out = table[ids] in out's dtype (table as WeightStore.linear made it)."""

    def linear(self, x, weight, out) -> None:
        """out = x @ weight.T (weight as WeightStore.linear made it; float32 accumulation)."""

    def add_bias(self, x, bias) -> None: ...

    def add_rms_norm(self, h, delta, weight, out) -> None:
        """h += delta (None: nothing to add); out = RMSNorm(h) * weight (the ops hold the
        config's rms_norm_eps, as they hold the attention scale)."""

    def rms_norm(self, x, weight) -> None:
        """In place in x [T, n] (an activation buffer, such as buf.delta): x = RMSNorm(x) *
        weight (Gemma 3's norms of a layer's outputs before the residual add)."""

    def scale_embedding(self, h, factor: float) -> None:
        """h *= factor in float32 (Gemma 3's sqrt(hidden) on the embedded rows)."""

    def qk_norm(self, qkv, weight) -> None:
        """In place in qkv [T, q + 2 kv]: each q head = RMSNorm(head) * weight[:head_dim], each
        k head the same with weight[head_dim:] (the config's rms_norm_eps); v untouched."""

    def rope_store_kv(self, buf, cos, sin, k_cache, v_cache) -> None:
        """Rotate q and k of buf.qkv by buf.positions (cos, sin: [positions, rotary_dim / 2]
        tables: the first 2 * cos.shape[1] dims of each head rotate, the rest pass through) and
        write k and v into the caches at buf.slot_mapping (-1: no write). Where the rotated q
        goes is the backend's, for its attention to read."""

    def attention(self, buf, k_cache, v_cache, launch, window: int) -> None:
        """buf.attn = paged attention of the rotated q over the caches (launch: the backend's
        per-step plan, CUDA's AttentionLaunch; None on the CPU). window 0: a query at position
        p reads keys 0..p; else only keys k with p - window < k <= p (transformers' sliding
        mask), and the kernels read no block wholly before that (engine/kv_cache.py may have
        freed it). The window is a launch argument: one CUDA graph serves every layer."""

    def silu_mul(self, gate_up, out) -> None:
        """out = silu(gate) * up, gate_up [T, 2 I] -> out [T, I]."""

    def gelu_tanh_mul(self, gate_up, out) -> None:
        """out = gelu_tanh(gate) * up (transformers' gelu_pytorch_tanh), as silu_mul."""

    def gather_rows(self, x, rows, out) -> None:
        """out = x[rows]."""

    def to_float32(self, src, out) -> None:
        """out = src as float32 (nothing where src is out)."""


def hidden_states(ops: ModelOps, w: LlamaWeights, buf, caches, attention, cos, sin) -> None:
    """The layers over buf.input_ids: K/V written into caches ((k, v) per layer) at
    buf.slot_mapping, the final-normed hidden state of every token in buf.x."""
    ops.embedding(buf.input_ids, w.embed, buf.h)
    ops.add_rms_norm(buf.h, None, w.layers[0].input_norm, buf.x)
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(w.layers, caches, strict=True)):
        ops.linear(buf.x, layer.qkv, buf.qkv)
        if layer.qkv_bias is not None:
            ops.add_bias(buf.qkv, layer.qkv_bias)
        if layer.qk_norm is not None:
            ops.qk_norm(buf.qkv, layer.qk_norm)
        ops.rope_store_kv(buf, cos, sin, k_cache, v_cache)
        ops.attention(buf, k_cache, v_cache, attention, layer.sliding_window)
        ops.linear(buf.attn, layer.o, buf.delta)
        ops.add_rms_norm(buf.h, buf.delta, layer.post_norm, buf.x)
        ops.linear(buf.x, layer.gate_up, buf.gate_up)
        ops.silu_mul(buf.gate_up, buf.act)
        ops.linear(buf.act, layer.down, buf.delta)
        # the next layer's input norm, or the final norm: buf.x is then the final hidden state
        norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
        ops.add_rms_norm(buf.h, buf.delta, norm, buf.x)


def compute_logits(ops: ModelOps, w: LlamaWeights, x, rows, last, raw, out) -> None:
    """out = float32 logits of final hidden states x at rows. last [rows, hidden] and raw
    [rows, vocab] are scratch in the activation dtype (raw may be out: float32 activations).
    PERF: only the rows that need logits go through the lm_head, the largest linear."""
    ops.gather_rows(x, rows, last)
    ops.linear(last, w.lm_head, raw)
    ops.to_float32(raw, out)
