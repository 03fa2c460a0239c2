"""numpy references for every CUDA kernel, in float32, on the same layouts the kernels use.

The kernels are checked against these (in the CUDA simulator and on a device); these are
checked on their own against the CPU backend and plain definitions (tests/test_cuda_reference.py).

Layouts: qkv [T, (H + 2 KVH) * D] (q heads, then k heads, then v heads, per token); KV cache per
layer [num_blocks, block_size, KVH, D]; slot s is row s % block_size of block s // block_size.
"""
from __future__ import annotations

import numpy as np


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[T, hidden] rows of table at ids (a bf16 table, uint16 bits: widened to float32)."""
    rows = table[ids]
    return (rows.astype(np.uint32) << np.uint32(16)).view(np.float32) if rows.dtype == np.uint16 else rows


def add_rms_norm(h: np.ndarray, delta: np.ndarray | None, weight: np.ndarray,
                 eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(h + delta, RMSNorm(h + delta) * weight), both float32; delta None is a plain RMSNorm."""
    h = h.astype(np.float32) + (0 if delta is None else delta.astype(np.float32))
    r = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + np.float32(eps))
    return h, (h * r * weight.astype(np.float32)).astype(np.float32)


def rope(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
         num_heads: int, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """qkv with its q and k heads rotated (HF rotate_half: two halves of a head's first
    2 * cos.shape[1] dims, the rest passed through) by each token's position; cos/sin tables
    [max_pos, rotary_dim / 2]. v is unchanged."""
    out = qkv.astype(np.float32).copy()
    T, half = qkv.shape[0], cos.shape[1]
    heads = out[:, :(num_heads + num_kv_heads) * head_dim].reshape(T, -1, head_dim)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    x1, x2 = heads[..., :half].copy(), heads[..., half:2 * half].copy()
    heads[..., :half] = x1 * c - x2 * s
    heads[..., half:2 * half] = x2 * c + x1 * s
    return out


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    g, u = np.split(gate_up.astype(np.float32), 2, axis=-1)
    return g / (1.0 + np.exp(-g)) * u


def gelu_tanh_mul(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [T, 2I] (gate, then up) -> gelu_tanh(gate) * up [T, I] (transformers'
    gelu_pytorch_tanh)."""
    g, u = np.split(gate_up.astype(np.float32), 2, axis=-1)
    return 0.5 * g * (1.0 + np.tanh(np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g ** 3))) * u


def store_kv(qkv: np.ndarray, slot_mapping: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
             num_heads: int) -> None:
    """Write each token's k and v heads (from qkv) into the caches at its slot; -1 is skipped."""
    _, block_size, kvh, d = k_cache.shape
    k0, v0 = num_heads * d, (num_heads + kvh) * d
    for t, slot in enumerate(slot_mapping):
        if slot < 0:
            continue
        b, r = divmod(int(slot), block_size)
        k_cache[b, r] = qkv[t, k0:v0].reshape(kvh, d)
        v_cache[b, r] = qkv[t, v0:v0 + kvh * d].reshape(kvh, d)


def paged_attention(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    positions: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                    block_tables: np.ndarray, num_heads: int, scale: float, window: int = 0) -> np.ndarray:
    """[T, H * D] float32: token t of request r at position p attends to r's keys 0..p (also
    capped at seq_lens[r]; window > 0: only keys p - window < k <= p), read through r's block
    table. A request with no keys gets zeros."""
    _, block_size, kvh, d = k_cache.shape
    group = num_heads // kvh
    out = np.zeros((qkv.shape[0], num_heads, d), np.float32)
    for r in range(len(seq_lens)):
        for t in range(query_start_loc[r], query_start_loc[r + 1]):
            n = min(int(positions[t]) + 1, int(seq_lens[r]))
            first = max(0, int(positions[t]) + 1 - window) if window > 0 else 0
            if n <= first:
                continue
            j = np.arange(first, n)
            blocks = block_tables[r, j // block_size]
            k = k_cache[blocks, j % block_size].astype(np.float32)  # [n, KVH, D]
            v = v_cache[blocks, j % block_size].astype(np.float32)
            q = qkv[t, :num_heads * d].astype(np.float32).reshape(kvh, group, d)
            s = np.einsum("hgd,nhd->hgn", q, k) * np.float32(scale)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[t] = np.einsum("hgn,nhd->hgd", p, v).reshape(num_heads, d)
    return out.reshape(qkv.shape[0], num_heads * d)


def gather_rows(x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """x[indices]: the hidden rows at each request's last position, before the LM head."""
    return x[indices]


def argmax_rows(logits: np.ndarray) -> np.ndarray:
    """int32 [B]: the first index of each row's maximum (greedy sampling)."""
    return np.argmax(logits, axis=-1).astype(np.int32)


def sampling_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                   min_p: float) -> np.ndarray:
    """float64 [V]: the distribution sampling_kernels.sample_kernel draws one row's token from
    (gpu/sampling/sampler.sample_row's, with every token tied with a top_k/top_p cutoff kept)."""
    x = logits.astype(np.float64)
    p = np.exp((x - x.max()) / temperature)
    keep = np.ones(len(x), bool)
    if 0 < top_k < len(x):
        keep &= x >= np.sort(x)[-top_k]
    keep &= p >= min_p
    if top_p < 1.0:
        kept = np.sort(p[keep])[::-1]
        m = int(np.searchsorted(np.cumsum(kept), top_p * kept.sum()))  # first prefix reaching top_p
        keep &= p >= kept[min(m, len(kept) - 1)]
    probs = np.where(keep, p, 0.0)
    return probs / probs.sum()


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The token at u in [0, 1) of the CDF over the vocabulary in id order (the kernel's order)."""
    cdf = np.cumsum(probs)
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(np.flatnonzero(probs)[-1]) if j >= len(cdf) else j


def accept_or_resample(probs: np.ndarray, draft: int, q: np.ndarray, u: float, u_residual: float) -> int:
    """The token sampling_kernels.sample_kernel gives a row that verifies a draft model's token
    (gpu/sampling/sampler.accept_or_resample's rule, with its two uniform numbers): the draft
    when u * q(draft) < p(draft), else the residual normalize(max(p - q, 0)) (p where that is
    all 0) at u_residual. probs: sampling_probs' p."""
    if u * q[draft] < probs[draft]:
        return draft
    residual = np.maximum(probs - q, 0.0)
    return inverse_cdf(residual if residual.sum() > 0 else probs, u_residual)
