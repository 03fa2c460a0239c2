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

The per-token attention (gpu/cpu/attention.py: decodes and short prompt chunks, one query row a
head) takes two more: ``key_scores`` (a query against KEYS keys: head_dim in the lanes, one
accumulator a key, then a transpose-and-add tree puts key j's sum in lane j) and
``accumulate_rows`` (update_tile, reading the probabilities a query row a row as the softmax leaves
them, over a whole head_dim in column chunks of 4 vectors, then single vectors, so two literal
kernels serve every head size)."""
from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ringserve.gpu.cpu.int8_kernels import _const, _function, _load, _row_ptr, _splat, _vec

LANES = 16               # float32 lanes of a 512-bit vector
SCORE_KEYS = 4           # keys a scores step keeps in registers ...
ROW_VECTORS = 2          # ... against 32 query rows (x 2 sums: 16 accumulators)
SCORE_ROWS = ROW_VECTORS * LANES
ACCUMULATORS = 16        # vectors an update step keeps in registers
KEY_VECTORS = 2          # KEY_BLOCK (32) keys as vectors of 16
KEYS = LANES             # keys a key_scores call scores: one lane each
ROWS = 4                 # accumulator rows an accumulate_rows step keeps (x at most 4 vectors)

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


def _update_codegen(rows: int, vectors: int, by_row: bool = False):
    """by_row: s holds a query row's probabilities a row ([R, K]), not a key's ([K, R])."""
    def codegen(context, builder, sig, args):
        s, vb, acc, i0 = args[:4]
        sty, vbty, accty = sig.args[:3]
        keys = builder.extract_value(context.make_array(vbty)(context, builder, vb).shape, 0)
        arow = [builder.bitcast(_row_ptr(context, builder, accty, acc, builder.add(i0, _const(builder, r))),
                                _V16F.as_pointer()) for r in range(rows)]
        i0_bytes = builder.mul(i0, _const(builder, 4))
        initial = [builder.load(builder.gep(arow[r], [_const(builder, v)]), align=4)
                   for r in range(rows) for v in range(vectors)]
        srow = [builder.bitcast(_row_ptr(context, builder, sty, s, builder.add(i0, _const(builder, r))),
                                _F32.as_pointer()) for r in range(rows)] if by_row else []

        def body(j, a):
            vrow = _row_ptr(context, builder, vbty, vb, j)
            values = [_load(builder, vrow, _const(builder, v), _V16F) for v in range(vectors)]
            out = list(a)
            prow = None if by_row else builder.bitcast(
                builder.gep(_row_ptr(context, builder, sty, s, j), [i0_bytes]), _F32.as_pointer())
            for r in range(rows):
                at = builder.gep(srow[r], [j]) if prow is None else builder.gep(prow, [_const(builder, r)])
                p = _splat(builder, builder.load(at, align=4), LANES)
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


def _row_update_typing(typingctx, p, vb, acc, i0, rows, vectors):
    """acc[i0 + r] += p[i0 + r, :K] @ vb for r < rows, K = vb.shape[0]: update_tile with the
    probabilities a query row a row (p float32 [R, >= K], as the per-token softmax leaves them)."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (rows, vectors)):
        return None
    sig = types.none(p, vb, acc, i0, rows, vectors)
    return sig, _update_codegen(rows.literal_value, vectors.literal_value, by_row=True)


def _lane_tree_sum(builder, vectors: list) -> Any:
    """KEYS vectors -> one whose lane j holds the sum of vector j's lanes: at each level, pairs
    (a, b) become blend(a, b) + the same blend of each one's lanes swapped across the level's bit
    (a transpose-and-add: 15 blends, 15 shuffles and 15 adds, not 16 horizontal sums)."""
    bit = LANES // 2
    while len(vectors) > 1:
        half = len(vectors) // 2
        own = ir.Constant(_vec(ir.IntType(32), LANES), [LANES + i if i & bit else i for i in range(LANES)])
        swapped = ir.Constant(_vec(ir.IntType(32), LANES),
                              [LANES + (i ^ bit) if i & bit else i ^ bit for i in range(LANES)])
        vectors = [builder.fadd(builder.shuffle_vector(a, b, own), builder.shuffle_vector(a, b, swapped))
                   for a, b in zip(vectors[:half], vectors[half:], strict=True)]
        bit //= 2
    return vectors[0]


def _key_scores_codegen():
    def codegen(context, builder, sig, args):
        kb, qm, st, qrow, srow, o = args
        kbty, qmty, stty = sig.args[:3]
        head_dim = builder.extract_value(context.make_array(kbty)(context, builder, kb).shape, 1)
        krow = [_row_ptr(context, builder, kbty, kb, _const(builder, j)) for j in range(KEYS)]
        qptr = _row_ptr(context, builder, qmty, qm, qrow)

        def body(c, acc):
            query = _load(builder, qptr, c, _V16F)
            return [_fma(builder, _load(builder, krow[j], c, _V16F), query, acc[j]) for j in range(KEYS)]
        body.initial = [ir.Constant(_V16F, [0.0] * LANES)] * KEYS  # type: ignore[attr-defined]
        _counted_loop(builder, builder.udiv(head_dim, _const(builder, LANES)), body)
        total = _lane_tree_sum(builder, body.result)  # type: ignore[attr-defined]
        dst = builder.gep(_row_ptr(context, builder, stty, st, srow), [builder.mul(o, _const(builder, 4))])
        builder.store(total, builder.bitcast(dst, _V16F.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _key_scores_typing(typingctx, kb, qm, st, qrow, srow, o):
    """st[srow, o: o + KEYS] = kb[:KEYS] @ qm[qrow]: kb float32 [KEYS, D], qm float32 [R, D], st
    float32 [S, >= o + KEYS], D a multiple of 16 (the rows padded with zeros); qrow, srow, o int64.
    Each sum: lane-wise fused multiply-adds over D / 16 chunks, then _lane_tree_sum's fixed tree."""
    if not all(a == types.int64 for a in (qrow, srow, o)):
        return None
    return types.none(kb, qm, st, qrow, srow, o), _key_scores_codegen()


def _prefetch_heads_codegen(context, builder, sig, args):
    cache, block, row, kvh0, kvh1 = args
    ary = context.make_array(sig.args[0])(context, builder, cache)
    s0, s1, s2 = (builder.extract_value(ary.strides, i) for i in range(3))
    first = builder.add(builder.add(builder.mul(block, s0), builder.mul(row, s1)), builder.mul(kvh0, s2))
    base = builder.gep(builder.bitcast(ary.data, ir.IntType(8).as_pointer()), [first])
    nbytes = builder.mul(builder.sub(kvh1, kvh0), s2)
    fn = _function(builder, "llvm.prefetch.p0i8", ir.FunctionType(ir.VoidType(), [
        ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(32), ir.IntType(32)]))
    i32 = ir.IntType(32)

    def body(n, carried):
        at = builder.gep(base, [builder.mul(n, _const(builder, 64))])
        builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return carried
    body.initial = []  # type: ignore[attr-defined]
    _counted_loop(builder, builder.udiv(builder.add(nbytes, _const(builder, 63)), _const(builder, 64)), body)
    return context.get_dummy_value()


def _prefetch_heads_typing(typingctx, cache, block, row, kvh0, kvh1):
    """Ask for cache[block, row, kvh0:kvh1]'s bytes (a 4-D cache, kvh1 > kvh0) into L2:
    attention asks for the next block's row while it reads this one, as a request's blocks lie
    anywhere in the pool and the hardware prefetchers stop at each block's end."""
    if not all(a == types.int64 for a in (block, row, kvh0, kvh1)):
        return None
    return types.none(cache, block, row, kvh0, kvh1), _prefetch_heads_codegen


scores_tile: Any = intrinsic(_scores_typing)
prefetch_heads: Any = intrinsic(_prefetch_heads_typing)
key_scores: Any = intrinsic(_key_scores_typing)
update_tile: Any = intrinsic(_update_typing)
row_update_tile: Any = intrinsic(_row_update_typing)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def accumulate_rows(p, vb, acc):  # pragma: no cover - compiled
    """acc += p[:, :K] @ vb, K = vb.shape[0], acc [R, D] with R a multiple of ROWS and D of 16 (p
    [R, >= K]: a query row's probabilities a row): row_update_tile over ROWS rows and column
    chunks of 4 vectors, then single vectors (two literal kernels for every head size: each one
    compiled costs ~1 s a driver)."""
    full = vb.shape[1] // 64 * 64
    for i in range(0, acc.shape[0], ROWS):
        for c in range(0, full, 64):
            row_update_tile(p, vb[:, c:c + 64], acc[:, c:c + 64], i, 4, 4)
        for c in range(full, vb.shape[1], 16):
            row_update_tile(p, vb[:, c:c + 16], acc[:, c:c + 16], i, 4, 1)
