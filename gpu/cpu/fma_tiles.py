"""The two products of the tiled prefill attention (gpu/cpu/prefill_attention.py) as register-blocked
float32 micro-kernels, written in LLVM IR through Numba @intrinsics as gpu/cpu/int8_kernels.py is.

Numba's own loops vectorized them over head_dim with one accumulator per (row, key) pair: eight
horizontal sums for every eight dot products, and every operand loaded for at most four
multiply-adds. Here each product keeps 16 vectors of 16 float32 accumulators in registers (a
BLAS micro-kernel's shape) and streams the other operand past them:

- scores ``s[i, :] = qs[i] . kt`` (kt the key block transposed, [head_dim, KEY_BLOCK = 32]): 4 query
  rows x the block's 32 keys (two vectors a row), the even and the odd head_dim elements in sums
  of their own (added at the end: half the rounding of one running sum, as the loop kernel's
  vector lanes have); per element, two key vectors and 4 broadcast query values make 8 fused
  multiply-adds;
- update ``acc[i] += s[i, :] @ vb`` (vb [KEY_BLOCK, head_dim]): 16 / (head_dim / 16) accumulator
  rows x head_dim; per key, head_dim / 16 value vectors and one broadcast probability a row.

Both are bound by the multiply-add units, not by loads.
"""
from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ringserve.gpu.cpu.int8_kernels import _const, _function, _load, _row_ptr, _splat, _vec

LANES = 16               # float32 lanes of a 512-bit vector
SCORE_ROWS = 4           # query rows a scores step keeps in registers (x 2 vectors of keys x 2 sums)
ACCUMULATORS = 16        # vectors an update step keeps in registers
KEY_VECTORS = 2          # KEY_BLOCK (32) keys as vectors of 16

_F32 = ir.FloatType()
_V16F = _vec(_F32, LANES)


def _fma(builder, a, b, c):
    fn = _function(builder, "llvm.fma.v16f32", ir.FunctionType(_V16F, [_V16F, _V16F, _V16F]))
    return builder.call(fn, [a, b, c])


def _counted_loop(builder, count, body) -> None:
    """for n in range(count): carried = body(n, carried), carried a list of values (phi nodes),
    starting as body's `initial` attribute; leaves the builder after the loop with the final
    values in body.result."""
    entry = builder.block
    loop = builder.append_basic_block("fma_tile_loop")
    done = builder.append_basic_block("fma_tile_done")
    builder.branch(loop)
    builder.position_at_end(loop)
    n = builder.phi(ir.IntType(64))
    n.add_incoming(_const(builder, 0), entry)
    carried = [builder.phi(v.type) for v in body.initial]
    for phi, v in zip(carried, body.initial, strict=True):
        phi.add_incoming(v, entry)
    out = body(n, carried)
    end = builder.block
    for phi, v in zip(carried, out, strict=True):
        phi.add_incoming(v, end)
    n_next = builder.add(n, _const(builder, 1))
    n.add_incoming(n_next, end)
    builder.cbranch(builder.icmp_unsigned("<", n_next, count), loop, done)
    builder.position_at_end(done)
    body.result = out


def _scores_codegen(rows: int):
    def codegen(context, builder, sig, args):
        qs, kt, s, i0 = args[:4]
        qty, ktty, sty = sig.args[:3]
        head_dim = builder.extract_value(context.make_array(qty)(context, builder, qs).shape, 1)
        qrow = [builder.bitcast(_row_ptr(context, builder, qty, qs, builder.add(i0, _const(builder, r))),
                                _F32.as_pointer()) for r in range(rows)]
        width = rows * KEY_VECTORS

        def body(n, acc):
            out = list(acc)
            for half in range(2):  # NOTE: even and odd elements in sums of their own (halves the rounding)
                d = builder.add(builder.mul(n, _const(builder, 2)), _const(builder, half))
                krow = _row_ptr(context, builder, ktty, kt, d)
                keys = [_load(builder, krow, _const(builder, v), _V16F) for v in range(KEY_VECTORS)]
                for r in range(rows):
                    x = _splat(builder, builder.load(builder.gep(qrow[r], [d]), align=4), LANES)
                    for v in range(KEY_VECTORS):
                        at = half * width + r * KEY_VECTORS + v
                        out[at] = _fma(builder, x, keys[v], acc[at])
            return out
        body.initial = [ir.Constant(_V16F, [0.0] * LANES)] * (2 * width)  # type: ignore[attr-defined]
        _counted_loop(builder, builder.udiv(head_dim, _const(builder, 2)), body)
        sums = body.result  # type: ignore[attr-defined]
        for r in range(rows):
            srow = _row_ptr(context, builder, sty, s, builder.add(i0, _const(builder, r)))
            for v in range(KEY_VECTORS):
                dst = builder.gep(builder.bitcast(srow, _V16F.as_pointer()), [_const(builder, v)])
                builder.store(builder.fadd(sums[r * KEY_VECTORS + v], sums[width + r * KEY_VECTORS + v]), dst,
                              align=4)
        return context.get_dummy_value()
    return codegen


def _scores_typing(typingctx, qs, kt, s, i0, rows):
    """s[i0 + r, :32] = qs[i0 + r] . kt[:, :32] for r < rows (a literal). qs float32 [R, D], kt
    float32 [D, 32], s float32 [R, 32], all C-contiguous rows."""
    if not isinstance(rows, types.IntegerLiteral):
        return None
    return types.none(qs, kt, s, i0, rows), _scores_codegen(rows.literal_value)


def _update_codegen(rows: int, vectors: int):
    def codegen(context, builder, sig, args):
        s, vb, acc, i0 = args[:4]
        sty, vbty, accty = sig.args[:3]
        keys = builder.extract_value(context.make_array(vbty)(context, builder, vb).shape, 0)
        arow = [builder.bitcast(_row_ptr(context, builder, accty, acc, builder.add(i0, _const(builder, r))),
                                _V16F.as_pointer()) for r in range(rows)]
        srow = [builder.bitcast(_row_ptr(context, builder, sty, s, builder.add(i0, _const(builder, r))),
                                _F32.as_pointer()) for r in range(rows)]
        initial = [builder.load(builder.gep(arow[r], [_const(builder, v)]), align=4)
                   for r in range(rows) for v in range(vectors)]

        def body(j, a):
            vrow = _row_ptr(context, builder, vbty, vb, j)
            values = [_load(builder, vrow, _const(builder, v), _V16F) for v in range(vectors)]
            out = list(a)
            for r in range(rows):
                p = _splat(builder, builder.load(builder.gep(srow[r], [j]), align=4), LANES)
                for v in range(vectors):
                    out[r * vectors + v] = _fma(builder, p, values[v], a[r * vectors + v])
            return out
        body.initial = initial  # type: ignore[attr-defined]
        _counted_loop(builder, keys, body)
        for r in range(rows):
            for v in range(vectors):
                builder.store(body.result[r * vectors + v], builder.gep(arow[r], [_const(builder, v)]),  # type: ignore[attr-defined]
                              align=4)
        return context.get_dummy_value()
    return codegen


def _update_typing(typingctx, s, vb, acc, i0, rows, vectors):
    """acc[i0 + r] += s[i0 + r, :K] @ vb for r < rows, K = vb.shape[0]; vectors = head_dim / 16
    (literals both). s float32 [R, >= K], vb float32 [K, D], acc float32 [R, D]."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (rows, vectors)):
        return None
    sig = types.none(s, vb, acc, i0, rows, vectors)
    return sig, _update_codegen(rows.literal_value, vectors.literal_value)


scores_tile: Any = intrinsic(_scores_typing)
update_tile: Any = intrinsic(_update_typing)
