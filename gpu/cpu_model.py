"""The Llama forward on the CPU, in numpy and Numba, over the batch contract of gpu/batch.py.

One step is one padding-free super-sequence of T tokens from B requests. The projections
and the MLP run as matmuls over all T tokens at once. Attention (gpu/cpu_attention.py) runs
after this step's K/V have been written into the paged cache at ``slot_mapping`` and reads
keys and values only through each request's block table — so a request sees its own past
(from earlier steps or earlier in this chunk) and nothing of anyone else's.

Where the time goes (docs/bench_forward.md): a decode step streams every weight once, so the
linears (gpu/cpu_linear.py) are bandwidth kernels; norms, RoPE and SiLU are fused Numba passes
(gpu/cpu_kernels.py) over buffers allocated once per step, and the RoPE tables are computed once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from ringserve.gpu.batch import Batch
from ringserve.gpu.config import ModelConfig
from ringserve.gpu.cpu_attention import paged_attention
from ringserve.gpu.cpu_kernels import add_rms_norm, rms_norm, rope_store_kv, silu_mul
from ringserve.gpu.cpu_linear import linear, to_bfloat16, widen_bfloat16
from ringserve.gpu.rope import cos_sin, inv_freq
from ringserve.gpu.weights import check_weights

# How each weight dtype is stored: float32 as is, bfloat16 as its bits in uint16.
WEIGHT_DTYPES = {"float32": lambda w: w, "bfloat16": to_bfloat16}


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
    """weight_dtype "float32" (exact, the default) or "bfloat16" (weights rounded to bf16 and
    stored in half the bytes; activations, K/V and sums stay float32). num_threads > 1 splits
    the decode-size linears over Numba's threads (gpu/cpu_linear.py)."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray],
                 weight_dtype: str = "float32", num_threads: int = 1):
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype {weight_dtype!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
        check_weights(weights, config)
        self.config = config
        self.dtype = np.dtype(np.float32)  # activations and the KV cache
        self.weight_dtype = weight_dtype
        self.num_threads = num_threads
        store = WEIGHT_DTYPES[weight_dtype]

        def f32(name: str) -> np.ndarray:
            return np.ascontiguousarray(weights[name], dtype=np.float32)

        def fused(*names: str) -> np.ndarray:
            return store(np.concatenate([f32(n) for n in names]))

        self.embed = store(f32("model.embed_tokens.weight"))
        self.lm_head = self.embed if config.tie_word_embeddings else store(f32("lm_head.weight"))
        self.final_norm = f32("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(LayerWeights(
                input_norm=f32(p + "input_layernorm.weight"),
                qkv=fused(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                qkv_bias=np.concatenate([f32(a + "q_proj.bias"), f32(a + "k_proj.bias"),
                                         f32(a + "v_proj.bias")]) if config.attention_bias else None,
                o=fused(a + "o_proj.weight"),
                post_norm=f32(p + "post_attention_layernorm.weight"),
                gate_up=fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=fused(p + "mlp.down_proj.weight"),
            ))
        self.inv_freq = inv_freq(config)
        self.scale = np.float32(config.head_dim ** -0.5)
        self.eps = np.float32(config.rms_norm_eps)
        self._cos = self._sin = np.empty((0, config.head_dim // 2), dtype=np.float32)

    def rope_tables(self, max_position: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin for positions 0..max_position at least, computed once (grown by doubling)."""
        if max_position >= len(self._cos):
            n = max(max_position + 1, 2 * len(self._cos), self.config.max_position_embeddings)
            self._cos, self._sin = cos_sin(np.arange(n), self.inv_freq)
        return self._cos, self._sin

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        rows = self.embed[ids]
        return widen_bfloat16(rows) if rows.dtype == np.uint16 else rows

    def forward(self, batch: Batch, kv_caches: list[KVCache],
                logits_indices: np.ndarray | None = None) -> np.ndarray:
        """float32 logits at rows logits_indices of the super-sequence [len, vocab]; by default
        at each request's last scheduled token [B, vocab]."""
        x = self.hidden_states(batch, kv_caches)
        return self.logits(x[batch.logits_indices if logits_indices is None else logits_indices])

    def hidden_states(self, batch: Batch, kv_caches: list[KVCache]) -> np.ndarray:
        """The final-normed hidden state of every token [T, hidden]; writes the step's K/V."""
        c = self.config
        T, I = batch.num_tokens, c.intermediate_size
        if self.num_threads > 1:
            numba.set_num_threads(self.num_threads)  # per calling thread in Numba
        parallel = self.num_threads > 1
        cos, sin = self.rope_tables(int(batch.positions.max()))
        positions, slots = batch.positions, batch.slot_mapping

        h = np.ascontiguousarray(self.embed_rows(batch.input_ids), dtype=np.float32)
        x = np.empty_like(h)                      # the normed input of the next linear
        delta = np.empty_like(h)                  # attention / MLP output, added to h
        qkv = np.empty((T, c.q_size + 2 * c.kv_size), dtype=np.float32)
        q = np.empty((T, c.num_attention_heads, c.head_dim), dtype=np.float32)
        attn = np.empty_like(q)
        gate_up = np.empty((T, 2 * I), dtype=np.float32)
        act = np.empty((T, I), dtype=np.float32)

        rms_norm(h, self.layers[0].input_norm, self.eps, x)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            linear(x, layer.qkv, qkv, parallel=parallel)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            rope_store_kv(qkv, positions, cos, sin, slots, cache.k, cache.v, q)
            paged_attention(q, cache.k, cache.v, positions, batch.query_start_loc,
                            batch.seq_lens, batch.block_tables, self.scale, attn)
            linear(attn.reshape(T, -1), layer.o, delta, parallel=parallel)
            add_rms_norm(h, delta, layer.post_norm, self.eps, x)
            linear(x, layer.gate_up, gate_up, parallel=parallel)
            silu_mul(gate_up, act)
            linear(act, layer.down, delta, parallel=parallel)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            add_rms_norm(h, delta, next_norm, self.eps, x)
        return x

    def logits(self, x_rows: np.ndarray) -> np.ndarray:
        """float32 logits [rows, vocab] of final-normed hidden states: only the rows that need them."""
        if self.num_threads > 1:
            numba.set_num_threads(self.num_threads)
        return linear(np.ascontiguousarray(x_rows), self.lm_head, parallel=self.num_threads > 1)

