"""Weights the CPU backend keeps in their stored type: GGUF blocks and 16-bit floats, packed by
gpu/loader/quant.py and multiplied by gpu/cpu/quant_kernels.py. This module decides how one fused
linear (the model's QKV or gate-up: several HF tensors stacked along rows) is held, and runs it.

A fused linear whose parts share a type is one QuantWeight (the parts' planes stacked: rows are
independent in every layout). One whose parts differ, as llama.cpp's Q4_K_M files mix Q4_K and
Q6_K (v and some down projections in Q6_K), is a SplitWeight: one product per part, each into its
own columns of the output.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from ringserve.gpu.cpu.int8_kernels import Int8Weight, int8_linear, supports, tiles
from ringserve.gpu.cpu.quant_kernels import quant_linear
from ringserve.gpu.loader.quant import (
    BLOCK_SIZES,
    QuantWeight,
    concat_rows,
    dequantize,
    layout,
    plane_values,
    repack,
    take_rows,
)
from ringserve.gpu.loader.weights import GGMLTensor


def is_packed(tensor: Any) -> bool:
    """Kept in its stored type rather than widened: GGUF blocks, BF16 (a GGMLTensor), F16."""
    return isinstance(tensor, GGMLTensor) or getattr(tensor, "dtype", None) == np.float16


def pack(tensor: Any, factored: bool = False) -> QuantWeight:
    """One HF matrix as a QuantWeight of its own type (float32 stays float32; a QuantWeight,
    e.g. an AWQ/GPTQ weight unpacked by gpu/loader/hf_quant.py, as it is). factored: K-quant scales as
    int8 factors of super planes (gpu/loader/quant.py repack; the CUDA store's, never the CPU's)."""
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
    """A fused linear whose parts are kept in different types."""
    parts: tuple[QuantWeight | Int8Weight, ...]
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


PackedWeight = QuantWeight | Int8Weight | SplitWeight


def fuse_packed(tensors: Sequence[Any], int8: bool = False, factored: bool = False) -> PackedWeight:
    """Stack HF matrices along rows, each kept in its own type. int8: the integer kinds in the
    int8-activation kernels' 16-row tiles (gpu/cpu/int8_kernels.py), K-quants with their scales
    factored (llama.cpp's compact form: Q4_K 0.578 bytes a weight, not 0.75) and 6-bit quants as
    u6 (Q6_K 0.820, not 1.078), the others as they are; factored: as pack's."""
    parts = [pack(t, factored or int8) for t in tensors]
    groups: list[list[QuantWeight]] = []
    for p in parts:  # neighbours of one type and layout become one weight
        if groups and _same_layout(groups[-1][0], p):
            groups[-1].append(p)
        else:
            groups.append([p])
    stacked: tuple[QuantWeight | Int8Weight, ...] = tuple(
        g[0] if len(g) == 1 else concat_rows(g) for g in groups)
    if int8:  # NOTE: only the tiles read int8 factors: any other part gets its float32 planes back
        stacked = tuple(tiles(p) if isinstance(p, QuantWeight) and supports(p) else unfactored(p)
                        for p in stacked)
    rows = sum(p.shape[0] for p in stacked)
    return stacked[0] if len(stacked) == 1 else SplitWeight(stacked, (rows, stacked[0].shape[1]))


def unfactored(w: Any) -> Any:
    """w with float32 scale planes where it has int8 factors (what gpu/cpu/quant_kernels.py reads)."""
    if not isinstance(w, QuantWeight) or w.scale_super is None:
        return w
    return replace(w, scale=plane_values(w.scale, w.scale_super, w.block), scale_super=None,
                   offset=plane_values(w.offset, w.offset_super, w.block), offset_super=None)


def _same_layout(a: QuantWeight, b: QuantWeight) -> bool:
    return layout(a) == layout(b)  # NOTE: planes' dtypes too: a factored weight never joins a plain one


def packed_linear(x: np.ndarray, w: PackedWeight, out: np.ndarray, parallel: bool) -> None:
    """out = x @ W.T for a packed weight: tiles (Int8Weight) multiply x's int8 blocks, the other
    kinds float32 x."""
    x = np.ascontiguousarray(x)  # NOTE: the kernels read x's rows as blocks (a no-op when it is)
    parts = w.parts if isinstance(w, SplitWeight) else (w,)
    lo = 0
    for part in parts:
        hi = lo + part.shape[0]
        # NOTE: a part writes into its own buffer when there are several: the kernels write whole rows
        dst = out if len(parts) == 1 else None
        if isinstance(part, Int8Weight):  # NOTE: each part quantizes x again: T x K values, not T x K x N
            y = int8_linear(x, part, dst, parallel=parallel)
        else:
            y = quant_linear(x, part, dst, parallel=parallel)
        if dst is None:
            out[:, lo:hi] = y
        lo = hi


def packed_rows(w: PackedWeight, ids: np.ndarray, out: np.ndarray) -> None:
    """out = W[ids] as float32 (the embedding lookup of a packed table)."""
    if isinstance(w, SplitWeight):
        raise ValueError("an embedding table is one tensor")
    out[...] = dequantize(w.rows(ids) if isinstance(w, Int8Weight) else take_rows(w, ids))


# Bytes a weight takes once packed, by type (gpu/loader/quant.py's layouts; 4-bit rows that are not
# whole 64-weight groups become int8, 1.125-1.25): the start-up fit check's estimate.
_PACKED_BYTES = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 1.125, "Q4_0": 0.75, "Q4_1": 0.75,
                 "Q5_0": 1.125, "Q5_1": 1.25, "Q4_K": 0.75, "Q5_K": 1.25, "Q6_K": 1.25, "Q3_K": 1.25,
                 "Q2_K": 1.5}
assert set(_PACKED_BYTES) == set(BLOCK_SIZES)
# In the int8 tiles: the K-quants' scales as int8 factors, one half (two with a minimum) per 256;
# quants that fit 6 bits as u6 (0.75 B/weight; int8_kernels.U6_TYPES), Q5_0/Q5_1's scales as halves
_TILED_BYTES = {"Q4_K": 0.578, "Q5_K": 0.828, "Q6_K": 0.820, "Q3_K": 0.820, "Q2_K": 0.891, "Q5_0": 0.813,
                "Q5_1": 0.875}


def packed_nbytes(tensor: Any, int8: bool = False) -> int:
    """About what fuse_packed([tensor], int8) will hold in memory."""
    kind = tensor.ggml_type if isinstance(tensor, GGMLTensor) else "F16"
    per_weight = _TILED_BYTES.get(kind, _PACKED_BYTES[kind]) if int8 else _PACKED_BYTES[kind]
    return int(np.prod(tensor.shape) * per_weight)
