"""Gemma 3 (text: Gemma3ForCausalLM), written once over gpu/models/ops.py's ModelOps: the HF ->
fused weight mapping and the layer sequence, for every backend (CPU, CUDA, the host shim).

What differs from the Llama sequence (transformers' modeling_gemma3.py):
- the embedding is scaled by sqrt(hidden) (float32, as transformers' buffer); the tied lm_head
  reads the same table unscaled;
- every RMSNorm multiplies by (1 + w): folded into the stored weight at load;
- four norms a layer: input, post_attention (on the attention output, before the residual add),
  pre_feedforward, post_feedforward (on the MLP output, before the add); q/k norms per head;
- the MLP is GELU-tanh gated;
- attention is scaled by query_pre_attn_scalar ** -0.5; sliding layers (ModelConfig.layer_types)
  see the last sliding_window positions and rotate by their own RoPE table (local_rope_theta,
  unscaled), full layers by rope_theta with rope_scaling (the runners' tables by layer type).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.weights import check_weights
from ringserve.gpu.models.ops import ModelOps, WeightStore, gated_mlp, storage


@dataclass
class Gemma3Layer:
    input_norm: Any
    qkv: Any              # [q + 2 kv, hidden]: q_proj, k_proj, v_proj stacked
    qk_norm: Any          # [2 head_dim]: q_norm then k_norm
    o: Any                # [hidden, q]
    post_attention_norm: Any
    pre_feedforward_norm: Any
    gate_up: Any          # [2 I, hidden]: gate_proj then up_proj
    down: Any             # [hidden, I]
    post_feedforward_norm: Any
    layer_type: str       # which RoPE table (FULL_ATTENTION, SLIDING_ATTENTION)
    sliding_window: int   # keys p - window < k <= p (0: every key up to p)


@dataclass
class Gemma3Weights:
    embed: Any            # [vocab, hidden], unscaled: it is also the tied lm_head
    lm_head: Any
    final_norm: Any
    layers: list[Gemma3Layer]
    embed_scale: float    # sqrt(hidden), applied to the embedded rows

    @classmethod
    def fuse(cls, c: ModelConfig, w: dict, store: WeightStore) -> Gemma3Weights:
        """From HF tensor names (checked first: gpu/loader/weights.py check_weights)."""
        check_weights(w, c)

        def linear(*names: str) -> Any:
            return store.linear([w[n] for n in names])

        def norm(*names: str) -> Any:
            # Gemma3RMSNorm: x * (1 + w), the sum in float32 as transformers computes it
            return store.vector([w[n].astype("float32") + 1 for n in names])

        embed = linear("model.embed_tokens.weight")
        layers = []
        for i, window in enumerate(c.layer_windows):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            layers.append(Gemma3Layer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                qk_norm=norm(a + "q_norm.weight", a + "k_norm.weight"),
                o=linear(a + "o_proj.weight"),
                post_attention_norm=norm(p + "post_attention_layernorm.weight"),
                pre_feedforward_norm=norm(p + "pre_feedforward_layernorm.weight"),
                gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=linear(p + "mlp.down_proj.weight"),
                post_feedforward_norm=norm(p + "post_feedforward_layernorm.weight"),
                layer_type=c.layer_type(i), sliding_window=window))
        return cls(embed, embed if c.tie_word_embeddings else linear("lm_head.weight"),
                   norm("model.norm.weight"), layers, c.hidden_size ** 0.5)

    def nbytes_by_type(self) -> dict[str, int]:
        """As LlamaWeights.nbytes_by_type: bytes by storage type, a tied lm_head once."""
        arrays = [self.embed, self.lm_head, self.final_norm]
        arrays += [getattr(layer, f.name) for layer in self.layers for f in fields(Gemma3Layer)
                   if f.name not in ("layer_type", "sliding_window")]
        out: dict[str, int] = {}
        for weight in {id(a): a for a in arrays}.values():
            for kind, nbytes in storage(weight):
                out[kind] = out.get(kind, 0) + nbytes
        return out


def gemma3_hidden_states(ops: ModelOps, w: Gemma3Weights, buf, caches, attention,
                         ropes: dict[str, tuple[Any, Any]]) -> None:
    """The layers over buf.input_ids (as model.hidden_states): K/V written into caches, the
    final-normed hidden state of every token (or of buf.output_rows) in buf.x. ropes: (cos,
    sin) by layer type."""
    ops.embedding(buf.input_ids, w.embed, buf.h)
    ops.scale_embedding(buf.h, w.embed_scale)
    ops.add_rms_norm(buf.h, None, w.layers[0].input_norm, buf.x)
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(w.layers, caches, strict=True)):
        ops.linear(buf.x, layer.qkv, buf.qkv)
        ops.qk_norm(buf.qkv, layer.qk_norm)
        cos, sin = ropes[layer.layer_type]
        ops.attention(buf, cos, sin, k_cache, v_cache, attention, layer.sliding_window)
        if buf.output_rows is not None and i + 1 == len(w.layers):
            buf.keep_output_rows()  # PERF: as model.hidden_states
        ops.linear(buf.attn, layer.o, buf.delta)
        ops.rms_norm(buf.delta, layer.post_attention_norm)
        ops.add_rms_norm(buf.h, buf.delta, layer.pre_feedforward_norm, buf.x)
        gated_mlp(ops, buf, layer, ops.gelu_tanh_mul)
        ops.rms_norm(buf.delta, layer.post_feedforward_norm)
        # the next layer's input norm, or the final norm: buf.x is then the final hidden state
        norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
        ops.add_rms_norm(buf.h, buf.delta, norm, buf.x)
