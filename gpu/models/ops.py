"""What every model definition (gpu/models/llama.py, gemma3.py) runs on: the backend's ops and
weight store, as protocols, and the logits at the end of a step. The CPU backend implements them
in gpu/cpu/ops.py CpuOps (numpy + Numba, float32 activations); the CUDA backend in
gpu/cuda/runner.py CudaOps (cuBLAS, CUDA C, Numba CUDA; fp16 or bf16 activations), and CI in
tests/test_cuda_forward_host.py HostOps (the same CUDA C compiled for the host). Nothing here
imports numpy's or CuPy's arrays: a weight, a buffer or a cache is whatever its backend made it.

What a backend decides, through its objects, and the sequence never sees:
- WeightStore: how a (fused) weight is kept: float32 or bfloat16 bits on the CPU, fp16 or bf16 bits on CUDA;
  a quantized format (packed blocks) is another store plus an ops.linear that reads it.
- step buffers (`buf`): every activation of one step, in the backend's dtypes (the residual
  stream h is float32 on both), and the row blocks the MLP runs in (`buf.mlp_rows`: one block
  on CUDA; blocks of a few hundred token rows on the CPU, whose memory a long step's
  [T, 2 I] activations would otherwise hold).
- which ops it fuses: attention's RoPE and K/V write are one Numba pass on the CPU (rotated q
  to its own buffer, k/v straight into the cache) before its attention kernel; on CUDA one
  fused.cu kernel (q rotated in place, k/v into the cache) before attention.cu's, or, for a
  decode-only step, inside attention.cu's one launch; which kernel and geometry each CUDA op
  launches is gpu/cuda/step_plan.py's (what tools/step_census.py lists).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence


class WeightStore(Protocol):
    """Turns HF tensors (numpy or the backend's arrays) into the arrays the ops read."""

    def linear(self, arrays: Sequence[Any]) -> Any:
        """A [out, in] weight for ops.linear (and ops.embedding): arrays stacked along rows."""

    def vector(self, arrays: Sequence[Any]) -> Any:
        """A norm weight or bias: arrays concatenated."""


_ARRAY_TYPES = {"float32": "F32", "float16": "F16", "uint16": "BF16"}


def storage(w: Any) -> list[tuple[str, int]]:
    """(storage type, bytes) of one weight: a packed weight says its own (`parts`: a fused
    weight of several types; `qtype` and `nbytes`: one type); an array, its dtype."""
    parts = getattr(w, "parts", None)
    if parts is not None:
        return [s for part in parts for s in storage(part)]
    qtype = getattr(w, "qtype", None)
    if qtype is not None:
        return [(qtype, int(w.nbytes))]
    return [(_ARRAY_TYPES.get(str(w.dtype), str(w.dtype)), int(w.nbytes))]


class ModelOps(Protocol):
    """The primitives the sequence runs on (on CUDA all enqueued in order on one stream).
    Shapes: T tokens of the step; buf.qkv [T, q + 2 kv], buf.attn [T, q], the rest [T, n]."""

    def embedding(self, ids, table, out) -> None:
        """out = table[ids] in out's dtype (table as WeightStore.linear made it)."""

    def linear(self, x, weight, out) -> None:
        """out = x @ weight.T (weight as WeightStore.linear made it; float32 accumulation)."""

    def add_bias(self, x, bias) -> None: ...

    def add_rms_norm(self, h, delta, weight, out) -> None:
        """h += delta (None: nothing to add); out = RMSNorm(h) * weight (the ops hold the
        config's rms_norm_eps, as they hold the attention scale)."""

    def rms_norm(self, x, weight) -> None:
        """In place in x [T, n] (an activation buffer, such as buf.delta): x = RMSNorm(x) *
        weight (Gemma 3's norms of a layer's outputs before the residual add)."""

    def scale_embedding(self, h, factor: float) -> None:
        """h *= factor in float32 (Gemma 3's sqrt(hidden) on the embedded rows)."""

    def qk_norm(self, qkv, weight) -> None:
        """In place in qkv [T, q + 2 kv]: each q head = RMSNorm(head) * weight[:head_dim], each
        k head the same with weight[head_dim:] (the config's rms_norm_eps); v untouched."""

    def attention(self, buf, cos, sin, k_cache, v_cache, launch, window: int) -> None:
        """RoPE, the K/V write and attention, fused as far as the backend can (module docstring):
        q and k of buf.qkv rotated by buf.positions (cos, sin: [positions, rotary_dim / 2]
        tables: the first 2 * cos.shape[1] dims of each head rotate, the rest pass through), k
        and v written into the caches at buf.slot_mapping (-1: no write), then buf.attn = paged
        attention of the rotated q over the caches (launch: the backend's per-step plan, CUDA's
        AttentionLaunch; None on the CPU). window 0: a query at position
        p reads keys 0..p; else only keys k with p - window < k <= p (transformers' sliding
        mask), and the kernels read no block wholly before that (engine/kv_cache.py may have
        freed it). The window is a launch argument: one CUDA graph serves every layer."""

    def silu_mul(self, gate_up, out) -> None:
        """out = silu(gate) * up, gate_up [T, 2 I] -> out [T, I]."""

    def gelu_tanh_mul(self, gate_up, out) -> None:
        """out = gelu_tanh(gate) * up (transformers' gelu_pytorch_tanh), as silu_mul."""

    def gather_rows(self, x, rows, out) -> None:
        """out = x[rows]."""

    def to_float32(self, src, out) -> None:
        """out = src as float32 (nothing where src is out)."""


def gated_mlp(ops: ModelOps, buf, layer, activation) -> None:
    """buf.delta = layer.down(activation(layer.gate_up(buf.x))), row block by row block of
    buf.mlp_rows: buf.gate_up and buf.act hold one block (activation: ops.silu_mul or
    ops.gelu_tanh_mul)."""
    for rows in buf.mlp_rows:
        n = rows.stop - rows.start
        gate_up, act = buf.gate_up[:n], buf.act[:n]
        ops.linear(buf.x[rows], layer.gate_up, gate_up)
        activation(gate_up, act)
        ops.linear(act, layer.down, buf.delta[rows])


def compute_logits(ops: ModelOps, w: Any, x, rows, last, raw, out) -> None:
    """out = float32 logits of final hidden states x at rows. last [rows, hidden] and raw
    [rows, vocab] are scratch in the activation dtype (raw may be out: float32 activations).
    PERF: only the rows that need logits go through the lm_head, the largest linear."""
    ops.gather_rows(x, rows, last)
    ops.linear(last, w.lm_head, raw)
    ops.to_float32(raw, out)
