"""The Llama family (Llama, Mistral, Ministral, Qwen2, Qwen3, Phi-3), written once over
gpu/models/ops.py's ModelOps: the HF -> fused weight mapping and the layer sequence, for every
backend (CPU, CUDA, the host shim). Qwen2 adds a q/k/v bias, Qwen3 q/k norms, Phi-3 stores its
projections fused and rotates part of each head (the rope table's width), Mistral and Ministral
slide a window on some or all layers (Layer.sliding_window)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.weights import check_weights
from ringserve.gpu.models.ops import ModelOps, WeightStore, gated_mlp, storage


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


def hidden_states(ops: ModelOps, w: LlamaWeights, buf, caches, attention, cos, sin) -> None:
    """The layers over buf.input_ids: K/V written into caches ((k, v) per layer) at
    buf.slot_mapping, the final-normed hidden state of every token in buf.x (of each of
    buf.output_rows, in order, where the backend set them: the last layer's o projection and MLP
    run for those rows only)."""
    ops.embedding(buf.input_ids, w.embed, buf.h)
    ops.add_rms_norm(buf.h, None, w.layers[0].input_norm, buf.x)
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(w.layers, caches, strict=True)):
        ops.linear(buf.x, layer.qkv, buf.qkv)
        if layer.qkv_bias is not None:
            ops.add_bias(buf.qkv, layer.qkv_bias)
        if layer.qk_norm is not None:
            ops.qk_norm(buf.qkv, layer.qk_norm)
        ops.attention(buf, cos, sin, k_cache, v_cache, attention, layer.sliding_window)
        if buf.output_rows is not None and i + 1 == len(w.layers):
            buf.keep_output_rows()  # PERF: the rest of the last layer for the rows that need logits
        ops.linear(buf.attn, layer.o, buf.delta)
        ops.add_rms_norm(buf.h, buf.delta, layer.post_norm, buf.x)
        gated_mlp(ops, buf, layer, ops.silu_mul)
        # the next layer's input norm, or the final norm: buf.x is then the final hidden state
        norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
        ops.add_rms_norm(buf.h, buf.delta, norm, buf.x)
