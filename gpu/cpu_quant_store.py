"""The CPU backend on GGUF weights kept in their own types (gpu/quant.py): the weight store and the
two ops that read packed weights, and the GGUF's matrices by HF name (issue 14, item 1).

Not wired into the runner yet: ``ModelRunner`` builds ``CpuWeightStore`` / ``CpuOps``; a runner
serving a GGUF natively builds these instead, from ``load_gguf_weights`` (tests/
test_quant_kernels.py does so by hand and checks the default model's logits against today's
float32 path).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ringserve.gpu.cpu_ops import CpuOps, CpuWeightStore
from ringserve.gpu.cpu_quant_kernels import quant_linear
from ringserve.gpu.gguf_convert import _hf_name, open_gguf, unpermute_qk
from ringserve.gpu.quant import QuantWeight, concat_rows, dequantize, from_gguf, take_rows

F32 = np.float32


class StackedWeight(tuple):
    """Weights of different types stacked along rows (a Q4_K_M file's qkv: Q4_K q and k, Q6_K v):
    one linear writes each part's columns."""


class CpuQuantWeightStore(CpuWeightStore):
    """model.WeightStore for packed weights: linears stay packed (parts of one layout are stacked
    into one QuantWeight, else kept as a StackedWeight); float tensors as CpuWeightStore has them."""

    def linear(self, arrays: Sequence[Any]) -> Any:
        if not any(isinstance(a, QuantWeight) for a in arrays):
            return super().linear(arrays)
        parts = [a if isinstance(a, QuantWeight) else _as_f32(a) for a in arrays]
        if len(parts) == 1:
            return parts[0]
        try:
            return concat_rows(parts)
        except ValueError:
            return StackedWeight(parts)


def _as_f32(a: np.ndarray) -> QuantWeight:
    w = np.ascontiguousarray(a, dtype=F32)
    return QuantWeight("F32", (w.shape[0], w.shape[1]), "f32", w)


class QuantCpuOps(CpuOps):
    """CpuOps whose linear and embedding also read packed weights."""

    def linear(self, x, weight, out) -> None:
        if isinstance(weight, QuantWeight):
            quant_linear(x, weight, out, parallel=self.parallel)
        elif isinstance(weight, StackedWeight):
            col = 0
            for part in weight:
                quant_linear(x, part, out[:, col:col + part.shape[0]], parallel=self.parallel)
                col += part.shape[0]
        else:
            super().linear(x, weight, out)

    def embedding(self, ids, table, out) -> None:
        if isinstance(table, QuantWeight):
            out[...] = dequantize(take_rows(table, ids))  # only the step's rows are widened
        else:
            super().embedding(ids, table, out)


def load_gguf_weights(path: str | Path, num_heads: int, num_kv_heads: int, *,
                      nibbles: bool = True) -> dict[str, Any]:
    """The GGUF's tensors by HF name: matrices as QuantWeights (packed from the memory map; q/k rows
    un-permuted as gguf_convert does; 4-bit types as nibbles unless told otherwise: gpu/quant.py),
    vectors (norms) as float32 arrays."""
    import gguf.quants  # NOTE: lazily, as gguf_convert does

    path = Path(path)
    weights: dict[str, Any] = {}
    for t in open_gguf(path).tensors:
        name = _hf_name(t.name, path)
        if len(t.shape) == 1:
            weights[name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=F32).copy()
            continue
        w = from_gguf(t, nibbles=nibbles)
        heads = num_heads if t.name.endswith(".attn_q.weight") else \
            num_kv_heads if t.name.endswith(".attn_k.weight") else None
        if heads:  # the same row permutation gguf_convert applies to the float rows
            order = unpermute_qk(np.arange(w.shape[0])[:, None], heads)[:, 0]
            w = take_rows(w, order)
        weights[name] = w
    return weights
