"""Rotary position embeddings, HF Llama convention (rotate_half over two halves of a head).

The frequencies are computed in float32 exactly as transformers does, so that our logits
match its logits to float32 rounding.
"""
from __future__ import annotations

import math

import numpy as np

from ringserve.gpu.config import ModelConfig


def inv_freq(config: ModelConfig) -> np.ndarray:
    """float32 [head_dim // 2]: the angle per position of each rotary pair."""
    d = config.head_dim
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponent)).astype(np.float32)
    s = config.rope_scaling
    if s is None:
        return freq
    if s.rope_type == "linear":
        return (freq / np.float32(s.factor)).astype(np.float32)
    # llama3: slow wavelengths are stretched by `factor`, fast ones kept, the middle blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = np.where(wavelen > low_wavelen, freq / s.factor, freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def cos_sin(positions: np.ndarray, freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, float32 [T, head_dim // 2], for each token's position."""
    angles = positions.astype(np.float32)[:, None] * freq[None, :]
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x [T, heads, head_dim] in place: (x1, x2) -> (x1·cos − x2·sin, x2·cos + x1·sin)."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].copy()
    x2 = x[..., half:]
    c = cos[:, None, :]
    s = sin[:, None, :]
    x[..., :half] = x1 * c - x2 * s
    x[..., half:] = x2 * c + x1 * s
    return x
