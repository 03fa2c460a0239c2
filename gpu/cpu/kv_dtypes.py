"""The CPU KV cache's storage types (--kv-cache-dtype): float32, or 16-bit to halve the bytes
attention reads per step at long contexts.

Numba has no float16, so the 16-bit types are kept as their bits, each in its own integer dtype
so that the kernels compile apart for each: bfloat16 as the upper half of a float32 in uint16,
float16 as IEEE half bits in int16. The kernels (gpu/cpu/kernels.py rope_store_kv,
gpu/cpu/attention.py) read an element with `kv_load` and write one with `kv_store`; for float32
both are the identity and compile to the same code as before. Rounding is to nearest, ties to
even, as numpy's astype(float16) and torch's bfloat16 round; reads are exact.

Where the CPU converts halves itself (x86's F16C: every AVX2 and AVX-512 core), float16 is
LLVM's `half` type: a load is `fpext` and a store `fptrunc`, one `vcvtph2ps` / `vcvtps2ph` for 16
values once the loops vectorize (PERF: the bit arithmetic below, branches for inf and the sign,
kept attention's loops scalar: a decode over a float16 cache took twice a float32 one's time).
Both are exact the same way (IEEE conversions, round to nearest even); the bit arithmetic is
the fallback elsewhere.
"""
from __future__ import annotations

from typing import Any

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

KV_CACHE_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.int16}
_HALF_SCALE = np.float32(2.0 ** 112)   # (half bits & 0x7fff) << 13 read as float32, times this
_SUBNORMAL_SCALE = np.float32(2.0 ** 24)  # a half subnormal's bits: |v| / 2^-24


def kv_load(x):
    """float32 value of one stored K/V element (compiled per storage dtype by the overload)."""


def kv_store(v, like):
    """float32 `v` as an element of `like`'s dtype (`like`: the cache array)."""


@njit(cache=True)  # NOTE: not numba-IR inlined (its branches trip the SSA pass); LLVM inlines it
def half_to_float(h):  # pragma: no cover - compiled
    """IEEE half bits (any integer type, low 16 bits) -> float32, exactly: normals and
    subnormals by one multiply (the exponent rebias), inf and nan by their bits."""
    u = np.uint32(h) & np.uint32(0xFFFF)
    bits = (u & np.uint32(0x7FFF)) << np.uint32(13)
    f = np.uint32(bits).view(np.float32) * _HALF_SCALE
    if (u & np.uint32(0x7C00)) == np.uint32(0x7C00):
        f = np.uint32(bits | np.uint32(0x7F800000)).view(np.float32)
    return -f if u & np.uint32(0x8000) else f


@njit(cache=True)  # NOTE: not numba-IR inlined (its branches trip the SSA pass); LLVM inlines it
def float_to_half(v):  # pragma: no cover - compiled
    """float32 -> IEEE half bits (int16), round to nearest even; overflow is inf."""
    b = np.float32(v).view(np.uint32)
    sign = (b >> np.uint32(16)) & np.uint32(0x8000)
    a = b & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):            # |v| >= 65536, inf or nan
        h = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):           # below 2^-14: a subnormal half (or 0)
        h = np.uint32(np.rint(np.abs(np.float32(v)) * _SUBNORMAL_SCALE))
    else:                                     # rebias 127 -> 15, 23 -> 10 mantissa bits
        a = a - np.uint32(0x38000000)
        h = (a + np.uint32(0x0FFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    return np.int16(np.uint16(sign | h))


def _has_f16c() -> bool:
    llvm.initialize_native_target()
    return bool(llvm.get_host_cpu_features().get("f16c", False))


# NOTE: elsewhere LLVM would lower half conversions to compiler-rt calls, which Numba's JIT
# does not link
HARDWARE_HALF = _has_f16c()


def _half_load_typing(typingctx, h):
    """IEEE half bits (int16) -> float32 by LLVM's fpext (F16C's vcvtph2ps)."""
    if h != types.int16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(h), codegen


def _half_store_typing(typingctx, v):
    """float32 -> IEEE half bits (int16) by LLVM's fptrunc (F16C's vcvtps2ph), nearest even."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(v), codegen


_half_load: Any = intrinsic(_half_load_typing)
_half_store: Any = intrinsic(_half_store_typing)


@overload(kv_load, inline="always")
def _kv_load(x):
    if x == types.uint16:    # bfloat16 bits
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    if x == types.int16:     # float16 bits
        if HARDWARE_HALF:
            return lambda x: _half_load(x)
        return lambda x: half_to_float(x)
    return lambda x: x


@overload(kv_store, inline="always")
def _kv_store(v, like):
    if like.dtype == types.uint16:
        def bf16(v, like):
            b = np.float32(v).view(np.uint32)
            return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                             >> np.uint32(16))
        return bf16
    if like.dtype == types.int16:
        if HARDWARE_HALF:
            return lambda v, like: _half_store(np.float32(v))
        return lambda v, like: float_to_half(v)
    return lambda v, like: v
