"""The Llama forward on the CPU, in numpy, over the batch contract of gpu/batch.py.

One step is one padding-free super-sequence of T tokens from B requests. The projections
and the MLP run as matmuls over all T tokens at once. Attention (gpu/cpu_attention.py) runs
after this step's K/V have been written into the paged cache at ``slot_mapping`` and reads
keys and values only through each request's block table — so a request sees its own past
(from earlier steps or earlier in this chunk) and nothing of anyone else's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringserve.gpu.batch import Batch
from ringserve.gpu.config import ModelConfig
from ringserve.gpu.cpu_attention import paged_attention
from ringserve.gpu.rope import apply_rope, cos_sin, inv_freq
from ringserve.gpu.weights import check_weights


@dataclass
class KVCache:
    """One layer's paged cache; a slot s is row s of the [num_blocks * block_size, ...] view."""
    k: np.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: np.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim]

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, config: ModelConfig,
                 dtype: np.dtype) -> KVCache:
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        return cls(np.zeros(shape, dtype), np.zeros(shape, dtype))


@dataclass
class LayerWeights:
    input_norm: np.ndarray        # [hidden]
    qkv: np.ndarray               # [q_size + 2 * kv_size, hidden]  q, k, v fused
    qkv_bias: np.ndarray | None   # [q_size + 2 * kv_size] (Qwen2)
    o: np.ndarray                 # [hidden, q_size]
    post_norm: np.ndarray         # [hidden]
    gate_up: np.ndarray           # [2 * intermediate, hidden]  gate, up fused
    down: np.ndarray              # [hidden, intermediate]


class CpuLlama:
    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype=np.float32):
        check_weights(weights, config)
        self.config = config
        self.dtype = np.dtype(dtype)

        def w(name: str) -> np.ndarray:
            return np.ascontiguousarray(weights[name], dtype=self.dtype)

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.final_norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=np.concatenate([w(a + "q_proj.weight"), w(a + "k_proj.weight"),
                                    w(a + "v_proj.weight")]),
                qkv_bias=np.concatenate([w(a + "q_proj.bias"), w(a + "k_proj.bias"),
                                         w(a + "v_proj.bias")]) if config.attention_bias else None,
                o=w(a + "o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=np.concatenate([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=w(p + "mlp.down_proj.weight"),
            ))
        self.inv_freq = inv_freq(config)
        self.scale = self.dtype.type(config.head_dim ** -0.5)

    def forward(self, batch: Batch, kv_caches: list[KVCache]) -> np.ndarray:
        """float32 logits [B, vocab] at each request's last scheduled token."""
        c = self.config
        T, H, KVH, D = batch.num_tokens, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_end, k_end = c.q_size, c.q_size + c.kv_size
        cos, sin = cos_sin(batch.positions, self.inv_freq)
        written = batch.slot_mapping >= 0
        slots = batch.slot_mapping[written]

        attn = np.empty((T, H, D), dtype=self.dtype)
        h = self.embed[batch.input_ids]
        for layer, cache in zip(self.layers, kv_caches):
            qkv = rms_norm(h, layer.input_norm, c.rms_norm_eps) @ layer.qkv.T
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q = apply_rope(qkv[:, :q_end].reshape(T, H, D), cos, sin)
            k = apply_rope(qkv[:, q_end:k_end].reshape(T, KVH, D), cos, sin)
            v = qkv[:, k_end:].reshape(T, KVH, D)
            cache.k.reshape(-1, KVH, D)[slots] = k[written]
            cache.v.reshape(-1, KVH, D)[slots] = v[written]
            paged_attention(q, cache.k, cache.v, batch.positions, batch.query_start_loc,
                            batch.seq_lens, batch.block_tables, self.scale, attn)
            h = h + attn.reshape(T, H * D) @ layer.o.T
            gate_up = rms_norm(h, layer.post_norm, c.rms_norm_eps) @ layer.gate_up.T
            gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
            h = h + (silu(gate) * up) @ layer.down.T
        last = rms_norm(h[batch.logits_indices], self.final_norm, c.rms_norm_eps)
        return (last @ self.lm_head.T).astype(np.float32, copy=False)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return weight * (x * (1 / np.sqrt(variance + x.dtype.type(eps))))


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for very negative x gives the right 0
        return x / (1 + np.exp(-x))
