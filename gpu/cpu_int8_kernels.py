"""``y = x @ W.T`` with int8 activations and AVX-512 VNNI integer dot products (llama.cpp's CPU path).

gpu/cpu_quant_kernels.py dequantizes each weight to float32 and multiplies in float32: 16
multiply-adds an instruction, so its decode kernels are bound by arithmetic at 12-21 G weights/s
a thread, below what memory delivers. Here each token row is quantized to int8 in blocks of 32
(one float32 scale a block, as llama.cpp's q8 activations), and ``vpdpbusd`` multiplies 64
unsigned weight bytes by 64 signed activation bytes into 16 int32 sums in one instruction. The
weights stay exactly as gpu/quant.py packs them:

- ``u4`` (nibbles in 64-weight groups): 32 bytes unpack with one AND and one shift into the 64
  weights of two 32-weight sub-blocks, in weight order, already unsigned (0..15);
- ``i8`` (centred int8): XOR 0x80 turns each byte into ``q + 128`` (0..255), unsigned; the
  ``-128 * sum(x)`` this adds is folded into the block's offset term below.

For a sub-block of ``b`` weights (16 or 32) with weight = ``s * (u - z) + m`` (z = 128 for i8, 0
for u4) and an activation block ``x = dx * xq``::

    sum(w * x) = s * dx * sum(u * xq) + (m - z * s) * (dx * sum(xq))

The integer sums are exact; the float32 part is a handful of multiply-adds per 64 weights. So
the result equals ``dequantize(W) @ (dx * xq).T`` within float32 rounding (tests/test_int8_kernels.py
checks it in float64), and differs from the float32 path by the activations' int8 rounding, as
llama.cpp's does. EngineConfig ``cpu_int8_activations`` chooses the path (docs/bench_quant.md).

The kernels are LLVM IR written here (Numba ``@intrinsic``): LLVM does not form ``vpdpbusd``
from a Numba loop. They exist only on a CPU with AVX-512 VNNI (``has_vnni``); elsewhere the
float kernels run.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ringserve.gpu.cpu_linear import TASKS_PER_THREAD
from ringserve.gpu.quant import QuantWeight

ACT_BLOCK = 32           # activation weights per int8 scale (llama.cpp's q8_0 / q8_1)
STEP = 64                # weights per vpdpbusd (64 bytes: one zmm register)
TOKEN_TILE = 4           # token rows sharing each unpacked weight register
INT8_KINDS = ("i8", "u4")

_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()


@functools.cache
def has_vnni() -> bool:
    """This CPU runs AVX-512 VNNI (and BW for the byte shuffles): the only place these kernels exist."""
    import llvmlite.binding as llvm
    features = set(llvm.get_host_cpu_features().flatten().split(","))
    return {"+avx512vnni", "+avx512bw", "+avx512f"} <= features


def supports(w: QuantWeight) -> bool:
    """A weight these kernels multiply: an integer kind whose rows are whole 64-weight steps."""
    return w.kind in INT8_KINDS and w.shape[1] % STEP == 0 and w.block in (16, 32)


# ---- activations ---------------------------------------------------------------------------------

class Int8Rows(NamedTuple):
    """Token rows x [T, K] as int8 blocks of 32: x ~= scale * q, blockwise."""
    q: np.ndarray       # int8 [T, K]
    scale: np.ndarray   # float32 [T, K / 32]: dx = max|x| / 127 of the block
    sum16: np.ndarray   # float32 [T, K / 16]: dx * sum(q) over each 16 (offset terms of 16-weight sub-blocks)
    sum32: np.ndarray   # float32 [T, K / 32]: the same over each 32


@njit(cache=True, nogil=True, error_model="numpy")
def _quantize(x, q, scale, sum16, sum32):  # pragma: no cover - compiled
    for t in range(x.shape[0]):
        for b in range(scale.shape[1]):
            lo = b * ACT_BLOCK
            amax = np.float32(0.0)
            for j in range(ACT_BLOCK):
                amax = max(amax, abs(x[t, lo + j]))
            d = amax / np.float32(127.0)
            # NOTE: a division, not a multiply by 1 / d: that overflows to inf for a subnormal d
            div = d if d > 0 else np.float32(1.0)
            s0 = s1 = np.int32(0)
            for j in range(ACT_BLOCK):
                v = x[t, lo + j] / div
                # NOTE: round half away from zero, as llama.cpp's roundf (|v| <= 127: no overflow)
                r = np.int32(v + np.float32(0.5)) if v >= 0 else -np.int32(np.float32(0.5) - v)
                q[t, lo + j] = r
                if j < 16:
                    s0 += r
                else:
                    s1 += r
            scale[t, b] = d
            sum16[t, 2 * b] = d * np.float32(s0)
            sum16[t, 2 * b + 1] = d * np.float32(s1)
            sum32[t, b] = d * np.float32(s0 + s1)


def quantize_rows(x: np.ndarray) -> Int8Rows:
    """float32 [T, K] (K a multiple of 32) -> its int8 blocks."""
    t, k = x.shape
    rows = Int8Rows(np.empty((t, k), np.int8), np.empty((t, k // ACT_BLOCK), np.float32),
                    np.empty((t, k // 16), np.float32), np.empty((t, k // ACT_BLOCK), np.float32))
    _quantize(np.ascontiguousarray(x, dtype=np.float32), *rows)
    return rows


# ---- the dot-product kernel, in LLVM IR ----------------------------------------------------------

def _vec(ty: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(ty, n)


def _row_ptr(context, builder, aty, val, row):
    """Pointer to element [row, 0] of a 2-D array (strides in bytes), as a byte pointer."""
    ary = context.make_array(aty)(context, builder, val)
    stride = builder.extract_value(ary.strides, 0)
    base = builder.bitcast(ary.data, _I8.as_pointer())
    return builder.gep(base, [builder.mul(row, stride)])


def _load(builder, ptr, index, vty: ir.VectorType):
    """The index-th vty after a byte pointer (unaligned)."""
    return builder.load(builder.gep(builder.bitcast(ptr, vty.as_pointer()), [index]), align=1)


def _spread(builder, v, n_in: int):
    """<n_in x float> -> <16 x float>: lane i of 16 gets element i * n_in / 16 (each of a
    vpdpbusd's 16 int32 sums covers 4 weights; a sub-block of 64 / n_in weights covers 16 / n_in)."""
    mask = ir.Constant(_vec(_I32, 16), [i * n_in // 16 for i in range(16)])
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), mask)


def _intrinsic_fn(builder, name: str, fnty: ir.FunctionType):
    mod = builder.module
    fn = mod.globals.get(name)
    return fn if fn is not None else ir.Function(mod, fnty, name)


def _dot_codegen(kind: str, block: int, tokens: int, with_offset: bool):
    """IR for: out[t] = W[n] . x[t0 + t] for `tokens` rows, over K / 64 steps of 64 weights."""
    per_step = STEP // block  # weight sub-blocks a step
    v16f, v16i, v64b = _vec(_F32, 16), _vec(_I32, 16), _vec(_I8, 64)

    def codegen(context, builder, sig, args):
        q, s, m, xq, xd, xs, n, t0 = args[:8]
        qty, sty, mty, xqty, xdty, xsty = sig.args[:6]
        k = builder.extract_value(context.make_array(xqty)(context, builder, xq).shape, 1)
        steps = builder.udiv(k, ir.Constant(_I64, STEP))
        qrow = _row_ptr(context, builder, qty, q, n)
        srow = _row_ptr(context, builder, sty, s, n)
        mrow = _row_ptr(context, builder, mty, m, n) if with_offset else None
        tok = [builder.add(t0, ir.Constant(_I64, t)) for t in range(tokens)]
        xrows = [_row_ptr(context, builder, xqty, xq, r) for r in tok]
        drows = [_row_ptr(context, builder, xdty, xd, r) for r in tok]
        srows = [_row_ptr(context, builder, xsty, xs, r) for r in tok]
        vpdpbusd = _intrinsic_fn(builder, "llvm.x86.avx512.vpdpbusd.512",
                                 ir.FunctionType(v16i, [v16i, v64b, v64b]))

        entry = builder.block
        loop = builder.append_basic_block("int8_dot_step")
        done = builder.append_basic_block("int8_dot_done")
        builder.branch(loop)
        builder.position_at_end(loop)
        g = builder.phi(_I64)
        g.add_incoming(ir.Constant(_I64, 0), entry)
        vps = _vec(_F32, per_step)
        acc = [builder.phi(v16f) for _ in range(tokens)]
        macc = [builder.phi(vps) for _ in range(tokens)]
        for a in acc:
            a.add_incoming(ir.Constant(v16f, [0.0] * 16), entry)
        for a in macc:
            a.add_incoming(ir.Constant(vps, [0.0] * per_step), entry)

        # the step's 64 weights as unsigned bytes, in weight order
        if kind == "u4":
            packed = _load(builder, qrow, g, _vec(_I8, 32))
            lo = builder.and_(packed, ir.Constant(_vec(_I8, 32), [15] * 32))
            hi = builder.lshr(packed, ir.Constant(_vec(_I8, 32), [4] * 32))
            u = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 64), list(range(64))))
            zero_point = 0.0
        else:
            u = builder.xor(_load(builder, qrow, g, v64b), ir.Constant(v64b, [-128] * 64))  # q + 128
            zero_point = 128.0
        sv = _load(builder, srow, g, vps)  # the step's sub-block scales
        s16 = _spread(builder, sv, per_step)
        mz = builder.fmul(sv, ir.Constant(vps, [-zero_point] * per_step), flags=["fast"])  # m - z * s
        if with_offset:
            mz = builder.fadd(mz, _load(builder, mrow, g, vps), flags=["fast"])
        elif kind == "u4":
            mz = None  # nibbles without a minimum: no offset term
        g_next = builder.add(g, ir.Constant(_I64, 1))
        acc_next, macc_next = [], []
        for t in range(tokens):
            xv = _load(builder, xrows[t], g, v64b)
            dots = builder.call(vpdpbusd, [ir.Constant(v16i, [0] * 16), u, xv])
            dx = _spread(builder, _load(builder, drows[t], g, _vec(_F32, 2)), 2)
            scale = builder.fmul(s16, dx, flags=["fast"])
            prod = builder.fmul(builder.sitofp(dots, v16f), scale, flags=["fast"])
            acc_next.append(builder.fadd(acc[t], prod, flags=["fast"]))
            if mz is None:
                macc_next.append(macc[t])
            else:
                sums = _load(builder, srows[t], g, vps)
                term = builder.fmul(mz, sums, flags=["fast"])
                macc_next.append(builder.fadd(macc[t], term, flags=["fast"]))
            acc[t].add_incoming(acc_next[t], loop)
            macc[t].add_incoming(macc_next[t], loop)
        g.add_incoming(g_next, loop)
        builder.cbranch(builder.icmp_unsigned("<", g_next, steps), loop, done)

        builder.position_at_end(done)
        r16 = _intrinsic_fn(builder, "llvm.vector.reduce.fadd.v16f32",
                            ir.FunctionType(_F32, [_F32, v16f]))
        rps = _intrinsic_fn(builder, f"llvm.vector.reduce.fadd.v{per_step}f32",
                            ir.FunctionType(_F32, [_F32, vps]))
        out = []
        for t in range(tokens):
            total = builder.call(r16, [ir.Constant(_F32, 0.0), acc_next[t]], fastmath=("reassoc",))
            offset = builder.call(rps, [ir.Constant(_F32, 0.0), macc_next[t]], fastmath=("reassoc",))
            out.append(builder.fadd(total, offset))
        return context.make_tuple(builder, sig.return_type, out)
    return codegen


def _dot_rows_typing(typingctx, q, s, m, xq, xd, xs, n, t0, tokens, block):
    """(W[n] . x[t0 + t] for t < tokens) as a tuple of float32. q: the weight's plane (int8, or
    uint8 nibbles), s / m: its sub-block scale and offset planes (m None: no offset), xq / xd /
    xs: Int8Rows' q, scale and the sums at the weight's sub-block size; tokens (1..TOKEN_TILE)
    and block (16 or 32): literals, one kernel each."""
    if not isinstance(tokens, types.IntegerLiteral) or not isinstance(block, types.IntegerLiteral):
        return None
    count = tokens.literal_value
    kind = "u4" if q.dtype == types.uint8 else "i8"
    sig = types.UniTuple(types.float32, count)(q, s, m, xq, xd, xs, n, t0, tokens, block)
    return sig, _dot_codegen(kind, block.literal_value, count, m != types.none)


_dot_rows: Any = intrinsic(_dot_rows_typing)


# ---- drivers -------------------------------------------------------------------------------------

def _rows_for(block: int):
    """out[:, lo:hi] for weight rows lo..hi: each row against token tiles of TOKEN_TILE (the
    row's bytes stay in L1 across its tiles; the activations, T x K bytes, in L2)."""
    @njit(inline="always")
    def rows(q, s, m, xq, xd, xs, out, lo, hi):  # pragma: no cover - compiled
        num_tokens = xq.shape[0]
        for n in range(lo, hi):
            t = 0
            while t + 4 <= num_tokens:
                r4 = _dot_rows(q, s, m, xq, xd, xs, n, t, 4, block)
                out[t, n], out[t + 1, n], out[t + 2, n], out[t + 3, n] = r4
                t += 4
            left = num_tokens - t
            if left == 3:
                r3 = _dot_rows(q, s, m, xq, xd, xs, n, t, 3, block)
                out[t, n], out[t + 1, n], out[t + 2, n] = r3
            elif left == 2:
                r2 = _dot_rows(q, s, m, xq, xd, xs, n, t, 2, block)
                out[t, n], out[t + 1, n] = r2
            elif left == 1:
                out[t, n] = _dot_rows(q, s, m, xq, xd, xs, n, t, 1, block)[0]
    return rows


def _drivers(block: int):
    rows = _rows_for(block)

    @njit(cache=False, nogil=True, fastmath=_FASTMATH, error_model="numpy")
    def serial(q, s, m, xq, xd, xs, out):  # pragma: no cover - compiled
        rows(q, s, m, xq, xd, xs, out, 0, out.shape[1])

    @njit(cache=False, nogil=True, fastmath=_FASTMATH, error_model="numpy", parallel=True)
    def parallel(q, s, m, xq, xd, xs, out, tasks):  # pragma: no cover - compiled
        n = out.shape[1]
        for i in prange(tasks):
            rows(q, s, m, xq, xd, xs, out, i * n // tasks, (i + 1) * n // tasks)
    return serial, parallel


_SERIAL16, _PARALLEL16 = _drivers(16)
_SERIAL32, _PARALLEL32 = _drivers(32)


def int8_linear(x: Int8Rows, w: QuantWeight, out: np.ndarray | None = None, *,
                parallel: bool = False) -> np.ndarray:
    """x quantized [T, in] (quantize_rows), W packed [out, in] (supports(w)) -> float32 [T, out]."""
    assert w.scale is not None and supports(w), (w.qtype, w.kind, w.shape)
    t, (n, _) = x.q.shape[0], w.shape
    if out is None:
        out = np.empty((t, n), dtype=np.float32)
    sums = x.sum16 if w.block == 16 else x.sum32
    args = (w.q, w.scale, w.offset, x.q, x.scale, sums, out)
    if parallel:
        tasks = TASKS_PER_THREAD * numba.get_num_threads()
        (_PARALLEL16 if w.block == 16 else _PARALLEL32)(*args, tasks)
    else:
        (_SERIAL16 if w.block == 16 else _SERIAL32)(*args)
    return out
