"""The int8 linears of gpu/cpu/int8_kernels.py through AMX tiles, for many token rows at once.

``vpdpbusd`` advances 16 weight rows by 4 weights for one token: 64 multiply-adds an instruction,
~26 a cycle a core. At 16-512 token rows (a prefill chunk, a batch of 16 streams) the int8
linears are bound by it. AMX's ``tdpbsud`` multiplies a tile of 16 token rows x K signed bytes
by K x 16 unsigned weight bytes into 16 x 16 int32 sums: 16 K multiply-adds in one instruction
(1024 a cycle at K = 64).

Int8Weight's tiles are already AMX's B layout: a 64-weight step of a 16-row tile is 16 groups of
4 weights x 16 rows x 4 bytes, 1 KB contiguous, i.e. B rows of 64 bytes (for ``i8``; ``u4``'s
8 nibble vectors unpack with an AND and a shift into a 1 KB scratch: low nibbles are k 0..31,
high k 32..63). So no second copy of the weights. A is 16 token rows of the int8 activations
(stride K; tiles_linear hands AMX whole groups of 16 rows, the rest to VNNI). Each sub-block
(16 or 32 weights) gets its own C tile, so its integer sum stays separate for its float scale;
C goes to a stack scratch and int8_kernels.float_terms, the VNNI kernel's own epilogue IR, adds
the float terms: the integer sums are exact in both, and the float ops are the same in the same
order, so the result equals the VNNI kernel's bit for bit (an output must not change with the
tokens a step holds).

A process must ask Linux for the tile state before its first tile instruction (else SIGILL):
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, once; ``has_amx`` asks. The kernels are
compiled only where it answered yes: a Numba cache keys its entries on the CPU's name and
features, so one built with AMX is never loaded on a CPU without it.
"""
from __future__ import annotations

import ctypes
import functools
import platform
import sys
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ringserve.gpu.cpu.int8_kernels import (
    _F32,
    _I8,
    _I32,
    _I64,
    STEP,
    TILE_ROWS,
    Int8Weight,
    _const,
    _function,
    _load,
    _quantize,
    _row_ptr,
    _vec,
    float_terms,
    int8_linear,
    scratch_rows,
)
from ringserve.gpu.cpu.tasks import claim, linear_tasks

# NOTE: _quantize is compiled into the drivers below, and Numba's cache keys on this file alone: a
# change to it (2026-12-06: its loops vectorized) comes with an edit here, or old caches stay

AMX_TOKENS = 16           # token rows a tile multiplies (A's and C's rows)
# the sub-block sizes tiles_linear runs on AMX (docs/bench_quant.md: Q6_K's 16-weight sub-blocks
# measured slower there, four C tiles a step)
AMX_BLOCKS = (32,)
AMX_KINDS = ("i8", "u4")  # u6 (6-bit quants: nibbles + 2-bit plane) stays on VNNI: not unpacked here
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158      # x86-64

_VOID, _PTR = ir.VoidType(), _I8.as_pointer()


def request_tile_permission(feature: int = XFEATURE_XTILEDATA) -> bool:
    """Ask Linux for this process's permission to use the tile state of `feature` (x86-64 only);
    whether it was granted (or already was). Process-wide, inherited by forked children."""
    if sys.platform != "linux" or platform.machine() != "x86_64":  # NOTE: 158 is arch_prctl on x86-64 only
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    args = (ctypes.c_long(v) for v in (SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, feature))  # syscall(long, ...)
    return libc.syscall(*args) == 0


@functools.cache
def has_amx() -> bool:
    """This CPU has AMX-INT8 and Linux let this process use its tiles (the request is made here)."""
    import llvmlite.binding as llvm
    features = set(llvm.get_host_cpu_features().flatten().split(","))
    return {"+amx-int8", "+amx-tile"} <= features and request_tile_permission()


def tile_config(block: int) -> np.ndarray:
    """The 64-byte tile configuration (palette 1) of the kernel for `block`-weight sub-blocks:
    C tiles 0..subs-1 (16 tokens x 16 int32), then two A tiles (16 tokens x block bytes) and
    two B tiles (block / 4 x 64 bytes), alternated between sub-blocks."""
    subs = STEP // block
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    for i in range(subs):
        colsb[i], rows[i] = TILE_ROWS * 4, AMX_TOKENS
    for i in range(subs, subs + 2):
        colsb[i], rows[i] = block, AMX_TOKENS
        colsb[i + 2], rows[i + 2] = TILE_ROWS * 4, block // 4
    return cfg


# ---- the tile instructions, in LLVM IR -----------------------------------------------------------

def _tmm(index: int):
    return ir.Constant(_I8, index)


def _tile_load(builder, tmm: int, ptr, stride) -> None:
    fn = _function(builder, "llvm.x86.tileloadd64", ir.FunctionType(_VOID, [_I8, _PTR, _I64]))
    builder.call(fn, [_tmm(tmm), builder.bitcast(ptr, _PTR), stride])


def _tile_store(builder, tmm: int, ptr, stride) -> None:
    fn = _function(builder, "llvm.x86.tilestored64", ir.FunctionType(_VOID, [_I8, _PTR, _I64]))
    builder.call(fn, [_tmm(tmm), builder.bitcast(ptr, _PTR), stride])


def _tile_zero(builder, tmm: int) -> None:
    builder.call(_function(builder, "llvm.x86.tilezero", ir.FunctionType(_VOID, [_I8])), [_tmm(tmm)])


def _tile_dot(builder, c: int, a: int, b: int) -> None:
    """C += A (signed bytes) . B (unsigned bytes), in fours into int32."""
    fn = _function(builder, "llvm.x86.tdpbsud", ir.FunctionType(_VOID, [_I8, _I8, _I8]))
    builder.call(fn, [_tmm(c), _tmm(a), _tmm(b)])


def _load_config_typing(typingctx, cfg):
    """ldtilecfg: this thread's tile shapes (tile_config)."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        fn = _function(builder, "llvm.x86.ldtilecfg", ir.FunctionType(_VOID, [_PTR]))
        builder.call(fn, [builder.bitcast(data, _PTR)])
        return context.get_dummy_value()
    return types.none(cfg), codegen


def _release_typing(typingctx):
    """tilerelease: the thread's tiles back to their initial state (no tile state to save)."""
    def codegen(context, builder, sig, args):
        builder.call(_function(builder, "llvm.x86.tilerelease", ir.FunctionType(_VOID, [])), [])
        return context.get_dummy_value()
    return types.none(), codegen


_load_config: Any = intrinsic(_load_config_typing)
_release: Any = intrinsic(_release_typing)


def _unpack_nibbles(builder, qtile, g, scratch) -> None:
    """Step g's 8 nibble vectors as 16 B rows of bytes 0..15 in scratch: low nibbles (k 0..31)
    then high (k 32..63)."""
    v64b = _vec(_I8, 64)
    low = ir.Constant(v64b, [15] * 64)
    first = builder.mul(g, _const(builder, 8))
    rows = builder.bitcast(scratch, v64b.as_pointer())
    for v in range(8):
        packed = _load(builder, qtile, builder.add(first, _const(builder, v)), v64b)
        builder.store(builder.and_(packed, low), builder.gep(rows, [_const(builder, v)]), align=64)
        high = builder.and_(builder.lshr(packed, ir.Constant(v64b, [4] * 64)), low)
        builder.store(high, builder.gep(rows, [_const(builder, 8 + v)]), align=64)


def _amx_codegen(kind: str, block: int, form: str, super_form: str):
    """IR for: out[t0 + t, 16 r: 16 r + 16] = W[16 r: 16 r + 16] . x[t0 + t] for t < 16."""
    subs = STEP // block
    v16f, v16i = _vec(_F32, 16), _vec(_I32, 16)
    zero_point = 128.0 if kind == "i8" else 0.0
    tile_bytes = AMX_TOKENS * TILE_ROWS * 4

    def codegen(context, builder, sig, args):
        q, (xq, xd, xs, out, r, t0) = args[0], args[5:11]
        qty, (xqty, xdty, xsty, outty) = sig.args[0], sig.args[5:9]
        xary = context.make_array(xqty)(context, builder, xq)
        steps = builder.udiv(builder.extract_value(xary.shape, 1), _const(builder, STEP))
        xstride = builder.extract_value(xary.strides, 0)
        qtile = _row_ptr(context, builder, qty, q, r)
        planes = tuple(None if aty == types.none else _row_ptr(context, builder, aty, a, r)
                       for aty, a in zip(sig.args[1:5], args[1:5], strict=True))
        rows = [builder.add(t0, _const(builder, t)) for t in range(AMX_TOKENS)]

        def per_token(aty, a):
            return [_row_ptr(context, builder, aty, a, i) for i in rows]
        drow, srow, orow = per_token(xdty, xd), per_token(xsty, xs), per_token(outty, out)
        xrow = _row_ptr(context, builder, xqty, xq, t0)
        # NOTE: in the function's entry block (alloca_once), not per step: the C tiles' and the
        # unpacked nibbles' scratch
        cbuf = cgutils.alloca_once(builder, ir.ArrayType(_I8, 2 * subs * tile_bytes))
        cbuf.align = 64
        bbuf = cgutils.alloca_once(builder, ir.ArrayType(_I8, STEP * TILE_ROWS))
        bbuf.align = 64
        cbytes, bbytes = builder.bitcast(cbuf, _PTR), builder.bitcast(bbuf, _PTR)
        b_stride = _const(builder, TILE_ROWS * 4)

        sums_bytes = subs * tile_bytes

        def int_sums(step):
            """Step `step`'s C tiles into the half of cbuf its parity picks."""
            x_step = builder.gep(xrow, [builder.mul(step, _const(builder, STEP))])
            if kind == "u4":
                _unpack_nibbles(builder, qtile, step, bbytes)
                weights = bbytes
            else:  # NOTE: the i8 tile's step is B as it is: 16 rows of 64 bytes
                weights = builder.gep(qtile, [builder.mul(step, _const(builder, STEP * TILE_ROWS))])
            for sb in range(subs):
                a, b = subs + sb % 2, subs + 2 + sb % 2
                _tile_zero(builder, sb)
                _tile_load(builder, a, builder.gep(x_step, [_const(builder, sb * block)]), xstride)
                _tile_load(builder, b, builder.gep(weights, [_const(builder, sb * block * TILE_ROWS)]),
                           b_stride)
                _tile_dot(builder, sb, a, b)
            half = builder.mul(builder.and_(step, _const(builder, 1)), _const(builder, sums_bytes))
            for sb in range(subs):
                at = builder.add(half, _const(builder, sb * tile_bytes))
                _tile_store(builder, sb, builder.gep(cbytes, [at]), b_stride)

        # PERF: the tiles run a step ahead of the float terms: step g + 1's C tiles are stored while
        # the vector units add step g's (a tile's sums reach the vector registers through memory)
        int_sums(_const(builder, 0))
        entry = builder.block
        loop = builder.append_basic_block("amx_tile_step")
        done = builder.append_basic_block("amx_tile_done")
        builder.branch(loop)
        builder.position_at_end(loop)
        g = builder.phi(_I64)
        g.add_incoming(_const(builder, 0), entry)
        acc = [builder.phi(v16f) for _ in range(AMX_TOKENS)]
        g_next = builder.add(g, _const(builder, 1))
        # NOTE: the last step computes itself again into the other half (no branch in the loop)
        int_sums(builder.select(builder.icmp_unsigned("<", g_next, steps), g_next, g))
        ready = builder.gep(cbytes, [builder.mul(builder.and_(g, _const(builder, 1)),
                                                 _const(builder, sums_bytes))])
        # every sum loaded before the float terms, as the VNNI kernel's come before them
        sums = [[_load(builder, ready, _const(builder, sb * AMX_TOKENS + t), v16i) for sb in range(subs)]
                for t in range(AMX_TOKENS)]
        totals = float_terms(builder, form, super_form, planes, g, sums, list(acc), drow, srow, block,
                             zero_point)
        for a_, total in zip(acc, totals, strict=True):
            a_.add_incoming(ir.Constant(v16f, [0.0] * 16), entry)
            a_.add_incoming(total, loop)
        g.add_incoming(g_next, loop)
        builder.cbranch(builder.icmp_unsigned("<", g_next, steps), loop, done)

        builder.position_at_end(done)
        for o, total in zip(orow, totals, strict=True):
            dst = builder.gep(o, [builder.mul(r, _const(builder, TILE_ROWS * 4))])
            builder.store(total, builder.bitcast(dst, v16f.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _amx_typing(typingctx, q, s, m, ss, ms, xq, xd, xs, out, r, t0, block, vectors):
    """As int8_kernels._tile_typing, for the 16 token rows from t0."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (block, vectors)):
        return None
    kind = "i8" if vectors.literal_value == 16 else "u4"
    form = {types.uint16: "f16", types.int8: "i8"}.get(s.dtype, "f32")
    super_form = "f16" if ss != types.none and ss.dtype == types.uint16 else "f32"
    sig = types.none(q, s, m, ss, ms, xq, xd, xs, out, r, t0, block, vectors)
    return sig, _amx_codegen(kind, block.literal_value, form, super_form)


_amx_tile: Any = intrinsic(_amx_typing)


# ---- drivers -------------------------------------------------------------------------------------

@njit(inline="always")
def _run(cfg, q, s, m, ss, ms, xq, xd, xs, out, lo, hi, num_tokens, block, vectors):  # pragma: no cover
    """Row tiles lo..hi against every token, 16 tokens a tile (the row tile's bytes stay in L2
    across its token tiles). The tile configuration is per thread: loaded here, released after."""
    _load_config(cfg)
    for r in range(lo, hi):
        for t0 in range(0, num_tokens, AMX_TOKENS):
            _amx_tile(q, s, m, ss, ms, xq, xd, xs, out, r, t0, block, vectors)
    _release()


@njit(inline="always")
def _split(cfg, q, s, m, ss, ms, xq, xd, xs, out, num_tokens, tasks, counter, block,
           vectors):  # pragma: no cover - compiled
    """Row tiles in `tasks` runs claimed by the threads as they come free (gpu/cpu/tasks.py)."""
    n = q.shape[0]
    counter[0] = 0
    for _ in prange(counter[1]):
        i = claim(counter)
        while i < tasks:
            _run(cfg, q, s, m, ss, ms, xq, xd, xs, out, i * n // tasks, (i + 1) * n // tasks, num_tokens,
                 block, vectors)
            i = claim(counter)


# One driver per (sub-block size, vectors a step), as int8_kernels.py's; x has T rows, the int8 rows
# T rounded up to 16.
_serial_driver = njit(cache=True, nogil=True, error_model="numpy")
_parallel_driver = njit(cache=True, nogil=True, error_model="numpy", parallel=True)


@_serial_driver
def _serial_16_16(cfg, x, q, s, m, ss, ms, xq, xd, xs16, xs32, out):  # pragma: no cover - compiled
    _quantize(x, xq, xd, xs16, xs32)
    _run(cfg, q, s, m, ss, ms, xq, xd, xs16, out, 0, q.shape[0], x.shape[0], 16, 16)


@_serial_driver
def _serial_32_16(cfg, x, q, s, m, ss, ms, xq, xd, xs16, xs32, out):  # pragma: no cover - compiled
    _quantize(x, xq, xd, xs16, xs32)
    _run(cfg, q, s, m, ss, ms, xq, xd, xs32, out, 0, q.shape[0], x.shape[0], 32, 16)


@_serial_driver
def _serial_32_8(cfg, x, q, s, m, ss, ms, xq, xd, xs16, xs32, out):  # pragma: no cover - compiled
    _quantize(x, xq, xd, xs16, xs32)
    _run(cfg, q, s, m, ss, ms, xq, xd, xs32, out, 0, q.shape[0], x.shape[0], 32, 8)


@_parallel_driver
def _parallel_16_16(cfg, x, q, s, m, ss, ms, xq, xd, xs16, xs32, out, tasks, counter):  # pragma: no cover
    _quantize(x, xq, xd, xs16, xs32)
    _split(cfg, q, s, m, ss, ms, xq, xd, xs16, out, x.shape[0], tasks, counter, 16, 16)


@_parallel_driver
def _parallel_32_16(cfg, x, q, s, m, ss, ms, xq, xd, xs16, xs32, out, tasks, counter):  # pragma: no cover
    _quantize(x, xq, xd, xs16, xs32)
    _split(cfg, q, s, m, ss, ms, xq, xd, xs32, out, x.shape[0], tasks, counter, 32, 16)


@_parallel_driver
def _parallel_32_8(cfg, x, q, s, m, ss, ms, xq, xd, xs16, xs32, out, tasks, counter):  # pragma: no cover
    _quantize(x, xq, xd, xs16, xs32)
    _split(cfg, q, s, m, ss, ms, xq, xd, xs32, out, x.shape[0], tasks, counter, 32, 8)


# (block, vectors) -> (serial, parallel)
DRIVERS = {(16, 16): (_serial_16_16, _parallel_16_16), (32, 16): (_serial_32_16, _parallel_32_16),
           (32, 8): (_serial_32_8, _parallel_32_8)}
CONFIGS = {block: tile_config(block) for block in (16, 32)}


def amx_linear(x: np.ndarray, w: Int8Weight, out: np.ndarray, parallel: bool) -> None:
    """int8_linear's out = x @ W.T through the tiles for whole groups of 16 token rows: equal to the
    VNNI kernel's bit for bit."""
    if not has_amx():  # NOTE: a tile instruction before Linux's permission is a SIGILL
        raise RuntimeError("AMX tiles are not available to this process (has_amx)")
    t, k = x.shape
    if w.kind not in AMX_KINDS or w.block not in AMX_BLOCKS:
        raise ValueError(f"{w.kind} tiles of {w.block}-weight sub-blocks are not read by the AMX kernel")
    if t % AMX_TOKENS:
        raise ValueError(f"{t} token rows are not whole groups of {AMX_TOKENS} (tiles_linear splits them)")
    rows = scratch_rows(t, k)  # NOTE: int8_linear's scratch
    serial, par = DRIVERS[(w.block, 16 if w.kind == "i8" else 8)]
    args = (CONFIGS[w.block], x, w.q, w.scale, w.offset, w.scale_super, w.offset_super, rows.q, rows.scale,
            rows.sum16, rows.sum32, out)
    if parallel:
        par(*args, *linear_tasks(len(w.q)))
    else:
        serial(*args)


def on_amx(w: Int8Weight) -> bool:
    """W's groups of 16 token rows run on AMX tiles in this process (tiles_linear); then all its
    rows take activations in blocks of 32, K-quants too."""
    return w.block in AMX_BLOCKS and w.kind in AMX_KINDS and has_amx()


def tiles_linear(x: np.ndarray, w: Int8Weight, out: np.ndarray | None = None, *,
                 parallel: bool = False) -> np.ndarray:
    """int8_kernels.int8_linear (x float32 [T, in] -> x @ W.T, float32 [T, out]), its whole groups of
    16 token rows on AMX tiles where this process has them and W has 32-weight sub-blocks, the
    rest (fewer than 16) on VNNI: the same bits either way. Such a W's activations are blocks of
    32 on both (the tiles' epilogue is float_terms), also for the K-quants, which VNNI alone
    multiplies by blocks of 256: a token's result must not depend on the rows beside it."""
    amx = on_amx(w)
    whole = len(x) // AMX_TOKENS * AMX_TOKENS
    if not (amx and whole):
        return int8_linear(x, w, out, parallel=parallel, super_blocks=not amx)
    if out is None:
        out = np.empty((len(x), w.shape[0]), dtype=np.float32)
    assert out.strides[1] == 4 and out.shape == (len(x), w.shape[0]), "whole rows of 16 columns"
    amx_linear(x[:whole], w, out[:whole], parallel)
    if whole < len(x):
        int8_linear(x[whole:], w, out[whole:], parallel=parallel, super_blocks=False)
    return out
