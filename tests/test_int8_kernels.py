"""int8 activations x packed weights through AVX-512 VNNI (gpu/cpu/int8_kernels.py), against numpy.

Two exact references: the activation quantizer against numpy's own blockwise int8 rounding
(bit-identical), and every kernel against gguf-py's ``dequantize`` of the weight times the
*dequantized int8 activations* in float64. The integer dot products are exact, so the only error
is float32 rounding of the per-step terms ``s * dx * sum(u * xq)`` and ``(m - z s) dx sum(xq)``
(z = 128 for int8 planes, whose bytes the kernel reads as ``q + 128``), bounded like
tests/test_quant_kernels.py's: (K + 2) 2^-23 sum |x_i| (|s| (|q_i| + z) + |m|). A wrong quant,
scale, zero point, sub-block or token row lands at O(1) of the bound.
"""
from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

from ringserve.gpu.cpu import int8_kernels as cpu_int8_kernels
from ringserve.gpu.cpu.amx_kernels import AMX_BLOCKS, AMX_KINDS, on_amx, tiles_linear
from ringserve.gpu.cpu.int8_kernels import (
    U6_TYPES,
    ZERO_POINTS,
    Int8Weight,
    has_vnni,
    int8_linear,
    quantize_rows,
    quantize_super_rows,
    super_activations,
    supports,
    tiles,
    u6_step_vectors,
    unpack_u6,
)
from ringserve.gpu.cpu.packed import fuse_packed, packed_linear
from ringserve.gpu.cpu.runner import int8_activations
from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.packing import SplitWeight
from ringserve.gpu.loader.quant import BLOCK_SIZES, QuantWeight, dequantize, random_raw, repack
from ringserve.gpu.loader.weights import GGMLTensor

pytestmark = pytest.mark.skipif(not has_vnni(), reason="this CPU has no AVX-512 VNNI: the int8 "
                                "kernels do not exist here and the float32 kernels run instead")

INTEGER_TYPES = [t for t in BLOCK_SIZES if t not in ("F32", "F16", "BF16")]
# 1-3: one short tile; 4: a tile of 4; 5-7: 4 and 1-3 left over; 8: one tile of 8 (TOKEN_TILE);
# 12: 8 and 4; 15: 8, 4 and 3; 17, 70: many tiles
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 15, 17, 70]


def numpy_quantize(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's q8 activations in numpy: per 32, d = max|x| / 127, q = round-half-away(x / d);
    block 256: its q8_K (the K-quants')."""
    blocks = x.reshape(x.shape[0], -1, block)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    v = blocks / np.where(d > 0, d, np.float32(1))[..., None]
    return np.trunc(v + np.copysign(np.float32(0.5), v)).astype(np.int8).reshape(x.shape), d


def test_activations_quantize_as_numpy_does():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 256)).astype(np.float32) * np.float32(3.0)
    x[1, :32] = 0.0                       # an all-zero block: scale 0, quants 0
    x[1, 7] = np.float32(-0.0)            # (max|x| is taken on the bits, sign cleared: -0 is 0)
    x[2, 32:64] *= np.float32(1e30)       # huge but finite
    x[3, 64:96] = np.float32(-7.5)        # ties: every value is max|x|, so exactly -127
    x[4, 96:128] = np.float32(1e-40)      # subnormal: max|x| / 127 too (1 / d would be inf)
    x[4, 96] = np.float32(-3e-40)
    rows = quantize_rows(x)
    q, d = numpy_quantize(x)
    assert np.array_equal(rows.q, q) and np.array_equal(rows.scale, d)
    assert np.all(rows.q[1, :32] == 0) and rows.scale[1, 0] == 0 and np.all(rows.q[3, 64:96] == -127)
    qs = rows.q.astype(np.float64)
    np.testing.assert_allclose(rows.sum32, d * qs.reshape(5, -1, 32).sum(-1), rtol=1e-6)
    np.testing.assert_allclose(rows.sum16, np.repeat(d, 2, axis=1) * qs.reshape(5, -1, 16).sum(-1),
                               rtol=1e-6)


def test_activations_quantize_in_blocks_of_256_as_numpy_does():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 512)).astype(np.float32) * np.float32(3.0)
    x[1, :256] = 0.0                        # an all-zero block: scale 0, quants 0
    x[1, 9] = np.float32(-0.0)
    x[2, 256:] *= np.float32(1e30)          # huge but finite
    x[3, :256] = np.float32(1e-40)          # subnormal
    x[0, 300] = np.float32(-50.0)           # one outlier: the block's other quants shrink
    for sub, zero_point in ((16, 32), (32, 0), (32, 128)):
        rows = quantize_super_rows(x, sub, zero_point)
        q, d = numpy_quantize(x, 256)
        assert np.array_equal(rows.q, q) and np.array_equal(rows.scale, d)
        assert rows.q[0, 300] == -127 and np.all(rows.q[1, :256] == 0)
        sums = q.astype(np.int64).reshape(4, -1, sub).sum(-1)
        n = 512 // sub
        assert np.array_equal(rows.sums[:, :n], -zero_point * sums)   # the vpdpbusd sums' start
        assert np.array_equal(rows.half_sums[:, 2 * n:3 * n], sums)      # vpdpwssd's, int16 pairs


def reference(x: np.ndarray, w: QuantWeight, tiled_kind: str = "i8",
              super_blocks: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(the float64 product of the dequantized int8 activations (blocks of 32, or of 256 for
    super_blocks) and weights, its error bound for tiles of tiled_kind: its zero point enters
    the bound)."""
    q, d = numpy_quantize(x, 256 if super_blocks else 32)
    xd = (q.reshape(len(x), d.shape[1], -1) * d[..., None].astype(np.float64)).reshape(x.shape)
    want = xd @ dequantize(w).astype(np.float64).T
    unscaled = np.abs(dequantize(dataclasses.replace(w, offset=None))).astype(np.float64)
    assert w.scale is not None
    zero_point = float(ZERO_POINTS[tiled_kind if w.kind == "i8" else w.kind])
    per_weight = unscaled + np.repeat(zero_point * np.abs(w.scale), w.block, axis=1)
    if w.offset is not None:
        per_weight += np.repeat(np.abs(w.offset), w.block, axis=1)
    bound = (x.shape[1] + 2) * 2.0 ** -23 * (np.abs(xd) @ per_weight.T)
    return want, bound


@pytest.mark.parametrize("qtype", INTEGER_TYPES)
def test_every_type_is_dequantize_times_the_int8_activations(qtype):
    rng = np.random.default_rng(7)
    shape = (48, 512)  # 3 tiles of 16 rows: 4 tasks on 1 thread, 8 on 2, never more than tiles
    raw = random_raw(qtype, shape, rng)
    w = repack(raw, qtype, shape)
    assert supports(w)
    # scales that are GGUF f16 fields (the legacy types) are kept as half: exact, and fewer bytes;
    # the K-quants' as their int8 factors of float32 super planes (llama.cpp's compact form)
    half = qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
    # quants that fit 6 bits as u6 (0.75 B/weight), and as their int8 bytes (six_bit=False)
    kind = "u6" if qtype in U6_TYPES else w.kind
    forms = [(tiles(w), kind)] + ([] if half else [(tiles(repack(raw, qtype, shape, factored=True)), kind)])
    if qtype in U6_TYPES:
        forms.append((tiles(w, six_bit=False), "i8"))
    for tiled, kind in forms:
        factored = tiled.scale_super is not None
        assert tiled.kind == kind
        assert tiled.scale.dtype == (np.uint16 if half else np.int8 if factored else np.float32)
        assert not factored or tiled.scale_super.dtype == np.uint16  # d, -dmin: GGUF's f16 fields
        assert (tiled.nbytes < w.nbytes) == (half or factored or tiled.kind == "u6")
        assert np.array_equal(dequantize(tiled.rows(np.arange(48))), dequantize(w))
        picked = np.array([47, 0, 17, 17])  # an embedding lookup: any rows, repeated
        assert np.array_equal(dequantize(tiled.rows(picked)), dequantize(w)[picked])
        # Q4_K, Q5_K and Q6_K's factored tiles take activations in blocks of 256, and of 32 where
        # AMX multiplies them (super_blocks=False: the kinds and sub-blocks it takes)
        amx_form = factored and tiled.kind in AMX_KINDS and tiled.block in AMX_BLOCKS
        for super_blocks in (True, False) if amx_form else (True,):
            for t in TOKENS:
                x = rng.standard_normal((t, shape[1])).astype(np.float32)
                want, bound = reference(x, w, tiled.kind, super_blocks and super_activations(tiled))
                for parallel in (False, True):
                    got = int8_linear(x, tiled, parallel=parallel, super_blocks=super_blocks)
                    err = np.abs(got - want)
                    assert np.all(err <= bound), \
                        f"{qtype} {super_blocks=} T={t}: worst {(err / bound).max():.3g} of the bound"


@pytest.mark.parametrize("qtype,six_bit,super_blocks", [
    ("Q4_K", True, True), ("Q4_K", True, False), ("Q6_K", True, True), ("Q6_K", False, True),
    ("Q8_0", True, True)])
def test_a_tokens_result_does_not_depend_on_the_rows_beside_it(qtype, six_bit, super_blocks):
    """Bit for bit: a token row's output is the same alone, in a tile of 4 or 8, or left over
    after them, in a short step or a long one (each token's terms are summed in one order
    whatever its tile): a request's tokens must not change with the batch it ran in.
    The K-quants both ways: activations in blocks of 256, and of 32 (on a CPU with AMX)."""
    rng = np.random.default_rng(5)
    shape = (32, 512)
    tiled = tiles(repack(random_raw(qtype, shape, rng), qtype, shape, factored=True), six_bit=six_bit)
    x = rng.standard_normal((70, shape[1])).astype(np.float32)

    def linear(rows: np.ndarray, parallel: bool = False) -> np.ndarray:
        return int8_linear(rows, tiled, parallel=parallel, super_blocks=super_blocks)
    whole = linear(x)  # 8 tiles of 8, one of 4, 2 left over
    alone = np.concatenate([linear(x[i:i + 1]) for i in range(len(x))])
    assert np.array_equal(whole, alone)
    for lo, hi in ((0, 8), (3, 15), (5, 17), (1, 29), (6, 70)):
        for parallel in (False, True):
            assert np.array_equal(linear(x[lo:hi], parallel), whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("qtype,super_blocks", [("Q4_K", True), ("Q6_K", True), ("Q8_0", True),
                                                ("Q4_K", False)])
def test_a_long_steps_token_blocks_and_threads_give_each_rows_bits_alone(qtype, super_blocks):
    """A prompt step's rows run in blocks of TOKEN_BLOCK_BYTES of int8 activations (here 64 rows of
    4,096: blocks of 64, 64 and 16, then 4 and 2 left over with the last block) and a parallel
    driver quantizes them over its threads (PARALLEL_QUANTIZE_VALUES): each row's bits are still
    its own, alone, serial or parallel."""
    rng = np.random.default_rng(9)
    shape = (64, 4096)
    tiled = tiles(repack(random_raw(qtype, shape, rng), qtype, shape, factored=True))
    x = rng.standard_normal((150, shape[1])).astype(np.float32)
    assert cpu_int8_kernels.TOKEN_BLOCK_BYTES // shape[1] < len(x) // 2
    assert x.size >= cpu_int8_kernels.PARALLEL_QUANTIZE_VALUES

    def linear(rows: np.ndarray, parallel: bool = False) -> np.ndarray:
        return int8_linear(rows, tiled, parallel=parallel, super_blocks=super_blocks)
    alone = np.concatenate([linear(x[i:i + 1]) for i in range(len(x))])
    assert np.array_equal(linear(x), alone)
    assert np.array_equal(linear(x, parallel=True), alone)


@pytest.mark.parametrize("qtype,shape", [("Q4_K", (1024, 4096)), ("Q5_K", (1024, 2560)),
                                         ("Q6_K", (1024, 2560))])
def test_a_streamed_matrix_gives_the_bits_of_the_serial_kernels(qtype, shape):
    """A K-quant matrix of STREAM_MIN_BYTES or more runs on two threads through a streaming
    driver (other prefetches in its few-token kernels, STREAM_PREFETCHES): its outputs are the
    serial driver's bits at every token count, short tiles and whole ones."""
    rng = np.random.default_rng(8)
    tiled = tiles(repack(random_raw(qtype, shape, rng), qtype, shape, factored=True))
    assert tiled.nbytes >= cpu_int8_kernels.STREAM_MIN_BYTES
    assert tiled.kind in cpu_int8_kernels.STREAM_PREFETCHES
    driver = cpu_int8_kernels._STREAM_DRIVERS[(tiled.block, cpu_int8_kernels.VECTORS[tiled.kind])]
    x = rng.standard_normal((13, shape[1])).astype(np.float32)
    for t in (1, 2, 3, 4, 5, 8, 13):
        serial = int8_linear(x[:t], tiled)
        assert np.array_equal(int8_linear(x[:t], tiled, parallel=True), serial), t
    assert driver.signatures, "the streaming driver ran"


def test_the_activations_scratch_does_not_grow_with_every_step_size():
    """A server runs steps of every token count up to max_num_batched_tokens: the int8 rows are one
    scratch a width, grown to the largest count and read as its first rows (one per count held
    ~2 GB after counts 1..512 on the 1B shape's widths). Counts in falling and mixed order, and
    repeated (the last count's rows are kept, per_thread_rows): a step reads the rows it
    quantized, never a larger step's left in the scratch."""
    rng = np.random.default_rng(11)
    shape = (32, 1024)
    raw = random_raw("Q4_K", shape, rng)
    w = repack(raw, "Q4_K", shape)
    tiled = tiles(repack(raw, "Q4_K", shape, factored=True))
    counts = [200, 3, 3, 1, 57, 7, 7, 130, 2, 199, 199]
    xs = {t: rng.standard_normal((t, shape[1])).astype(np.float32) for t in counts}
    for t in counts:  # every kernel compiled (or loaded) and the scratch at its largest first
        int8_linear(xs[t], tiled)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for t in list(range(1, 201)) + counts:
            got = int8_linear(xs[t] if t in xs else rng.standard_normal((t, shape[1])).astype(np.float32),
                              tiled)
            if t in xs:
                want, bound = reference(xs[t], w, tiled.kind, super_activations(tiled))
                assert np.all(np.abs(got - want) <= bound), f"T={t}"
            del got
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # one per count would hold sum(1..200) x 1024 x 1.5 bytes = 31 MB; the one scratch: 0.3 MB
    assert held < 1 << 20, f"{held / 2**20:.1f} MiB still held after steps of 1..200 rows"


def test_u6_vectors_hold_each_weights_six_bits_where_the_kernel_reads_them():
    rng = np.random.default_rng(3)
    q = rng.integers(-32, 32, (2, 128)).astype(np.int8)
    vectors = u6_step_vectors(q)
    assert vectors.shape == (2, 2, 12, 4) and vectors.dtype == np.uint8
    u = (q.astype(np.int16) + 32).reshape(2, 2, 16, 4)  # weight 64 g + 4 i + j at [row, g, i, j]
    assert np.array_equal(vectors[:, :, 3] & 15, u[:, :, 3] & 15)     # low nibble: vector i
    assert np.array_equal(vectors[:, :, 3] >> 4, u[:, :, 11] & 15)    # high nibble: vector 8 + i
    assert np.array_equal((vectors[:, :, 9] >> 4) & 3, u[:, :, 9] >> 4)  # bits 2c of vector 8 + h: 4c + h
    assert np.array_equal(unpack_u6(vectors), u)


def test_rows_that_are_not_whole_tiles_and_float_types_stay_on_the_float_path():
    rng = np.random.default_rng(2)
    ragged = repack(random_raw("Q8_0", (16, 96), rng), "Q8_0", (16, 96))     # 96: not whole 64-steps
    short = repack(random_raw("Q8_0", (8, 128), rng), "Q8_0", (8, 128))      # 8 rows: not a 16-row tile
    f16 = repack(rng.standard_normal((16, 128)).astype(np.float16), "F16", (16, 128))
    assert not any(supports(w) for w in (ragged, short, f16))
    assert supports(repack(random_raw("Q4_K", (16, 256), rng), "Q4_K", (16, 256)))


@pytest.mark.parametrize("rows, parallel", [(3, False), (9, True), (20, False)])
def test_a_mixed_fused_linear_runs_each_part_on_its_path_into_its_own_columns(rows, parallel):
    rng = np.random.default_rng(0)
    shapes = [("Q4_K", 256), ("Q6_K", 128)]
    tensors = [GGMLTensor(kind, (n, 512), random_raw(kind, (n, 512), rng)) for kind, n in shapes]
    tensors.append(rng.standard_normal((8, 512)).astype(np.float16))  # F16: float32 activations
    fused = fuse_packed(tensors, int8=True)
    assert isinstance(fused, SplitWeight)
    assert [type(p) for p in fused.parts] == [Int8Weight, Int8Weight, QuantWeight]
    plain = fuse_packed(tensors)
    assert isinstance(plain, SplitWeight)
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    out = np.full((rows, 392), np.nan, np.float32)
    packed_linear(x, fused, out, parallel=parallel)
    for i, (lo, hi) in enumerate(((0, 256), (256, 384))):
        part = fused.parts[i]
        assert isinstance(part, Int8Weight)
        want, bound = reference(x, plain.parts[i], super_blocks=super_activations(part) and not on_amx(part))
        assert np.all(np.abs(out[:, lo:hi] - want) <= bound)
        # the part's tiles store into out's columns in place: the bits of the part alone
        assert np.array_equal(out[:, lo:hi], tiles_linear(x, part, parallel=parallel))
    f16_want = x.astype(np.float64) @ np.asarray(tensors[2], dtype=np.float64).T
    np.testing.assert_allclose(out[:, 384:], f16_want, rtol=1e-4, atol=1e-4 * np.abs(f16_want).max())


def test_the_setting_resolves_and_int8_without_vnni_is_refused(monkeypatch):
    assert int8_activations("auto") and int8_activations("int8") and not int8_activations("float32")
    monkeypatch.setattr(cpu_int8_kernels, "has_vnni", lambda: False)
    monkeypatch.setattr("ringserve.gpu.cpu.runner.has_vnni", lambda: False)
    assert not int8_activations("auto")
    with pytest.raises(ModelError, match="AVX-512 VNNI"):  # the engine prints its one line and exits
        int8_activations("int8")
    with pytest.raises(ValueError, match="expected one of"):
        int8_activations("fp8")
