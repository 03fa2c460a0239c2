"""Launcher for quant.cu (the packed-weight linears; their plan: gpu/cuda/quant_linear.py)."""
from __future__ import annotations

import cupy as cp
import numpy as np

from ringserve.gpu.cuda import toolchain
from ringserve.gpu.cuda.quant_linear import KERNELS

_NULL = np.uint64(0)


class QuantKernels:
    """call(name, (grid, block), *args): quant_linear.QuantLinear's launches on one stream."""

    def __init__(self, stream):
        self.stream = stream
        module = cp.RawModule(code=toolchain.source("quant.cu"), options=toolchain.options(),
                              backend="nvrtc")
        self._kernels = {name: module.get_function(name) for name in KERNELS}

    def call(self, name: str, geometry, *args) -> None:
        grid, block = geometry
        self._kernels[name](grid, block, tuple(_NULL if a is None else a for a in args),
                            stream=self.stream)
