"""Int4 HF checkpoints: AWQ (AutoAWQ's GEMM packing, group 128, zero points) and GPTQ
(symmetric, group 128, desc_act false), read from safetensors with config.json's
``quantization_config``, and unpacked at load into gpu/loader/quant.py's u4 planes (QuantWeight kind
"u4", one float32 scale and offset per 128-weight group), the planes the CUDA backend's
quant.cu reads (gpu/cuda/quant_linear.py). Any other quantization_config is refused, in one
line that names it.

Layouts (per linear, W [out N, in K], group g = 128):
- AWQ: ``qweight`` int32 [K, N/8] and ``qzeros`` int32 [K/g, N/8], eight 4-bit values a word
  along the output dimension in AutoAWQ's order (nibble i holds column AWQ_PACK_ORDER[i] of
  its eight), ``scales`` fp16 [K/g, N]: W[n, k] = (q[k, n] - z[k/g, n]) * s[k/g, n].
- GPTQ: ``qweight`` int32 [K/8, N], eight values a word along the input dimension (nibble i:
  input row 8r + i), ``scales`` fp16 [K/g, N], ``g_idx`` [K] (k // g when desc_act is false),
  symmetric: W[n, k] = (q[k, n] - 8) * s[k/g, n] (the zero point of a symmetric 4-bit GPTQ is
  8 whatever ``qzeros`` stores: vLLM's GPTQ kernels read it so).
As planes: scale = s and offset = -(z * s), both exact in float32 (s is fp16, z < 16), and
scale * q + offset = (q - z) * s exactly (every term fits float32's 24 bits): the planes
dequantize bit-identically to the formulas above (tests/test_hf_quant.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.config import INT4_GROUP_SIZE, int4_scheme
from ringserve.gpu.loader.quant import QuantWeight, to_u4

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AutoAWQ: nibble i of a word holds column ORDER[i]
AWQ_UNPACK = tuple(int(i) for i in np.argsort(AWQ_PACK_ORDER))  # column j is nibble UNPACK[j]
def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [..., c] -> uint8 [..., c, 8]: nibble i (bits 4i..4i+3) of each word."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return ((np.ascontiguousarray(words).view(np.uint32)[..., None] >> shifts) & 15).astype(np.uint8)


def _planes(qtype: str, q: np.ndarray, zeros: np.ndarray, scales: np.ndarray) -> QuantWeight:
    """q uint8 [N, K] (0..15), zeros [N, K/g], scales fp16 [N, K/g] -> the u4 QuantWeight."""
    n, k = q.shape
    if k % INT4_GROUP_SIZE or scales.shape != (n, k // INT4_GROUP_SIZE):
        raise ModelError(f"{qtype}: weight [{n}, {k}] with scales {scales.shape} "
                         f"is not group {INT4_GROUP_SIZE}")
    scale = np.ascontiguousarray(scales, dtype=np.float32)
    offset = -(zeros.astype(np.float32) * scale)   # NOTE: exact (module doc)
    return QuantWeight(qtype, (n, k), "u4", to_u4(q), scale, np.ascontiguousarray(offset), INT4_GROUP_SIZE)


def unpack_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray) -> QuantWeight:
    k, n8 = qweight.shape
    q = _nibbles(qweight)[..., AWQ_UNPACK].reshape(k, n8 * 8)       # [K, N] in column order
    z = _nibbles(qzeros)[..., AWQ_UNPACK].reshape(qzeros.shape[0], n8 * 8)
    return _planes("AWQ", np.ascontiguousarray(q.T), z.T, np.asarray(scales).T)


def unpack_gptq(qweight: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None) -> QuantWeight:
    k8, n = qweight.shape
    q = _nibbles(qweight).transpose(0, 2, 1).reshape(k8 * 8, n)     # [K, N]: input row 8r + i
    if g_idx is not None and not np.array_equal(np.asarray(g_idx), np.arange(k8 * 8) // INT4_GROUP_SIZE):
        raise ModelError("GPTQ: g_idx is not k // group_size (an act-order checkpoint: desc_act true)")
    s = np.asarray(scales).T
    return _planes("GPTQ", np.ascontiguousarray(q.T), np.full(s.shape, 8, np.uint8), s)


def fold_int4(weights: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """The checkpoint's qweight/qzeros/scales (/g_idx) triples as one ``<prefix>.weight``
    QuantWeight each, by the scheme config.json names; weights without them as they are."""
    prefixes = [name[:-len(".qweight")] for name in weights if name.endswith(".qweight")]
    if not prefixes:
        return weights
    try:
        raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{model_dir / 'config.json'}: cannot read it ({e})") from None
    scheme = int4_scheme(raw.get("quantization_config"))
    if scheme is None:
        raise ModelError(f"{model_dir}: packed int4 tensors ({prefixes[0]}.qweight) "
                         f"but no quantization_config")
    out = dict(weights)
    for p in prefixes:
        try:
            if scheme.method == "awq":
                w = unpack_awq(out.pop(p + ".qweight"), out.pop(p + ".qzeros"), out.pop(p + ".scales"))
            else:
                out.pop(p + ".qzeros", None)  # symmetric: the zero point is 8
                w = unpack_gptq(out.pop(p + ".qweight"), out.pop(p + ".scales"),
                                out.pop(p + ".g_idx", None))
        except KeyError as e:
            missing = e.args[0]
            raise ModelError(f"{model_dir}: {scheme.method.upper()} tensor {missing!r} is missing") from None
        out[p + ".weight"] = w
    return out
