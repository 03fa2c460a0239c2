"""Rotary position embeddings, HF Llama convention: the angle tables. The rotation itself
(rotate_half over two halves of the rotated part of a head) is fused with the K/V cache write
in gpu/cpu/kernels.py and is fused.cu's rope on CUDA.

A table is (cos, sin), float32 [positions, rotary_dim / 2]: the kernels rotate the first
rotary_dim = 2 * cos.shape[1] dims of each head and leave the rest (Phi-4-mini rotates 96 of 128).
The frequencies are computed in float32 exactly as transformers does, so that our logits
match its logits to float32 rounding.

LongRoPE (Phi-3.5, Phi-4-mini) divides each frequency by a short or a long factor and scales
cos/sin by an attention factor. Which factors: transformers switches on the sequence's length
(longer than original_max_position_embeddings: long, for every position, recomputed as it
grows), vLLM per batch (any position past it: long for the whole batch). Both make a token's
rotation depend on something other than its position, and a paged, prefix-cached K/V cache
stores keys already rotated: a block computed under short factors would be read beside keys
under long ones, or reused by a request that needs the other set. So, as llama.cpp (per context
size) and ExLlamaV2 (per max_seq_len): one set for the server, chosen by max_model_len, the
longest sequence it admits: long when max_model_len > original_max_position_embeddings. That is
transformers' answer for every sequence when max_model_len stays under the original context, and
for every sequence longer than it otherwise (docs/design.md §6).
"""
from __future__ import annotations

import math

import numpy as np

from ringserve.gpu.loader.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig


def inv_freq(config: ModelConfig, max_model_len: int | None = None) -> np.ndarray:
    """float32 [rotary_dim // 2]: the angle per position of each rotary pair. max_model_len (None:
    max_position_embeddings) picks LongRoPE's factors."""
    d = config.rotary_dim
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    s = config.rope_scaling
    if s is not None and s.rope_type == "longrope":
        long = (max_model_len or config.max_position_embeddings) > s.original_max_position_embeddings
        ext = np.array(s.long_factor if long else s.short_factor, dtype=np.float32)
        # NOTE: as transformers: 1 / (factor * base ** e), one float32 rounding of the product
        return (np.float32(1.0) / (ext * (np.float32(config.rope_theta) ** exponent))).astype(np.float32)
    freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponent)).astype(np.float32)
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


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (LongRoPE's attention factor; 1 otherwise)."""
    s = config.rope_scaling
    return s.attention_factor if s is not None and s.rope_type == "longrope" else 1.0


def rope_tables(config: ModelConfig, num_positions: int,
                max_model_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The model's (cos, sin) for positions 0..num_positions-1: what the runners index by position."""
    return cos_sin(np.arange(num_positions), inv_freq(config, max_model_len), attention_factor(config))


def inv_freqs(config: ModelConfig, max_model_len: int | None = None) -> dict[str, np.ndarray]:
    """inv_freq by layer type (ModelConfig.layer_type): a Llama one (FULL_ATTENTION), Gemma 3
    two (its sliding layers on local_rope_theta, unscaled)."""
    freqs = {FULL_ATTENTION: inv_freq(config, max_model_len)}
    if config.local_rope_theta is not None:  # else sliding layers (Mistral's) rotate as full ones
        d = config.rotary_dim
        exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
        freqs[SLIDING_ATTENTION] = (np.float32(1.0) / (np.float32(config.local_rope_theta) ** exponent)
                                    ).astype(np.float32)
    return freqs


def rope_tables_by_type(config: ModelConfig, num_positions: int,
                        max_model_len: int | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """rope_tables by layer type (inv_freqs): what the runners index by layer, then position."""
    return {kind: cos_sin(np.arange(num_positions), freq, attention_factor(config) if kind == FULL_ATTENTION
                          else 1.0)
            for kind, freq in inv_freqs(config, max_model_len).items()}


def cos_sin(positions: np.ndarray, freq: np.ndarray, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin times scale, float32 [T, len(freq)], for each token's position (with positions
    0..n-1: the table the forward computes once and indexes by position)."""
    angles = positions.astype(np.float32)[:, None] * freq[None, :]
    if scale == 1.0:
        return np.cos(angles), np.sin(angles)
    # NOTE: transformers scales the float32 cos by a Python float: one float32 product
    return ((np.cos(angles) * np.float32(scale)).astype(np.float32),
            (np.sin(angles) * np.float32(scale)).astype(np.float32))
