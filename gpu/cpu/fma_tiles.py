"""The two products of the tiled prefill attention (gpu/cpu/prefill_attention.py) as register-blocked
float32 micro-kernels, written in LLVM IR through Numba @intrinsics as gpu/cpu/int8_kernels.py is.

Numba's own loops vectorized them over head_dim with one accumulator per (row, key) pair: eight
horizontal sums for every eight dot products, and every operand loaded for at most four
multiply-adds. Here each product keeps 16 vectors of 16 float32 accumulators in registers (a
BLAS micro-kernel's shape) and streams the other operand past them:

- scores ``st[j, :] = kb[j] . qt`` (qt the tile's queries transposed, [head_dim, rows]): SCORE_KEYS
  (4) keys x 32 query rows (two vectors), the even and the odd head_dim elements in sums of their
  own (added at the end: half the rounding of one running sum); per element, two query vectors
  and 4 broadcast key values make 8 fused multiply-adds. The scores come out a key a row, so the
  softmax after them runs along the query rows: vectors of 16 rows, no horizontal max or sum;
- update ``acc[i] += st[:, i] @ vb`` (vb [KEY_BLOCK, head_dim]): 16 / (head_dim / 16) accumulator
  rows x head_dim; per key, head_dim / 16 value vectors and one broadcast probability a row.

Both are bound by the multiply-add units, not by loads.

A decode (one query token: a KV head's few query heads) has no rows to fill those vectors, so
gpu/cpu/attention.py's loop takes three kernels of its own, KEY_ROWS (16) keys a step:
``widen_rows`` (the keys' or values' cache rows as float32 vectors, the next step's rows
prefetched), ``key_scores`` (one query head: 16 partial-product vectors along head_dim, summed
across by one transpose-sum, _transpose_sums) and ``head_update`` (the update above, the
probabilities a head a row)."""
from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ringserve.gpu.cpu.int8_kernels import _const, _function, _load, _row_ptr, _splat, _vec

LANES = 16               # float32 lanes of a 512-bit vector
SCORE_KEYS = 4           # keys a scores step keeps in registers ...
ROW_VECTORS = 2          # ... against 32 query rows (x 2 sums: 16 accumulators)
SCORE_ROWS = ROW_VECTORS * LANES
ACCUMULATORS = 16        # vectors an update step keeps in registers
KEY_VECTORS = 2          # KEY_BLOCK (32) keys as vectors of 16
KEY_ROWS = LANES         # keys a decode's key_scores / head_update step takes (one vector of scores)

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


def _scores_codegen():
    def codegen(context, builder, sig, args):
        kb, qt, st, j0, i0 = args
        kbty, qtty, stty = sig.args[:3]
        head_dim = builder.extract_value(context.make_array(qtty)(context, builder, qt).shape, 0)
        krow = [builder.bitcast(_row_ptr(context, builder, kbty, kb, builder.add(j0, _const(builder, k))),
                                _F32.as_pointer()) for k in range(SCORE_KEYS)]
        width = SCORE_KEYS * ROW_VECTORS
        i0_bytes = builder.mul(i0, _const(builder, 4))

        def body(n, acc):
            out = list(acc)
            for half in range(2):  # NOTE: even and odd elements in sums of their own (halves the rounding)
                d = builder.add(builder.mul(n, _const(builder, 2)), _const(builder, half))
                qrow = builder.gep(_row_ptr(context, builder, qtty, qt, d), [i0_bytes])
                queries = [_load(builder, qrow, _const(builder, v), _V16F) for v in range(ROW_VECTORS)]
                for k in range(SCORE_KEYS):
                    x = _splat(builder, builder.load(builder.gep(krow[k], [d]), align=4), LANES)
                    for v in range(ROW_VECTORS):
                        at = half * width + k * ROW_VECTORS + v
                        out[at] = _fma(builder, x, queries[v], acc[at])
            return out
        body.initial = [ir.Constant(_V16F, [0.0] * LANES)] * (2 * width)  # type: ignore[attr-defined]
        _counted_loop(builder, builder.udiv(head_dim, _const(builder, 2)), body)
        sums = body.result  # type: ignore[attr-defined]
        for k in range(SCORE_KEYS):
            srow = _row_ptr(context, builder, stty, st, builder.add(j0, _const(builder, k)))
            dst = builder.bitcast(builder.gep(srow, [i0_bytes]), _V16F.as_pointer())
            for v in range(ROW_VECTORS):
                value = builder.fadd(sums[k * ROW_VECTORS + v], sums[width + k * ROW_VECTORS + v])
                builder.store(value, builder.gep(dst, [_const(builder, v)]), align=4)
        return context.get_dummy_value()
    return codegen


def _scores_typing(typingctx, kb, qt, st, j0, i0):
    """st[j0 + k, i0: i0 + 32] = kb[j0 + k] . qt[:, i0: i0 + 32] for k < SCORE_KEYS: kb float32
    [keys, D], qt float32 [D, P] (the tile's queries transposed), st float32 [keys, P]."""
    return types.none(kb, qt, st, j0, i0), _scores_codegen()


def _update_codegen(rows: int, vectors: int):
    def codegen(context, builder, sig, args):
        s, vb, acc, i0 = args[:4]
        sty, vbty, accty = sig.args[:3]
        keys = builder.extract_value(context.make_array(vbty)(context, builder, vb).shape, 0)
        arow = [builder.bitcast(_row_ptr(context, builder, accty, acc, builder.add(i0, _const(builder, r))),
                                _V16F.as_pointer()) for r in range(rows)]
        i0_bytes = builder.mul(i0, _const(builder, 4))
        initial = [builder.load(builder.gep(arow[r], [_const(builder, v)]), align=4)
                   for r in range(rows) for v in range(vectors)]

        def body(j, a):
            vrow = _row_ptr(context, builder, vbty, vb, j)
            values = [_load(builder, vrow, _const(builder, v), _V16F) for v in range(vectors)]
            out = list(a)
            prow = builder.bitcast(builder.gep(_row_ptr(context, builder, sty, s, j), [i0_bytes]),
                                   _F32.as_pointer())
            for r in range(rows):
                p = _splat(builder, builder.load(builder.gep(prow, [_const(builder, r)]), align=4), LANES)
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
    """acc[i0 + r] += s[:K, i0 + r] @ vb for r < rows, K = vb.shape[0]; vectors = head_dim / 16
    (literals both). s float32 [K, R] (the probabilities, a key a row), vb float32 [K, D], acc
    float32 [R, D]."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (rows, vectors)):
        return None
    sig = types.none(s, vb, acc, i0, rows, vectors)
    return sig, _update_codegen(rows.literal_value, vectors.literal_value)


def _transpose_sums(builder, partials: list) -> Any:
    """One vector whose lane j is the sum of partials[j]'s 16 lanes (LANES vectors): halving
    rounds of two two-source shuffles and an add, 45 instructions for 16 horizontal sums (each
    alone: 4 shuffles and 4 adds), the keys' order kept."""
    vectors, width = list(partials), LANES
    while width > 1:
        half, segments = width // 2, LANES // width
        lo = [seg * width + i for seg in range(segments) for i in range(half)]
        hi = [i + half for i in lo]
        vectors = [builder.fadd(builder.shuffle_vector(a, b, ir.Constant(_vec(ir.IntType(32), LANES),
                                                                         lo + [i + LANES for i in lo])),
                                builder.shuffle_vector(a, b, ir.Constant(_vec(ir.IntType(32), LANES),
                                                                         hi + [i + LANES for i in hi])))
                   for a, b in zip(vectors[0::2], vectors[1::2], strict=True)]
        width = half
    return vectors[0]


def _key_scores_codegen(vectors: int):
    def codegen(context, builder, sig, args):
        kb, q, st, g, c0 = args[:5]
        kbty, qty, stty = sig.args[:3]
        qrow = _row_ptr(context, builder, qty, q, g)
        queries = [_load(builder, qrow, _const(builder, v), _V16F) for v in range(vectors)]
        partials = []
        for j in range(KEY_ROWS):
            krow = _row_ptr(context, builder, kbty, kb, _const(builder, j))
            p = builder.fmul(queries[0], _load(builder, krow, _const(builder, 0), _V16F))
            for v in range(1, vectors):
                p = _fma(builder, queries[v], _load(builder, krow, _const(builder, v), _V16F), p)
            partials.append(p)
        srow = builder.bitcast(_row_ptr(context, builder, stty, st, g), _F32.as_pointer())
        dst = builder.bitcast(builder.gep(srow, [c0]), _V16F.as_pointer())
        builder.store(_transpose_sums(builder, partials), dst, align=4)
        return context.get_dummy_value()
    return codegen


def _key_scores_typing(typingctx, kb, q, st, g, c0, vectors):
    """st[g, c0: c0 + 16] = kb[:16] @ q[g]: one query head against KEY_ROWS keys (a decode's
    scores). kb float32 [>= 16, D], q float32 [G, D], st float32 [G, N]; vectors = D / 16, a
    literal."""
    if not isinstance(vectors, types.IntegerLiteral):
        return None
    return types.none(kb, q, st, g, c0, vectors), _key_scores_codegen(vectors.literal_value)


def _head_update_codegen(rows: int, vectors: int):
    def codegen(context, builder, sig, args):
        st, vb, acc, g0, c0 = args[:5]
        stty, vbty, accty = sig.args[:3]
        arow = [builder.bitcast(_row_ptr(context, builder, accty, acc, builder.add(g0, _const(builder, r))),
                                _V16F.as_pointer()) for r in range(rows)]
        prow = [builder.gep(builder.bitcast(_row_ptr(context, builder, stty, st,
                                                     builder.add(g0, _const(builder, r))), _F32.as_pointer()),
                            [c0]) for r in range(rows)]
        sums = [builder.load(builder.gep(arow[r], [_const(builder, v)]), align=4)
                for r in range(rows) for v in range(vectors)]
        for j in range(KEY_ROWS):
            vrow = _row_ptr(context, builder, vbty, vb, _const(builder, j))
            values = [_load(builder, vrow, _const(builder, v), _V16F) for v in range(vectors)]
            for r in range(rows):
                p = _splat(builder, builder.load(builder.gep(prow[r], [_const(builder, j)]), align=4), LANES)
                for v in range(vectors):
                    sums[r * vectors + v] = _fma(builder, p, values[v], sums[r * vectors + v])
        for r in range(rows):
            for v in range(vectors):
                builder.store(sums[r * vectors + v], builder.gep(arow[r], [_const(builder, v)]), align=4)
        return context.get_dummy_value()
    return codegen


def _head_update_typing(typingctx, st, vb, acc, g0, c0, rows, vectors):
    """acc[g0 + r] += st[g0 + r, c0: c0 + 16] @ vb[:16] for r < rows (a decode's P V, the
    probabilities a head a row): st float32 [G, N], vb float32 [>= 16, D], acc float32 [G, D];
    rows and vectors = D / 16 literals (rows x vectors accumulators in registers)."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (rows, vectors)):
        return None
    sig = types.none(st, vb, acc, g0, c0, rows, vectors)
    return sig, _head_update_codegen(rows.literal_value, vectors.literal_value)


def _widen_codegen(kind: str, vectors: int):
    i16 = ir.IntType(16)

    item = 4 if kind == "f32" else 2
    lines = max(1, vectors * LANES * item // 64)  # cache lines a row

    def codegen(context, builder, sig, args):
        cache, ahead, offsets, dst, d0 = args[:5]
        cachety, aheadty, offty, dstty = sig.args[:4]
        def data(aty, a, ty):
            return builder.bitcast(context.make_array(aty)(context, builder, a).data, ty.as_pointer())
        base, later = data(cachety, cache, ir.IntType(8)), data(aheadty, ahead, ir.IntType(8))
        offs = data(offty, offsets, ir.IntType(64))
        i32 = ir.IntType(32)
        prefetch = _function(builder, "llvm.prefetch.p0i8", ir.FunctionType(ir.VoidType(), [
            ir.IntType(8).as_pointer(), i32, i32, i32]))
        for i in range(KEY_ROWS):
            # PERF: the rows of the step after this one, asked for now: a KV head's rows are a
            # cache row apart (1 KiB on the 1B shape), 4 to a page, and the hardware prefetchers
            # stop at page ends: unasked, every few rows waited for DRAM (3-8 GB/s)
            at = builder.gep(later, [builder.load(builder.gep(offs, [_const(builder, KEY_ROWS + i)]))])
            for line in range(lines):
                builder.call(prefetch, [builder.gep(at, [_const(builder, 64 * line)]), ir.Constant(i32, 0),
                                        ir.Constant(i32, 3), ir.Constant(i32, 1)])
            src = builder.gep(base, [builder.load(builder.gep(offs, [_const(builder, i)]))])
            drow = _row_ptr(context, builder, dstty, dst, builder.add(d0, _const(builder, i)))
            for v in range(vectors):
                if kind == "f32":
                    x = _load(builder, src, _const(builder, v), _V16F)
                else:
                    bits = _load(builder, src, _const(builder, v), _vec(i16, LANES))
                    if kind == "f16":  # NOTE: vcvtph2ps: exact, subnormals, inf and nan included
                        x = builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), LANES)), _V16F)
                    else:  # bfloat16: the upper half of a float32
                        wide = builder.shl(builder.zext(bits, _vec(ir.IntType(32), LANES)),
                                           ir.Constant(_vec(ir.IntType(32), LANES), [16] * LANES))
                        x = builder.bitcast(wide, _V16F)
                builder.store(x, builder.gep(builder.bitcast(drow, _V16F.as_pointer()), [_const(builder, v)]),
                              align=4)
        return context.get_dummy_value()
    return codegen


def _widen_typing(typingctx, cache, ahead, offsets, dst, d0, vectors):
    """dst[d0 + i, :16 vectors] = the cache row at byte offset offsets[i] as float32, for i <
    KEY_ROWS: a decode's keys or values widened from the cache's storage (gpu/cpu/kv_dtypes.py:
    float32, bfloat16 bits in uint16, float16 bits in int16; vcvtph2ps for float16), 16
    elements a vector; and the rows of `ahead` (a cache of the same shape) at offsets[KEY_ROWS +
    i] prefetched. vectors: head_dim / 16, a literal."""
    if not isinstance(vectors, types.IntegerLiteral):
        return None
    kind = {types.float32: "f32", types.uint16: "bf16", types.int16: "f16"}.get(cache.dtype)
    if kind is None:
        return None
    return types.none(cache, ahead, offsets, dst, d0, vectors), _widen_codegen(kind, vectors.literal_value)


scores_tile: Any = intrinsic(_scores_typing)
update_tile: Any = intrinsic(_update_typing)
key_scores: Any = intrinsic(_key_scores_typing)
head_update: Any = intrinsic(_head_update_typing)
widen_rows: Any = intrinsic(_widen_typing)
