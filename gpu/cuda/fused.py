"""Launchers for fused.cu (CuPy RawKernels): residual-add + RMSNorm, q/k norm, RoPE + KV-cache
write, SiLU·mul, bias add, widening to float32; Gemma 3's in-place RMSNorm and GELU-tanh·mul.
Activations fp16 or bf16 (uint16 bits): each call takes the kernel of the arrays' element type
(fused.cu's plain and _bf16 instantiations); float32 residual stream and math (reference:
gpu/cuda/reference.py). Kernel and geometry: gpu/cuda/step_plan.py (what the launch census lists)."""
from __future__ import annotations

import cupy as cp
import numpy as np

from ringserve.gpu.cuda import launch, step_plan, toolchain
from ringserve.gpu.cuda.step_plan import Launch

_NULL = np.uint64(0)  # a null pointer argument: plain RMSNorm, no residual add


class FusedKernels:
    def __init__(self):
        self.module = cp.RawModule(code=toolchain.source("fused.cu"), options=toolchain.options(),
                                   backend="nvrtc")
        self._kernels = {name + suffix: self.module.get_function(name + suffix)
                         for name in launch.FUSED_KERNELS for suffix in launch.SUFFIXES.values()}

    def _launch(self, plan: Launch, args: tuple, stream) -> None:
        self._kernels[plan.kernel](plan.grid, plan.block, args, stream=stream)

    def add_rms_norm(self, h, delta, weight, out, eps: float, stream) -> None:
        """h [T, n] float32 += delta [T, n] (None: no add); out = RMSNorm(h) * weight."""
        self._launch(step_plan.add_rms_norm(h, out), (
            h, _NULL if delta is None else delta, weight, out, np.int32(h.shape[1]), np.float32(eps)), stream)

    def qk_norm(self, qkv, weight, num_q_heads: int, num_qk_heads: int, head_dim: int, eps: float,
                stream) -> None:
        """Each q and k head of qkv [T, q + 2 kv] RMSNormed in place (weight [2 head_dim])."""
        self._launch(step_plan.qk_norm(qkv, num_qk_heads), (
            qkv, weight, np.int32(num_q_heads), np.int32(head_dim), np.int32(qkv.shape[1]), np.float32(eps)),
            stream)

    def rope_store_kv(self, qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, num_heads: int,
                      head_dim: int, stream) -> None:
        """q heads of qkv rotated in place, k heads rotated into k_cache and v heads copied into
        v_cache at slot_mapping (-1: no write): their first 2 * cos.shape[1] dims rotate (the
        table's rotary_dim, gpu/rope.py), the rest of each head passes through."""
        kvh, rot_half = k_cache.shape[2], cos.shape[1]
        self._launch(step_plan.rope_store_kv(qkv, num_heads, kvh, head_dim, rot_half), (
            qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, np.int32(num_heads), np.int32(kvh),
            np.int32(head_dim), np.int32(rot_half), np.int32(qkv.shape[1])), stream)

    def silu_mul(self, gate_up, out, stream) -> None:
        T, inter = out.shape
        self._launch(step_plan.silu_mul(out), (gate_up, out, np.int32(T), np.int32(inter // 2)), stream)

    def gelu_tanh_mul(self, gate_up, out, stream) -> None:
        T, inter = out.shape
        self._launch(step_plan.gelu_tanh_mul(out), (gate_up, out, np.int32(T), np.int32(inter // 2)), stream)

    def rms_norm(self, x, weight, eps: float, stream) -> None:
        """x [T, n] = RMSNorm(x) * weight, in place in the activations' dtype."""
        self._launch(step_plan.rms_norm(x), (x, weight, np.int32(x.shape[1]), np.float32(eps)), stream)

    def add_bias(self, x, bias, stream) -> None:
        """x [T, n] += bias [n] (contiguous rows)."""
        T, n = x.shape
        self._launch(step_plan.add_bias(x), (x, bias, np.int32(T), np.int32(n)), stream)

    def to_float32(self, src, out, stream) -> None:
        """out [rows, cols] float32 = src, exactly (contiguous)."""
        rows, cols = src.shape
        self._launch(step_plan.to_float32(src), (src, out, np.int32(rows), np.int32(cols)), stream)
