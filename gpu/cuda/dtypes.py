"""The CUDA backend's element type, as vLLM chooses it: weights, activations and KV cache in one
16-bit float type, the residual stream and every sum in float32.

`--dtype auto` serves a checkpoint in its own type where the GPU has it: bfloat16 as bfloat16,
float16 as float16, float32 narrowed to float16 (vLLM's rule), and a quantized checkpoint (GGUF
integer blocks, AWQ/GPTQ) with float16 activations (quant.cu's kernels take either); but
Gemma 3 always in bfloat16 (FP16_UNSTABLE).
`--dtype float16|bfloat16` overrides; narrowing a weight to float16 refuses
one whose values fp16 cannot hold (|w| >= 65520 rounds to inf), naming it.

bfloat16 lives on the device as its bits in uint16 arrays (numpy and CuPy have no bfloat16; the
CPU backend keeps them the same way): the kernels and cuBLAS read a uint16 array as bfloat16, so
an array's dtype says its element type and nothing else needs to be told. CI-safe: no CuPy here;
the conversions take the array module (numpy, or cupy for weights made on the device).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ringserve.gpu.bfloat16 import widen_bfloat16
from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.quant import QuantWeight
from ringserve.gpu.loader.weights import GGMLTensor
from ringserve.gpu.settings import CUDA_DTYPES

SERVING_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}  # -> device storage
CHECKPOINT_DTYPES = ("bfloat16", "float16", "float32", "quantized")
# auto: the serving dtype for each checkpoint dtype
AUTO = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float16", "quantized": "float16"}
FP16_MAX = 65504.0
# Architectures whose activations outgrow fp16 (vLLM's _FLOAT16_NOT_SUPPORTED_MODELS): served in
# bf16 whatever the checkpoint (a GGUF's blocks or a float32 file would be fp16 under auto)
FP16_UNSTABLE = {"Gemma3ForCausalLM": "Gemma 3's activations overflow float16 (numerical instability)"}
# bf16 bits (sign cleared) from which a finite value rounds to fp16's inf: 2^16 (every bf16 below
# it is at most 65280, within fp16's range); 0x7F80 and up are bf16's inf and NaN
_BF16_FP16_OVERFLOW, _BF16_INF = 0x4780, 0x7F80


def checkpoint_dtype(weights: dict[str, Any]) -> str:
    """What the checkpoint's matrices are stored in (the weights tell, not config.json's
    torch_dtype): "quantized" if any is packed integer blocks, else "bfloat16" if any is BF16,
    else "float16" if any is fp16, else "float32". Weights already on the device (gpu_check)
    count by their dtype."""
    kinds = set()
    for t in weights.values():
        floats = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
        if isinstance(t, QuantWeight) or (isinstance(t, GGMLTensor) and t.ggml_type not in floats):
            kinds.add("quantized")
        elif isinstance(t, GGMLTensor):
            kinds.add(floats[t.ggml_type])
        elif str(t.dtype) in ("float16", "float32"):
            kinds.add(str(t.dtype))
    return next((k for k in ("quantized", "bfloat16", "float16") if k in kinds), "float32")


def resolve_dtype(requested: str, checkpoint: str) -> str:
    """The serving dtype ("float16" or "bfloat16") for --dtype `requested` and a checkpoint
    stored in `checkpoint` (CHECKPOINT_DTYPES)."""
    if requested not in CUDA_DTYPES:
        raise ValueError(f"dtype {requested!r} is not supported by the CUDA backend "
                         f"({', '.join(CUDA_DTYPES)})")
    return AUTO[checkpoint] if requested == "auto" else requested


def serving_dtype(requested: str, weights: dict[str, Any], architecture: str | None = None) -> str:
    """What CudaModelRunner serves `weights` in for --dtype `requested` (resolve_dtype of their
    checkpoint dtype), after refusing a weight fp16 cannot hold when that is float16.
    architecture: one in FP16_UNSTABLE is served in bfloat16 under auto, and refused in float16."""
    if architecture in FP16_UNSTABLE:
        if requested == "float16":
            raise ModelError(f"--dtype float16: {FP16_UNSTABLE[architecture]} (vLLM refuses it too); "
                             f"use bfloat16 or auto")
        requested = "bfloat16" if requested == "auto" else requested
    dtype = resolve_dtype(requested, checkpoint_dtype(weights))
    if dtype == "float16":
        check_fp16_range(weights)
    return dtype


def check_fp16_range(weights: dict[str, Any]) -> None:
    """Raise ModelError (one line, naming the tensor) if narrowing a host weight to fp16 would
    turn a finite value into inf. BF16 tensors are checked on their bits, float32 ones by their
    largest magnitude; fp16 and packed weights need no narrowing."""
    for name, t in weights.items():
        if isinstance(t, GGMLTensor) and t.ggml_type == "BF16":
            for chunk in _chunks(np.asarray(t.raw).view(np.uint16)):
                mag = chunk & np.uint16(0x7FFF)
                bad = mag[(mag >= _BF16_FP16_OVERFLOW) & (mag < _BF16_INF)]
                if bad.size:
                    _refuse(name, float(widen_bfloat16(np, bad.max()[None])[0]))
        elif isinstance(t, np.ndarray) and t.dtype == np.float32:
            for chunk in _chunks(t):
                mag = np.abs(chunk)
                worst = float(mag[np.isfinite(mag)].max(initial=0.0))
                if worst >= FP16_MAX + 16:  # NOTE: up to 65519.99 rounds down to 65504
                    _refuse(name, worst)


def _chunks(a: np.ndarray, size: int = 1 << 24):
    """a's elements in flat pieces of `size`: a check's temporaries stay small (a float32
    checkpoint's embedding alone can be GBs)."""
    flat = a.reshape(-1)
    for i in range(0, flat.size, size):
        yield flat[i:i + size]


def _refuse(name: str, worst: float) -> None:
    raise ModelError(f"weights: tensor {name!r} holds values up to {worst:.6g} in magnitude, beyond "
                     f"float16's {FP16_MAX:.0f}: serve it in bfloat16 (--dtype bfloat16)")
