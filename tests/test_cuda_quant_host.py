"""gpu/cuda/quant.cu on the host (tests/cuda_host/, as tests/test_cuda_host.py runs fused.cu and
attention.cu), launched through the launcher's own plan (gpu/cuda/quant_linear.py QuantLinear,
geometry from gpu/cuda/launch.py), against gguf-py's ``dequantize`` and a float64 matmul on
random blocks of every GGUF type (gpu/loader/quant.py random_raw; BF16: the bf16 plane, which gguf-py
widens as bits << 16), and against a numpy reference of AWQ/GPTQ unpacking. Each weight goes
through QuantStore as a model's does, so the kernels read the compact scale planes it uploads
(FORMS: K-quants int8 factors of float32 super planes, exact halves fp16, else float32).

Bound: the kernels sum in float32, so the float64 result is allowed test_quant_kernels.py's
bound for a float32 dot of length K, (K + 2) 2^-23 sum |x_i| (|scale q_i| + |offset_i|), plus
the fp16 rounding of the output (one fp16 step of it). A wrong quant, nibble, scale, offset or
row is O(1) of that.
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
import subprocess

import gguf
import gguf.quants
import numpy as np
import pytest

from fp16_checks import narrow, spacing, widen
from ringserve.gpu.cuda import launch
from ringserve.gpu.cuda.quant_linear import LARGE_BATCH_POLICIES, QuantLinear, QuantStore
from ringserve.gpu.loader.packing import SplitWeight
from ringserve.gpu.loader.quant import BLOCK_SIZES, QuantWeight, dequantize, random_raw, repack
from ringserve.gpu.loader.weights import GGMLTensor
from test_quant_kernels import magnitude

pytestmark = pytest.mark.sim
GGUF_TYPES = [t for t in BLOCK_SIZES if t not in ("F32", "F16")]  # F16, F32: DenseStore's (cuBLAS)
# linear_for's table (mat-vec up to 64 rows, then dequantize + GEMM: every kind's dequant_*_f16;
# the tiled GEMM has its own tests below): matvec r1, r4 (3 of 4 rows), r16; 37: tiles of 16, 16
# and 5 (r8); 70: dequantized chunks + GEMM
ROWS = [1, 3, 16, 37, 70]
N, K = 13, 2304         # 13: a last block with one warp's row only; K: lanes loop (u4 72, i8 144,
#                         bf16 288 chunks)


def numpy_gemm(x, w, out):
    """cuBLAS's stand-in (tests/test_cuda_forward_host.py HostOps.linear): fp16 in and out,
    float32 accumulation."""
    out[...] = (x.astype(np.float32) @ w.astype(np.float32).T).astype(np.float16)


@pytest.fixture(scope="module")
def quant_kernels(cuda_host):
    return cuda_host.get("quant.cu")


def linear_for(quant_kernels, workspace_elements: int = 4 * K) -> QuantLinear:
    """The launcher's plan over the host build, the mat-vec up to 64 rows and dequantize + GEMM
    above (the default table's crossover: test_the_crossover_table_picks_one_kernel_per_batch);
    a small workspace: several chunks of rows."""
    return QuantLinear(quant_kernels.call, numpy_gemm, np.full(workspace_elements, np.nan, np.float16),
                       large_batch="dequant", matvec_max_rows=64)


def check(got: np.ndarray, x: np.ndarray, w: QuantWeight, reference: np.ndarray) -> None:
    want = x.astype(np.float64) @ reference.astype(np.float64).T
    bound = (x.shape[1] + 2) * 2.0 ** -23 * (np.abs(x).astype(np.float64) @ magnitude(w).T)
    bound += np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), (f"{w.qtype}/{w.kind}: {(~(err <= bound)).sum()} of {err.size} off, "
                                  f"worst {np.nanmax(err / bound):.3g} of the bound")


def device(w: QuantWeight) -> QuantWeight:
    weight = QuantStore(np).packed([w])
    assert isinstance(weight, QuantWeight) and weight.kind == w.kind
    return weight


def form(w: QuantWeight) -> str | None:
    """The form of w's scale planes (quant.cu's scale_bytes): "int8+super", "float16",
    "float32"; None: no scales (bf16). Both planes checked to share it."""
    if w.scale is None:
        return None
    got = f"{w.scale.dtype}{'+super' if w.scale_super is not None else ''}"
    if w.offset is not None:
        assert f"{w.offset.dtype}{'+super' if w.offset_super is not None else ''}" == got
    return got


K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# The form QuantStore uploads each type in: K-quants' integer sub-block scales as int8 factors
# of float32 super planes (d, -dmin); the legacy types' f16 fields as fp16 (exact); AWQ's
# offsets -(z s) are not halves: float32; GPTQ's s and -8 s are: fp16.
LEGACY = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
FORMS = {**{t: "int8+super" for t in K_QUANTS}, **{t: "float16" for t in LEGACY}, "BF16": None,
         "AWQ": "float32", "GPTQ": "float16"}
# Bytes a weight on the device: quants (u4 0.5, i8 1, bf16 2) + scale planes (+ supers, 4 bytes a
# row's 256 weights each); Q4_0 and GPTQ (zero points all 8) without their offset plane: -8 s is
# the kernels' (gpu/loader/quant.py as_zero_point), the raw block's bytes; Q6_K as the u6 plane
# (0.75 B/weight of quants: nibbles and 2-bit highs, gpu/loader/quant.py to_u6)
BYTES_PER_WEIGHT = {"Q4_K": 0.5 + 2 / 32 + 8 / 256, "Q5_K": 1 + 2 / 32 + 8 / 256,
                    "Q6_K": 0.75 + 1 / 16 + 4 / 256, "Q3_K": 1 + 1 / 16 + 4 / 256,
                    "Q2_K": 1 + 2 / 16 + 8 / 256,
                    "Q8_0": 1 + 2 / 32,
                    "Q4_0": 0.5 + 2 / 32, "Q4_1": 0.5 + 4 / 32, "Q5_0": 1 + 2 / 32, "Q5_1": 1 + 4 / 32,
                    "BF16": 2.0, "AWQ": 0.5 + 8 / 128, "GPTQ": 0.5 + 2 / 128}
ZERO_POINT = {"Q4_0": 8, "GPTQ": 8}  # the types uploaded without an offset plane


def uploaded(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantWeight:
    """A GGUF tensor as the CUDA runner's store keeps it (QuantStore: factored K-quants, fp16
    planes of exact halves), in the form FORMS says."""
    weight = QuantStore(np).packed([GGMLTensor(qtype, shape, raw)])
    assert isinstance(weight, QuantWeight) and form(weight) == FORMS[qtype], (qtype, form(weight))
    return weight


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_quant_linear_matches_gguf_dequantize(quant_kernels, qtype, rows):
    rng = np.random.default_rng(rows)
    raw = random_raw(qtype, (N, K), rng)
    w = repack(raw, qtype, (N, K))
    x = rng.standard_normal((rows, K)).astype(np.float16)
    buffer = np.full((rows + 16, N), np.nan, np.float16)  # rows past out's: written by nobody
    out = buffer[:rows]
    linear_for(quant_kernels)(x, uploaded(qtype, raw, (N, K)), out)
    check(out, x, w, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(N, K))
    assert np.isnan(buffer[rows:]).all(), "a row past M was written"


def bf16_gemm(x, w, out):
    """cuBLAS's stand-in in bf16 (bits in uint16): float32 sums rounded once."""
    out[...] = narrow(widen(x) @ widen(w).T, "bfloat16")


# u4 and i8 planes with fp16 and int8+super scales, and the bf16 plane
@pytest.mark.parametrize("rows", [1, 16, 70])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q6_K", "BF16"])
def test_quant_linear_with_bf16_activations(quant_kernels, qtype, rows):
    """bf16 x and out (uint16 bits, as a quantized model served with --dtype bfloat16), through
    the default crossover table: the mat-vec's _bf16 instantiations, above it gemm_*_bf16.
    Bound: float32 sums, one bf16 rounding of out, and past the mat-vec the weights' own
    rounding to bf16 (2^-9 relative)."""
    rng = np.random.default_rng(rows + 7)
    raw = random_raw(qtype, (N, K), rng)
    w = repack(raw, qtype, (N, K))
    x = narrow(rng.standard_normal((rows, K)), "bfloat16")
    buffer = np.full((rows + 16, N), 0xFFFF, np.uint16)  # NaN: rows past out's written by nobody
    out = buffer[:rows]
    linear = QuantLinear(quant_kernels.call, bf16_gemm, np.full(4 * K, 0xFFFF, np.uint16))
    linear(x, uploaded(qtype, raw, (N, K)), out)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(N, K)
    want = widen(x).astype(np.float64) @ reference.astype(np.float64).T
    scale = np.abs(widen(x)).astype(np.float64) @ magnitude(w).T
    rounded = linear.impl_for(rows) != "matvec"  # the tiled GEMM and dequant_*_bf16: bf16 weights
    bound = ((K + 2) * 2.0 ** -23 + (2.0 ** -9 if rounded else 0)) * scale + spacing(want, "bfloat16")
    err = np.abs(widen(out).astype(np.float64) - want)
    assert np.all(err <= bound), f"{qtype}: {(~(err <= bound)).sum()} off, worst {np.nanmax(err / bound):.3g}"
    assert (buffer[rows:] == 0xFFFF).all(), "a row past M was written"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_four_bit_types_as_int8_planes(quant_kernels, qtype):
    """A 4-bit row that is not whole 64-weight nibble groups is held as int8 (gpu/loader/quant.py)."""
    rng = np.random.default_rng(7)
    raw = random_raw(qtype, (N, K), rng)
    w = repack(raw, qtype, (N, K), nibbles=False, factored=True)
    x = rng.standard_normal((2, K)).astype(np.float16)
    out = np.full((2, N), np.nan, np.float16)
    linear_for(quant_kernels)(x, device(w), out)
    check(out, x, w, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(N, K))


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_embedding_rows_dequantized_exactly(quant_kernels, qtype):
    """dequant_*_f32 at ids, from the compact planes QuantStore uploads (FORMS): bit for bit
    gpu/loader/quant.py's dequantize of the float32 planes, which is gguf-py's (the host compiles
    scale * q + offset without an FMA, as gpu/loader/quant.py and gguf-py round it; a device may fuse
    it: one rounding less). K = 2304: 9 super-blocks a row, so a super plane read at the wrong
    index is a wrong value."""
    rng = np.random.default_rng(3)
    raw = random_raw(qtype, (N, K), rng)
    ids = np.array([5, 0, 12, 5, 7], np.int32)
    out = np.full((len(ids), K), np.nan, np.float32)
    linear_for(quant_kernels).embedding(ids, uploaded(qtype, raw, (N, K)), out)
    want = dequantize(repack(raw, qtype, (N, K)))[ids]
    np.testing.assert_array_equal(out, want)  # NOTE: a kernel adds its offset 0.0f: -0.0 == 0.0
    nonzero = want != 0
    np.testing.assert_array_equal(out.view(np.uint32)[nonzero], want.view(np.uint32)[nonzero])
    gguf_rows = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(N, K)[ids]
    np.testing.assert_array_equal(out, gguf_rows)


@pytest.mark.parametrize("qtype", [*GGUF_TYPES, "AWQ", "GPTQ"])
def test_the_store_uploads_each_type_in_its_compact_form(qtype):
    """Every type's planes on the device: the form FORMS names and the bytes a weight
    BYTES_PER_WEIGHT says (nbytes counts the super planes), the values those of the float32
    planes (dequantize, bit for bit)."""
    rng = np.random.default_rng(8)
    n, k = 24, 1024
    if qtype in ("AWQ", "GPTQ"):
        from ringserve.gpu.loader.hf_quant import unpack_awq, unpack_gptq
        from test_hf_quant import random_int4
        tensors, _ = random_int4(n, k, rng, qtype.lower())
        plain = (unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"]) if qtype == "AWQ"
                 else unpack_gptq(tensors["qweight"], tensors["scales"], tensors["g_idx"]))
        weight = device(plain)
        assert form(weight) == FORMS[qtype]
    else:
        raw = random_raw(qtype, (n, k), rng)
        plain, weight = repack(raw, qtype, (n, k)), uploaded(qtype, raw, (n, k))
    assert weight.nbytes == BYTES_PER_WEIGHT[qtype] * n * k, (qtype, weight.nbytes / (n * k))
    assert weight.zero == ZERO_POINT.get(qtype, 0) and (weight.offset is None) == (qtype in ZERO_POINT
                                                                                   or plain.offset is None)
    if weight.scale_super is not None:
        assert weight.scale_super.shape == (n, k // 256) and weight.scale_super.dtype == np.float32
    np.testing.assert_array_equal(dequantize(weight).view(np.uint32), dequantize(plain).view(np.uint32))


def test_a_plane_that_is_not_exactly_half_stays_float32(quant_kernels):
    """A hand-made scale of 0.1 (not a half): the plane stays float32. And Q4_0 with a block
    whose d is 10000: its folded offset -8 d = -80000 is past fp16's 65504, but the store
    leaves that plane out (zero point 8: the kernels make -8 d in float32), so the scale is
    an exact fp16 plane. The kernels read both: dequant_*_f32 bit for bit, the mat-vec within
    its bound."""
    rng = np.random.default_rng(12)
    raw = random_raw("Q4_0", (N, K), rng)
    raw.reshape(N, K // 32, 18)[3, 5, 0:2] = np.array([10000], np.float16).view(np.uint8)
    big = QuantStore(np).packed([GGMLTensor("Q4_0", (N, K), raw)])
    assert form(big) == "float16" and big.offset is None and big.zero == 8 and big.scale[3, 5] == 10000
    q = rng.integers(-128, 128, (N, K), dtype=np.int8)
    scale = np.full((N, K // 32), np.float16(0.25), np.float32)
    scale[7, 2] = 0.1
    tenth = device(QuantWeight("Q8_0", (N, K), "i8", q, scale, None, 32))
    assert form(tenth) == "float32" and tenth.scale[7, 2] == np.float32(0.1)
    for w, plain in ((big, repack(raw, "Q4_0", (N, K))), (tenth, tenth)):
        out = np.full((N, K), np.nan, np.float32)
        linear_for(quant_kernels).dequantize(w, None, 0, N, out)
        np.testing.assert_array_equal(out, dequantize(plain))
        x = (rng.standard_normal((2, K)) / 1024).astype(np.float16)  # NOTE: d's row stays within fp16
        y = np.full((2, N), np.nan, np.float16)
        linear_for(quant_kernels)(x, w, y)
        check(y, x, plain, dequantize(plain))


def test_the_store_refuses_planes_of_no_kernel_form():
    """Only float32, fp16 and int8 + super planes reach quant.cu: float16 scales with a
    float32 offset (one scale_bytes for both), or int8 factors without their super plane,
    are refused at upload with one line naming them."""
    q = np.zeros((4, 64), np.int8)
    halves = np.ones((4, 2), np.float16)
    with pytest.raises(ValueError, match="not one of quant.cu's forms"):
        device(QuantWeight("Q5_1", (4, 64), "i8", q, halves, np.full((4, 2), 0.1, np.float32), 32))
    with pytest.raises(ValueError, match="not one of quant.cu's forms"):
        device(QuantWeight("Q6_K", (4, 64), "i8", q, np.ones((4, 4), np.int8), None, 16))


@pytest.mark.parametrize("rows,large_batch", [(2, "dequant"), (70, "dequant"), (70, "tiled")])
def test_a_fused_weight_of_mixed_types_writes_each_part_into_its_columns(quant_kernels, rows,
                                                                         large_batch):
    """Q4_K_M's QKV: Q4_K q and k, Q6_K v, and an F16 part (cuBLAS), one output."""
    rng = np.random.default_rng(11)
    parts = [("Q4_K", 8), ("Q4_K", 4), ("Q6_K", 4), ("F16", 4)]
    tensors, references = [], []
    for qtype, n in parts:
        raw = random_raw(qtype, (n, 512), rng)
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, 512)
        tensors.append(ref.astype(np.float16) if qtype == "F16" else GGMLTensor(qtype, (n, 512), raw))
        references.append(ref)
    weight = QuantStore(np).packed(tensors)
    assert isinstance(weight, SplitWeight)
    assert [getattr(p, "qtype", "fp16") for p in weight.parts] == ["Q4_K", "Q6_K", "fp16"]
    x = rng.standard_normal((rows, 512)).astype(np.float16)
    out = np.full((rows, 20), np.nan, np.float16)
    linear = linear_for(quant_kernels, 3 * 512)
    linear.large_batch = large_batch
    linear(x, weight, out)
    want = x.astype(np.float64) @ np.concatenate(references).astype(np.float64).T
    np.testing.assert_allclose(out, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_bf16_weights_stay_their_bits_on_the_device():
    """A BF16 matrix (gpu/loader/weights.py's GGMLTensor, as a bfloat16 checkpoint loads) packed (a part
    of a quantized linear: a dense bf16 checkpoint's go to cuBLAS) is the bf16 plane, its bits
    unchanged and 16-byte aligned even when the file maps it at an odd address;
    a row that is not whole 16-byte loads (8 weights) goes the fp16 path."""
    rng = np.random.default_rng(5)
    raw = random_raw("BF16", (N, 64), rng)
    buffer = np.zeros(raw.size + 2, np.uint8)
    buffer[2:] = raw.reshape(-1)  # as a memory map may place it: 2 bytes past an alignment
    mapped = buffer[2:].reshape(raw.shape)
    weight = QuantStore(np).packed([GGMLTensor("BF16", (N, 64), mapped)])
    assert isinstance(weight, QuantWeight) and weight.kind == "bf16" and weight.scale is None
    assert weight.q.ctypes.data % 16 == 0
    np.testing.assert_array_equal(weight.q, raw.view(np.uint16))
    odd = random_raw("BF16", (N, 12), rng)
    narrowed = QuantStore(np).packed([GGMLTensor("BF16", (N, 12), odd)])
    assert isinstance(narrowed, np.ndarray) and narrowed.dtype == np.float16
    np.testing.assert_array_equal(narrowed, (odd.view(np.uint16).astype(np.uint32) << 16)
                                  .view(np.float32).astype(np.float16))


def test_the_crossover_table_picks_one_kernel_per_batch(quant_kernels):
    """The default table (quant_linear.MATVEC_MAX_ROWS, LARGE_BATCH: a host default until the
    device's linear table sets it): one launch a linear, the mat-vec up to MATVEC_MAX_ROWS rows
    (its smallest variant), the tiled GEMM above; the table's entries are what QuantLinear takes."""
    from ringserve.gpu.cuda.quant_linear import LARGE_BATCH, MATVEC_MAX_ROWS
    rng = np.random.default_rng(2)
    raw = random_raw("Q4_K", (N, 512), rng)
    weight = uploaded("Q4_K", raw, (N, 512))
    launched: list[str] = []
    linear = QuantLinear(lambda name, *a: (launched.append(name), quant_kernels.call(name, *a))[1],
                         numpy_gemm, None)
    assert (LARGE_BATCH, linear.matvec_max_rows) == ("tiled", MATVEC_MAX_ROWS)
    for rows, kernel in ((1, "matvec_u4_r1"), (MATVEC_MAX_ROWS, f"matvec_u4_r{MATVEC_MAX_ROWS}"),
                         (MATVEC_MAX_ROWS + 1, "gemm_u4"), (256, "gemm_u4_m128")):
        launched.clear()
        x = rng.standard_normal((rows, 512)).astype(np.float16)
        out = np.full((rows, N), np.nan, np.float16)
        linear(x, weight, out)
        assert launched == [kernel], (rows, launched)
        assert linear.impl_for(rows) == kernel.split("_")[0].replace("gemm", "tiled")
    assert QuantLinear(quant_kernels.call, numpy_gemm, None, "dequant", 2).impl_for(3) == "dequant"


def test_launch_plan_picks_the_smallest_variant():
    assert [launch.matvec_variant(m) for m in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert launch.matvec_launch(13, "u4", 1) == ((2,), (128,))
    assert launch.matvec_launch(13, "u4", 2) == ((4,), (128,))
    assert launch.matvec_launch(13, "u6", 1) == ((4,), (128,))
    assert launch.dequant_launch(10 ** 6, 128)[0] == (65535,)


@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoint_weights_match_their_format(quant_kernels, method, rows):
    """AWQ/GPTQ linears (u4 planes, one scale and offset per 128-weight group) through the same
    kernels, against the format's (q - z) * s (tests/test_hf_quant.py's packers) in float64."""
    from ringserve.gpu.loader.hf_quant import unpack_awq, unpack_gptq
    from test_hf_quant import random_int4
    rng = np.random.default_rng(rows)
    tensors, values = random_int4(24, K, rng, method)  # AWQ packs 8 output rows a word
    w = (unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"]) if method == "awq"
         else unpack_gptq(tensors["qweight"], tensors["scales"], tensors["g_idx"]))
    assert w.block == 128
    x = rng.standard_normal((rows, w.shape[1])).astype(np.float16)
    out = np.full((rows, 24), np.nan, np.float16)
    linear_for(quant_kernels)(x, device(w), out)
    check(out, x, w, values)


# gemm_<kind> (QuantLinear's "tiled" large batch): two K sizes per kind, one with a last K step
# of 64 that is not whole where the kind allows it (i8: K % 16, bf16: K % 8; u4 is whole
# 64-weight groups); N = 77: two 64-feature tiles, the second 13 wide; up to 64 rows gemm_* (64
# rows a block), 70 and 130 rows gemm_*_m128 (128 a block: 130 is two, the last 2 tall).
GEMM_TYPES = {"Q4_K": (256,), "Q4_0": (576,), "GPTQ": (256,), "Q8_0": (96, 512), "Q6_K": (256,),
              "BF16": (72, 320)}
GEMM_ROWS = [1, 17, 64, 70, 130]
GEMM_N = 77


def gemm_weight(qtype: str, N: int, K: int, rng) -> tuple[QuantWeight, np.ndarray]:
    """A random weight of qtype on the planes, and the fp16 values dequant_<kind>_f16 writes
    (gguf-py's dequantize, or the GPTQ format's (q - 8) s, rounded to fp16; AWQ packs 8
    output features a word: no tail of 13)."""
    if qtype == "GPTQ":
        from ringserve.gpu.loader.hf_quant import unpack_gptq
        from test_hf_quant import random_int4
        tensors, values = random_int4(N, K, rng, "gptq")
        w = unpack_gptq(tensors["qweight"], tensors["scales"], tensors["g_idx"])
        return w, values.astype(np.float16)
    raw = random_raw(qtype, (N, K), rng)
    w = uploaded(qtype, raw, (N, K))
    return w, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(N, K).astype(np.float16)


_GUARDS: list = []  # the guarded mappings, alive for the session (their arrays point into them)


def guarded(a: np.ndarray | None, align: int = 16) -> np.ndarray | None:
    """A copy of `a` that ends where an inaccessible page begins: a kernel that reads past the
    array's end (rows past N or M, weights past K) faults (the test process dies of SIGSEGV)
    instead of reading stray memory. a.nbytes % align == 0 keeps its start aligned (16: the
    vector loads of quants and x; 4: the scalar loads of scales)."""
    if a is None:
        return None
    page, prot_none = mmap.PAGESIZE, 0
    assert a.nbytes % align == 0
    size = -(-a.nbytes // page) * page
    mm = mmap.mmap(-1, size + page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + size), ctypes.c_size_t(page), prot_none) == 0
    _GUARDS.append(mm)
    out = np.frombuffer(mm, a.dtype, a.size, size - a.nbytes).reshape(a.shape)
    out[...] = a
    return out


def gemm_bound(x: np.ndarray, w16: np.ndarray) -> np.ndarray:
    """float32 sums of exact fp16 products (a K-long sum: (K + 2) 2^-23 sum |x_i w_i|), plus
    the output's fp16 rounding."""
    want = x.astype(np.float64) @ w16.astype(np.float64).T
    bound = (x.shape[1] + 2) * 2.0 ** -23 * (np.abs(x).astype(np.float64) @ np.abs(w16).astype(np.float64).T)
    return bound + np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)


@pytest.mark.parametrize("qtype,K", [(t, k) for t, ks in GEMM_TYPES.items() for k in ks])
def test_tiled_gemm_matches_the_fp16_dequantized_weights(quant_kernels, qtype, K):
    """gemm_<kind> on tensor cores (the host's mma_m16n8k16: the PTX fragment layout) at every
    row tail: x with rows wider than K (ldx > K, NaN past K), out a column slice of a NaN-filled
    buffer (ldo > N), the planes and x each ending at an inaccessible page: every in-range
    value within fp32 accumulation of the float64 product of the fp16 weights, nothing written
    outside out, nothing read past the planes or x."""
    rng = np.random.default_rng(K)
    w, w16 = gemm_weight(qtype, GEMM_N, K, rng)
    weight = device(w)
    weight = dataclasses.replace(  # scales: scalar loads of their own size
        weight, q=guarded(weight.q), **{f: guarded(getattr(weight, f), getattr(weight, f).itemsize)
                                        for f in ("scale", "offset", "scale_super", "offset_super")
                                        if getattr(weight, f) is not None})
    linear = linear_for(quant_kernels)
    for rows in GEMM_ROWS:
        padded = np.full((rows, K + 8), np.nan, np.float16)  # read past K: NaN in out
        padded[:, :K] = rng.standard_normal((rows, K))
        x = guarded(padded)[:, :K]
        buffer = np.full((rows + 3, GEMM_N + 11), np.nan, np.float16)
        out = buffer[:rows, 5:5 + GEMM_N]
        linear.tiled(x, weight, out)
        want = x.astype(np.float64) @ w16.astype(np.float64).T
        err = np.abs(out.astype(np.float64) - want)
        bound = gemm_bound(x, w16)
        assert np.all(err <= bound), (f"{qtype} K {K} M {rows}: {(~(err <= bound)).sum()} of {err.size} "
                                      f"off, worst {np.nanmax(err / bound):.3g} of the bound")
        outside = buffer.copy()
        outside[:rows, 5:5 + GEMM_N] = np.nan
        assert np.isnan(outside).all(), f"{qtype} K {K} M {rows}: written outside out"


@pytest.mark.parametrize("qtype,K", [("Q4_K", 256), ("Q8_0", 96), ("BF16", 72)])
def test_tiled_gemm_in_bf16(quant_kernels, qtype, K):
    """gemm_<kind>_bf16 (bf16 x and out, the tile dequantized to bf16, mma .bf16) at row tails
    17, 64 and 70 and a K tail (96, 72: not whole 64-steps): within fp32 accumulation of the
    float64 product of the bf16-rounded weights, plus out's bf16 rounding; nothing written
    outside out."""
    rng = np.random.default_rng(K + 1)
    raw = random_raw(qtype, (GEMM_N, K), rng)
    weight = uploaded(qtype, raw, (GEMM_N, K))
    w_bf16 = widen(narrow(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(GEMM_N, K),
                          "bfloat16")).astype(np.float64)
    linear = QuantLinear(quant_kernels.call, bf16_gemm, None, large_batch="tiled")
    for rows in (17, 64, 70):
        x = narrow(rng.standard_normal((rows, K)), "bfloat16")
        buffer = np.full((rows + 3, GEMM_N + 11), 0xFFFF, np.uint16)
        out = buffer[:rows, 5:5 + GEMM_N]
        linear.tiled(x, weight, out)
        want = widen(x).astype(np.float64) @ w_bf16.T
        bound = (K + 2) * 2.0 ** -23 * (np.abs(widen(x)).astype(np.float64) @ np.abs(w_bf16).T)
        bound += spacing(want, "bfloat16")
        err = np.abs(widen(out).astype(np.float64) - want)
        assert np.all(err <= bound), f"{qtype} M {rows}: worst {np.nanmax(err / bound):.3g} of the bound"
        buffer[:rows, 5:5 + GEMM_N] = 0xFFFF
        assert (buffer == 0xFFFF).all(), f"{qtype} M {rows}: written outside out"


def test_the_large_batch_policy_picks_the_tiled_gemm_or_dequantize_and_cublas(quant_kernels):
    """The same QuantWeights through QuantLinear above MATVEC_MAX_ROWS: "tiled" launches
    gemm_<kind> and no cuBLAS GEMM, "dequant" the workspace chunks and cuBLAS (the host
    stand-in, tests/cublas_host.py); their outputs agree within both kernels' bounds."""
    from cublas_host import HostCublas
    from test_cuda_gemm_host import host_gemm
    rng = np.random.default_rng(21)
    K, rows = 512, 70
    x = rng.standard_normal((rows, K)).astype(np.float16)
    for qtype in ("Q4_K", "Q6_K", "BF16"):
        w, w16 = gemm_weight(qtype, GEMM_N, K, rng)
        weight = device(w)
        got = {}
        for policy in LARGE_BATCH_POLICIES:
            cublas, launched = HostCublas(), []

            def call(name, *args, launched=launched):
                launched.append(name)
                quant_kernels.call(name, *args)
            linear = QuantLinear(call, host_gemm(cublas), np.full(4 * K, np.nan, np.float16),
                                 large_batch=policy)
            out = got[policy] = np.full((rows, GEMM_N), np.nan, np.float16)
            linear(x, weight, out)
            if policy == "tiled":
                assert launched == [f"gemm_{w.kind}_m128"] and not cublas.calls  # 70 rows: 128 a block
            else:
                assert set(launched) == {f"dequant_{w.kind}_f16"} and len(cublas.calls) == len(launched) == 20
        diff = np.abs(got["tiled"].astype(np.float64) - got["dequant"].astype(np.float64))
        assert np.all(diff <= 2 * gemm_bound(x, w16)), qtype
    with pytest.raises(ValueError, match="large_batch 'fast'"):
        QuantLinear(call, numpy_gemm, None, large_batch="fast")


def test_gemm_launch_geometry():
    assert launch.gemm_launch(1, 1) == ((1, 1), (128,))
    assert launch.gemm_launch(64, 14336) == ((1, 224), (128,))
    assert launch.gemm_launch(130, 14336) == ((2, 224), (256,))  # gemm_*_m128: 128 rows a block
    with pytest.raises(ValueError, match="grid.y"):
        launch.gemm_launch(64, 64 * 65536)


def ptx_fragments(A: np.ndarray, B: np.ndarray, C: np.ndarray, bf16: bool = False) -> tuple:
    """Each lane's fragments of mma.m16n8k16 .f16 (bf16: .bf16) A (16 x 16), B (16 x 8) and .f32
    C (16 x 8), as the PTX ISA's "Matrix Fragments for mma.m16n8k16 with floating point type" computes
    them (groupID = lane >> 2, threadID_in_group = lane % 4), written here from its formulas
    independently of the shim; also the (row, col) of each lane's c/d elements."""
    a = np.zeros((32, 8), np.float32)
    b = np.zeros((32, 4), np.float32)
    c = np.zeros((32, 4), np.float32)
    where = np.zeros((32, 4, 2), int)
    for lane in range(32):
        group, tig = lane >> 2, lane % 4
        for i in range(8):
            row = group if i < 2 or 4 <= i < 6 else group + 8
            col = tig * 2 + (i & 1) + (8 if i >= 4 else 0)
            a[lane, i] = A[row, col]
        for i in range(4):
            b[lane, i] = B[tig * 2 + (i & 1) + (8 if i >= 2 else 0), group]
            where[lane, i] = (group if i < 2 else group + 8), tig * 2 + (i & 1)
            c[lane, i] = C[tuple(where[lane, i])]
    # .f16x2 (.bf16x2) registers: element 2j in the low half of register j
    a16, b16 = (narrow(v, "bfloat16" if bf16 else "float16").view(np.uint16) for v in (a, b))
    return a16.view(np.uint32), b16.view(np.uint32), c, where


@pytest.fixture(scope="module")
def mma_warp(tmp_path_factory):
    from cuda_host_kernels import HOST_DIR, find_gxx
    gxx = find_gxx()
    if gxx is None:
        pytest.skip("g++ not found")
    out = tmp_path_factory.mktemp("mma") / "mma_host.so"
    subprocess.run([gxx, "-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", str(HOST_DIR / "mma_host.cpp"),
                    "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.cuda_host_error.restype = ctypes.c_char_p

    def run(lanes: int, a, b, c, bf16: bool = False) -> tuple[int, np.ndarray, str]:
        d = np.full((32, 4), np.nan, np.float32)
        pointers = (ctypes.c_void_p(np.ascontiguousarray(v).ctypes.data) for v in (a, b, c))
        rc = lib.mma_warp(lanes, int(bf16), *pointers, ctypes.c_void_p(d.ctypes.data))
        return rc, d, lib.cuda_host_error().decode()
    return run


@pytest.mark.parametrize("bf16", [False, True])
def test_the_host_mma_is_the_ptx_m16n8k16(mma_warp, bf16):
    """The shim's mma_m16n8k16 (what gemm_* runs on the host; bf16: mma_m16n8k16_bf16, gemm_*_bf16's)
    computes D = A B + C from fragments laid out as the PTX ISA says, exactly for small
    integers (exact in fp16 and bf16, every sum exact in float32); a warp with a lane missing
    is an error, as the .aligned instruction requires."""
    rng = np.random.default_rng(4)
    A = rng.integers(-8, 8, (16, 16)).astype(np.float32)
    B = rng.integers(-8, 8, (16, 8)).astype(np.float32)
    C = rng.integers(-100, 100, (16, 8)).astype(np.float32)
    a, b, c, where = ptx_fragments(A, B, C, bf16)
    rc, d, error = mma_warp(32, a, b, c, bf16)
    assert rc == 0, error
    D = np.zeros((16, 8), np.float32)
    D[where[..., 0], where[..., 1]] = d
    np.testing.assert_array_equal(D, A @ B + C)
    rc, _, error = mma_warp(31, a, b, c, bf16)
    assert rc == 1 and "not all 32 lanes" in error


# The mat-vec's units (32 quant bytes: u4 64 weights, i8 32, bf16 16) at a row tail: i8 K % 32 == 16
# and bf16 K % 16 == 8 end on half a unit (Q6_K: two 16-weight scale slots a unit); R = 16 stages
# x in tiles of 1024 weights (3 of them, the last partial), R = 1 in one; 13 rows: the last warp
# of R = 1 (2 rows a warp) has one.
@pytest.mark.parametrize("qtype,K", [("Q8_0", 1056), ("Q6_K", 1280), ("BF16", 2312), ("Q4_K", 2304)])
def test_matvec_unit_tails_read_nothing_past_the_planes(quant_kernels, qtype, K):
    """Every plane and x end at an inaccessible page (a read past them faults), x's rows are
    wider than K (NaN past it: read, it would show in out), out is a column slice of a NaN buffer."""
    rng = np.random.default_rng(K)
    raw = random_raw(qtype, (N, K), rng)
    weight = uploaded(qtype, raw, (N, K))
    weight = dataclasses.replace(
        weight, q=guarded(weight.q), **{f: guarded(getattr(weight, f), getattr(weight, f).itemsize)
                                        for f in ("scale", "offset", "scale_super", "offset_super")
                                        if getattr(weight, f) is not None})
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(N, K)
    for rows in (1, 2, 16):
        padded = np.full((rows, K + 8), np.nan, np.float16)
        padded[:, :K] = rng.standard_normal((rows, K))
        x = guarded(padded)[:, :K]
        buffer = np.full((rows, N + 7), np.nan, np.float16)
        out = buffer[:, 3:3 + N]
        linear_for(quant_kernels).matvec(x, weight, out)
        check(out, x, repack(raw, qtype, (N, K)), reference)
        assert np.isnan(buffer[:, :3]).all() and np.isnan(buffer[:, 3 + N:]).all(), "written outside out"


# quant.cu with one deliberate fault each: the mat-vec's high-nibble runs read the low group's
# scale (MvU4::slot), and u6's high bits land one run off (dequant16_u6's shift)
BREAKAGES = {"Q4_K": ("static __device__ __forceinline__ int slot(int run) { return run >> 1; }",
                      "static __device__ __forceinline__ int slot(int run) { return 0; }"),
             "Q6_K": ("(((hi.u[i] >> (2 * run)) & 3) << 4)", "(((hi.u[i] >> (2 * (run ^ 1))) & 3) << 4)")}


def test_a_deliberately_broken_kernel_is_caught(tmp_path):
    """The checks above are not vacuous: quant.cu built with each BREAKAGES fault gives results
    the same check refuses (the mat-vec at batch 1 for Q4_K, the dequantized embedding rows for
    Q6_K's u6 plane), where the unbroken build passes them (the tests above)."""
    from cuda_host_kernels import HostBuild, find_gxx
    gxx = find_gxx()
    if gxx is None:
        pytest.skip("g++ not found")
    build = HostBuild(gxx, tmp_path)
    source = (tmp_path / "quant.cu").read_text()
    for good, bad in BREAKAGES.values():
        assert source.count(good) == 1, good
        source = source.replace(good, bad)
    (tmp_path / "quant.cu").write_text(source)
    broken = build.get("quant.cu")
    rng = np.random.default_rng(9)
    raw = random_raw("Q4_K", (N, 512), rng)
    x = rng.standard_normal((1, 512)).astype(np.float16)
    out = np.full((1, N), np.nan, np.float16)
    linear_for(broken)(x, uploaded("Q4_K", raw, (N, 512)), out)
    with pytest.raises(AssertionError, match="Q4_K/u4"):
        check(out, x, repack(raw, "Q4_K", (N, 512)), gguf.quants.dequantize(
            raw, gguf.GGMLQuantizationType.Q4_K).reshape(N, 512))
    raw = random_raw("Q6_K", (N, 512), rng)
    rows = np.full((N, 512), np.nan, np.float32)
    linear_for(broken).dequantize(uploaded("Q6_K", raw, (N, 512)), None, 0, N, rows)
    assert not np.array_equal(rows, dequantize(repack(raw, "Q6_K", (N, 512))))
