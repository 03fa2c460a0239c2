"""Rotary position embeddings, HF Llama convention: the angle tables. The rotation itself
(rotate_half over two halves of a head) is fused with the K/V cache write in gpu/cpu/kernels.py.

The frequencies are computed in float32 exactly as transformers does, so that our logits
match its logits to float32 rounding.
"""
from __future__ import annotations

import math

import numpy as np

from ringserve.gpu.loader.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig


def inv_freqs(config: ModelConfig) -> dict[str, np.ndarray]:
    """inv_freq by layer type (ModelConfig.layer_type): a Llama one table (FULL_ATTENTION),
    Gemma 3 two (its sliding layers on local_rope_theta, unscaled)."""
    freqs = {FULL_ATTENTION: inv_freq(config)}
    if config.local_rope_theta is not None:  # else sliding layers (Mistral's) rotate as full ones
        freqs[SLIDING_ATTENTION] = _plain(config.head_dim, config.local_rope_theta)
    return freqs


def _plain(d: int, theta: float) -> np.ndarray:
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    return (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)


def inv_freq(config: ModelConfig) -> np.ndarray:
    """float32 [head_dim // 2]: the angle per position of each rotary pair (full-attention
    layers: rope_theta, rope_scaling)."""
    freq = _plain(config.head_dim, config.rope_theta)
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
    """cos and sin, float32 [T, head_dim // 2], for each token's position (with positions
    0..n-1: the table the forward computes once and indexes by position)."""
    angles = positions.astype(np.float32)[:, None] * freq[None, :]
    return np.cos(angles), np.sin(angles)
