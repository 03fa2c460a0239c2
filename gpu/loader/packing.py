"""How one fused linear (the model's QKV or gate-up: several HF tensors stacked along rows) is
held in its stored types, for every backend: GGUF blocks and 16-bit floats as gpu/loader/quant.py's
planes. gpu/cpu/packed.py moves the integer kinds into its int8 tiles and multiplies; the CUDA
store (gpu/cuda/quant_linear.py) uploads the planes.

A fused linear whose parts share a type is one QuantWeight (the parts' planes stacked: rows are
independent in every layout). One whose parts differ, as llama.cpp's Q4_K_M files mix Q4_K and
Q6_K (v and some down projections in Q6_K), is a SplitWeight: one product per part, each into its
own columns of the output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ringserve.gpu.loader.quant import QuantWeight, concat_rows, layout, repack
from ringserve.gpu.loader.weights import GGMLTensor


def is_packed(tensor: Any) -> bool:
    """Kept in its stored type rather than widened: GGUF blocks, BF16 (a GGMLTensor), F16."""
    return isinstance(tensor, GGMLTensor) or getattr(tensor, "dtype", None) == np.float16


def pack(tensor: Any, factored: bool = False) -> QuantWeight:
    """One HF matrix as a QuantWeight of its own type (float32 stays float32; a QuantWeight,
    e.g. an AWQ/GPTQ weight unpacked by gpu/loader/hf_quant.py, as it is). factored: K-quant scales as
    int8 factors of super planes (gpu/loader/quant.py repack)."""
    if isinstance(tensor, QuantWeight):
        return tensor
    if isinstance(tensor, GGMLTensor):
        return repack(tensor.raw, tensor.ggml_type, tensor.shape, factored=factored)
    a = np.ascontiguousarray(tensor)
    qtype = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}.get(a.dtype)
    if qtype is None or a.ndim != 2:
        raise ValueError(f"a {a.dtype} tensor of shape {a.shape} cannot be packed")
    return repack(a, qtype, (a.shape[0], a.shape[1]))


@dataclass(frozen=True, eq=False)
class SplitWeight:
    """A fused linear whose parts are kept in different types (or layouts)."""
    parts: tuple[Any, ...]
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def stack_packed(tensors: Sequence[Any], factored: bool = False) -> tuple[QuantWeight, ...]:
    """The tensors packed (pack) and stacked along rows, neighbours of one type and layout into
    one QuantWeight: the parts of a fused linear, in row order."""
    groups: list[list[QuantWeight]] = []
    for p in (pack(t, factored) for t in tensors):
        # NOTE: layout() compares the planes' dtypes too: a factored weight never joins a plain one
        if groups and layout(groups[-1][0]) == layout(p):
            groups[-1].append(p)
        else:
            groups.append([p])
    return tuple(g[0] if len(g) == 1 else concat_rows(g) for g in groups)


def as_fused(parts: Sequence[Any]) -> Any:
    """One part as itself, several as a SplitWeight over their rows."""
    rows = sum(p.shape[0] for p in parts)
    return parts[0] if len(parts) == 1 else SplitWeight(tuple(parts), (rows, parts[0].shape[1]))
