"""Launchers for fused.cu (CuPy RawKernels): residual-add + RMSNorm, RoPE, SiLU·mul.
fp16 activations, float32 residual stream and math (reference: gpu/cuda/reference.py)."""
from __future__ import annotations

import cupy as cp
import numpy as np

from ringserve.gpu.cuda import launch, toolchain

_NULL = np.uint64(0)  # a null pointer argument: plain RMSNorm, no residual add


class FusedKernels:
    def __init__(self):
        self.module = cp.RawModule(code=toolchain.source("fused.cu"), options=toolchain.options(),
                                   backend="nvrtc")
        self._norm = self.module.get_function("add_rms_norm")
        self._rope = self.module.get_function("rope")
        self._silu = self.module.get_function("silu_mul")

    def add_rms_norm(self, h, delta, weight, out, eps: float, stream) -> None:
        """h [T, n] float32 += delta [T, n] fp16 (None: no add); out fp16 = RMSNorm(h) * weight."""
        T, n = h.shape
        self._norm(*launch.norm_launch(T, n), (h, _NULL if delta is None else delta, weight, out,
                                               np.int32(n), np.float32(eps)), stream=stream)

    def rope(self, qkv, positions, cos, sin, num_rot_heads: int, head_dim: int, stream) -> None:
        T = qkv.shape[0]
        self._rope(*launch.rope_launch(T, num_rot_heads, head_dim),
                   (qkv, positions, cos, sin, np.int32(num_rot_heads), np.int32(head_dim),
                    np.int32(qkv.shape[1])), stream=stream)

    def silu_mul(self, gate_up, out, stream) -> None:
        T, inter = out.shape
        self._silu(*launch.silu_launch(T, inter), (gate_up, out, np.int32(T), np.int32(inter // 2)),
                   stream=stream)
