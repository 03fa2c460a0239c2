"""The int8 linears through AMX tiles (gpu/cpu/amx_kernels.py) against the VNNI kernel, bit for bit.

Both kernels sum the integer products exactly and share one float epilogue (int8_kernels.float_terms),
so their outputs must be equal, not close: a token's output must not depend on how many tokens a step
holds (a prefix hit or a preemption recomputes a prompt in other chunks, and CI compares the text).
The VNNI side is int8_kernels.int8_linear on the same rows, which tests/test_int8_kernels.py checks
against the exact float64 product.
"""
from __future__ import annotations

import numpy as np
import pytest

from ringserve.gpu.cpu import amx_kernels
from ringserve.gpu.cpu.amx_kernels import (
    AMX_KINDS,
    AMX_TOKENS,
    XFEATURE_XTILEDATA,
    amx_linear,
    has_amx,
    on_amx,
    request_tile_permission,
    tiles_linear,
)
from ringserve.gpu.cpu.int8_kernels import has_vnni, int8_linear, tiles
from ringserve.gpu.loader.quant import random_raw, repack

needs_amx = pytest.mark.skipif(not (has_vnni() and has_amx()), reason="this CPU has no AMX-INT8 (or Linux "
                               "refused its tile state): tiles_linear runs every batch on VNNI")

# every scale form the tiles hold, with each kind and sub-block size: (type, factored K-quant scales)
FORMS = [("Q4_0", False),   # u4, 32, half scales and offsets
         ("Q8_0", False),   # i8, 32, half scales, no offset
         ("Q5_1", False),   # i8, 32, half scales and offsets
         ("Q4_K", False),   # u4, 32, float32 planes
         ("Q4_K", True),    # u4, 32, int8 factors of super planes (scale and offset)
         ("Q6_K", False),   # i8, 16, float32 scales
         ("Q6_K", True),    # i8, 16, int8 factors of a super plane, no offset
         ("Q5_K", True)]    # i8, 32, int8 factors with offsets
TOKENS = [1, 15, 16, 17, 100]


def on_vnni(x: np.ndarray, w) -> np.ndarray:
    """x @ W.T from the VNNI kernel, in chunks of up to 4 rows and one call (its remainder kernels),
    with the activations' blocks tiles_linear gives W (of 32 where the tiles take W's rows: K-quants
    too; else the K-quants' 256)."""
    super_blocks = not on_amx(w)
    whole = int8_linear(x, w, super_blocks=super_blocks)
    parts = np.concatenate([int8_linear(x[i:i + 3], w, super_blocks=super_blocks)
                            for i in range(0, len(x), 3)])
    assert np.array_equal(whole, parts), "the VNNI kernel's result depends on the rows a call holds"
    return whole


@needs_amx
@pytest.mark.parametrize("qtype,factored", FORMS)
def test_amx_equals_vnni_bit_for_bit(qtype, factored):
    rng = np.random.default_rng(3)
    # 3 row tiles; K: 9 steps of 64 (an odd count, as SmolLM2's 576) or 3 K-quant super-blocks
    shape = (48, 768 if qtype.endswith("_K") else 576)
    w = tiles(repack(random_raw(qtype, shape, rng), qtype, shape, factored=factored))
    assert (w.scale_super is not None) == factored
    for t in TOKENS:
        x = rng.standard_normal((t, shape[1])).astype(np.float32) * np.float32(4.0)
        want = on_vnni(x, w)
        whole = t // AMX_TOKENS * AMX_TOKENS
        for parallel in (False, True):
            if whole and w.kind in AMX_KINDS:  # the tiles alone (u6: VNNI only)
                got = np.full((whole, shape[0]), np.nan, np.float32)
                amx_linear(x[:whole], w, got, parallel)
                assert np.array_equal(got, want[:whole]), f"{qtype} factored={factored} T={t} {parallel=}"
            # what the model calls: whole groups of 16 on the tiles (32-weight sub-blocks), the rest on VNNI
            assert np.array_equal(tiles_linear(x, w, parallel=parallel), want)


@needs_amx
def test_the_tiles_take_whole_groups_of_16_rows_only():
    rng = np.random.default_rng(4)
    w = tiles(repack(random_raw("Q4_0", (32, 256), rng), "Q4_0", (32, 256)))
    x = rng.standard_normal((17, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="whole groups of 16"):
        amx_linear(x, w, np.empty((17, 32), np.float32), False)
    out = np.full((18, 32), -7.0, np.float32)
    tiles_linear(x, w, out[:17])                  # 16 rows on the tiles, 1 on VNNI, into a view
    assert np.array_equal(out[:17], on_vnni(x, w)) and np.all(out[17] == -7.0)


def test_without_the_tile_permission_the_vnni_kernel_runs(monkeypatch):
    # Linux grants only dynamically enabled features: XTILECFG (17) is refused, with EINVAL
    assert not request_tile_permission(XFEATURE_XTILEDATA - 1)
    if not has_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI: no int8 kernel runs at all")
    rng = np.random.default_rng(5)
    w = tiles(repack(random_raw("Q8_0", (16, 128), rng), "Q8_0", (16, 128)))
    x = rng.standard_normal((40, 128)).astype(np.float32)
    want = on_vnni(x, w)
    monkeypatch.setattr(amx_kernels, "has_amx", lambda: False)
    assert np.array_equal(tiles_linear(x, w), want)
    with pytest.raises(RuntimeError, match="has_amx"):  # never a tile instruction without it (SIGILL)
        amx_linear(x, w, np.empty((40, 16), np.float32), False)
