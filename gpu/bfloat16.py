"""bfloat16 held as its bits in uint16 arrays (numpy has no bfloat16): narrowing float values
rounded to nearest even, as torch rounds, and widening back to float32 exactly. One pair for
every backend: `xp` is numpy or CuPy."""
from __future__ import annotations

from typing import Any


def to_bfloat16(xp: Any, a: Any) -> Any:
    """Float values -> bfloat16 bits (uint16 of xp), rounded to nearest even (as torch)."""
    bits = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32)
    rounded = bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))
    return (rounded >> xp.uint32(16)).astype(xp.uint16)


def widen_bfloat16(xp: Any, bits: Any) -> Any:
    """bfloat16 bits (uint16) -> float32, exactly."""
    return (bits.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)
