"""Weights the CPU backend keeps in their stored type: GGUF blocks and 16-bit floats, stacked by
gpu/loader/packing.py (one QuantWeight a fused linear, or a SplitWeight of parts in different
types), the integer kinds moved into gpu/cpu/int8_kernels.py's 16-row tiles, the others multiplied
by gpu/cpu/quant_kernels.py. This module holds one fused linear that way and runs it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from ringserve.gpu.cpu.amx_kernels import tiles_linear
from ringserve.gpu.cpu.int8_kernels import Int8Weight, supports, tiles
from ringserve.gpu.cpu.quant_kernels import quant_linear
from ringserve.gpu.loader.packing import SplitWeight, as_fused, stack_packed
from ringserve.gpu.loader.quant import BLOCK_SIZES, QuantWeight, dequantize, plane_values, take_rows
from ringserve.gpu.loader.weights import GGMLTensor

PackedWeight = QuantWeight | Int8Weight | SplitWeight


def fuse_packed(tensors: Sequence[Any], int8: bool = False) -> PackedWeight:
    """Stack HF matrices along rows, each kept in its own type (gpu/loader/packing.py). int8: the
    integer kinds in the int8-activation kernels' 16-row tiles (gpu/cpu/int8_kernels.py), K-quants
    with their scales factored (llama.cpp's compact form: Q4_K 0.578 bytes a weight, not 0.75) and
    6-bit quants as u6 (Q6_K 0.820, not 1.078), the others as they are, with float32 planes."""
    stacked: tuple[QuantWeight | Int8Weight, ...] = stack_packed(tensors, factored=int8)
    if int8:  # NOTE: only the tiles read int8 factors: any other part gets its float32 planes back
        stacked = tuple(tiles(p) if isinstance(p, QuantWeight) and supports(p) else unfactored(p)
                        for p in stacked)
    return as_fused(stacked)


def unfactored(w: Any) -> Any:
    """w with float32 scale planes where it has int8 factors (what gpu/cpu/quant_kernels.py reads)."""
    if not isinstance(w, QuantWeight) or w.scale_super is None:
        return w
    return replace(w, scale=plane_values(w.scale, w.scale_super, w.block), scale_super=None,
                   offset=plane_values(w.offset, w.offset_super, w.block), offset_super=None)


def packed_linear(x: np.ndarray, w: PackedWeight, out: np.ndarray, parallel: bool) -> None:
    """out = x @ W.T for a packed weight: tiles (Int8Weight) multiply x's int8 blocks, the other
    kinds float32 x."""
    x = np.ascontiguousarray(x)  # NOTE: the kernels read x's rows as blocks (a no-op when it is)
    parts = w.parts if isinstance(w, SplitWeight) else (w,)
    lo = 0
    for part in parts:
        hi = lo + part.shape[0]
        if isinstance(part, Int8Weight):  # NOTE: each part quantizes x again: T x K values, not T x K x N
            # PERF: the tiles store whole 16-column groups through out's row stride: a part
            # writes its own columns in place (Q4_K_M's split qkv at 512 rows, 8 layers of the
            # 1B shape: 11.6 -> 9.9 ms a layer, no buffer to fault in and copy)
            tiles_linear(x, part, out if len(parts) == 1 else out[:, lo:hi], parallel=parallel)
        elif len(parts) == 1:
            quant_linear(x, part, out, parallel=parallel)
        else:  # NOTE: quant_linear's kernels write C-contiguous rows: its own buffer, then copied
            out[:, lo:hi] = quant_linear(x, part, None, parallel=parallel)
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
