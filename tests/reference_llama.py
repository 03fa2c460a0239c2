"""A dense Llama forward over one token sequence, written plainly from the HF Llama
definition (modeling_llama.py) and independent of ringserve.gpu: no paging, no packing,
no fused weights, float64 by default. The tests' yardstick for the CPU forward."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def reference_logits(model_dir: str | Path, weights: dict[str, np.ndarray], token_ids: list[int],
                     dtype=np.float64) -> np.ndarray:
    """Logits [len(token_ids), vocab] at every position of one sequence starting at position 0."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    W = {name: t.astype(dtype) for name, t in weights.items()}
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    eps = cfg["rms_norm_eps"]
    T = len(token_ids)

    def rms_norm(x, weight):
        return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    def rotate_half(x):
        half = x.shape[-1] // 2
        return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)

    inv_freq = 1.0 / (cfg["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim))
    freqs = np.arange(T)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)             # [T, head_dim]
    cos, sin = np.cos(emb)[None], np.sin(emb)[None]           # [1, T, head_dim]
    causal = np.triu(np.ones((T, T), dtype=bool), k=1)        # True above the diagonal: masked

    x = W["model.embed_tokens.weight"][np.asarray(token_ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, n_heads, head_dim).transpose(1, 0, 2)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, n_kv, head_dim).transpose(1, 0, 2)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, n_kv, head_dim).transpose(1, 0, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, n_heads // n_kv, axis=0)             # repeat_kv
        v = np.repeat(v, n_heads // n_kv, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(head_dim)
        scores = np.where(causal[None], -np.inf, scores)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = probs / probs.sum(axis=-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(T, n_heads * head_dim)
        x = x + attn @ W[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, W[p + "post_attention_layernorm.weight"])
        gate = h @ W[p + "mlp.gate_proj.weight"].T
        up = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ W[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, W["model.norm.weight"])
    lm_head = W["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else W["lm_head.weight"]
    return x @ lm_head.T
