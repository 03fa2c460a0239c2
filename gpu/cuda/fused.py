"""Launchers for fused.cu (CuPy RawKernels): residual-add + RMSNorm, q/k norm, RoPE, SiLU·mul, bias add,
widening to float32; Gemma 3's in-place RMSNorm and GELU-tanh·mul. Activations fp16 or bf16 (uint16
bits): each call takes the kernel of the arrays' element type (fused.cu's plain and _bf16
instantiations); float32 residual stream and math (reference: gpu/cuda/reference.py)."""
from __future__ import annotations

import cupy as cp
import numpy as np

from ringserve.gpu.cuda import launch, toolchain

_NULL = np.uint64(0)  # a null pointer argument: plain RMSNorm, no residual add


class FusedKernels:
    def __init__(self):
        self.module = cp.RawModule(code=toolchain.source("fused.cu"), options=toolchain.options(),
                                   backend="nvrtc")
        self._kernels = {(name, dtype): self.module.get_function(name + suffix)
                         for name in launch.FUSED_KERNELS for dtype, suffix in launch.SUFFIXES.items()}

    def _kernel(self, name: str, x):
        return self._kernels[name, str(x.dtype)]

    def add_rms_norm(self, h, delta, weight, out, eps: float, stream) -> None:
        """h [T, n] float32 += delta [T, n] (None: no add); out = RMSNorm(h) * weight."""
        T, n = h.shape
        self._kernel("add_rms_norm", out)(*launch.norm_launch(T, n), (
            h, _NULL if delta is None else delta, weight, out, np.int32(n), np.float32(eps)), stream=stream)

    def qk_norm(self, qkv, weight, num_q_heads: int, num_qk_heads: int, head_dim: int, eps: float,
                stream) -> None:
        """Each q and k head of qkv [T, q + 2 kv] RMSNormed in place (weight [2 head_dim])."""
        T = qkv.shape[0]
        self._kernel("qk_norm", qkv)(*launch.qk_norm_launch(T, num_qk_heads), (
            qkv, weight, np.int32(num_q_heads), np.int32(head_dim), np.int32(qkv.shape[1]), np.float32(eps)),
            stream=stream)

    def rope(self, qkv, positions, cos, sin, num_rot_heads: int, head_dim: int, stream) -> None:
        """q and k heads of qkv rotated in place: their first 2 * cos.shape[1] dims (the table's
        rotary_dim, gpu/rope.py), the rest of each head untouched."""
        T, rot_half = qkv.shape[0], cos.shape[1]
        self._kernel("rope", qkv)(*launch.rope_launch(T, num_rot_heads, 2 * rot_half),
                                  (qkv, positions, cos, sin, np.int32(num_rot_heads), np.int32(head_dim),
                                   np.int32(rot_half), np.int32(qkv.shape[1])), stream=stream)

    def silu_mul(self, gate_up, out, stream) -> None:
        T, inter = out.shape
        self._kernel("silu_mul", out)(*launch.silu_launch(T, inter),
                                      (gate_up, out, np.int32(T), np.int32(inter // 2)), stream=stream)

    def gelu_tanh_mul(self, gate_up, out, stream) -> None:
        T, inter = out.shape
        self._kernel("gelu_tanh_mul", out)(*launch.silu_launch(T, inter),
                                           (gate_up, out, np.int32(T), np.int32(inter // 2)), stream=stream)

    def rms_norm(self, x, weight, eps: float, stream) -> None:
        """x [T, n] = RMSNorm(x) * weight, in place in the activations' dtype."""
        T, n = x.shape
        self._kernel("rms_norm", x)(*launch.norm_launch(T, n), (x, weight, np.int32(n), np.float32(eps)),
                                    stream=stream)

    def add_bias(self, x, bias, stream) -> None:
        """x [T, n] += bias [n] (contiguous rows)."""
        T, n = x.shape
        self._kernel("add_bias", x)(*launch.elementwise_launch(T * n), (x, bias, np.int32(T), np.int32(n)),
                                    stream=stream)

    def to_float32(self, src, out, stream) -> None:
        """out [rows, cols] float32 = src, exactly (contiguous)."""
        rows, cols = src.shape
        self._kernel("to_float32", src)(*launch.elementwise_launch(rows * cols),
                                        (src, out, np.int32(rows), np.int32(cols)), stream=stream)
