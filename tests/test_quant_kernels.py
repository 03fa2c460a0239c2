"""GGUF weights kept packed (gpu/loader/quant.py) and their CPU kernels (gpu/cpu/quant_kernels.py), against
gguf-py's own ``dequantize``: every type, on random blocks (any bytes are a valid block once its f16
scale fields are finite), every kernel path (fused streaming, dequantized tiles in float32, BLAS),
one thread and several.

Exactness: repacking loses nothing (dequantizing the packed planes is bit-identical to gguf-py).
The kernels compute in float32 like the float path, so ``x @ W.T`` is compared with gguf-py's
dequantize followed by a float64 matmul, to within the classical bound for a float32 dot product
of length K in any summation order, |error| <= gamma_K * sum |x_i w_i| with gamma_K ~ K u
(u = 2^-24), plus the rounding of each weight (gguf-py rounds ``scale * q`` and ``+ offset``
separately; an FMA rounds once: at most 2u (|scale * q| + |offset|)). We allow (K + 2) * 2^-23
times sum |x_i| (|scale q_i| + |offset_i|): 3e-5 of it for K = 512, while any wrong quant, scale,
offset, zero point or row lands at O(1) of it (the observed errors are ~1e-7 of it).
"""
from __future__ import annotations

import dataclasses

import gguf
import gguf.quants
import numpy as np
import pytest

from ringserve.gpu.cpu import quant_kernels as cpu_quant_kernels
from ringserve.gpu.cpu.quant_kernels import SMALL_ROWS, STREAM_ROWS, quant_linear
from ringserve.gpu.loader.quant import (
    BLOCK_SIZES,
    QuantWeight,
    as_halves,
    dequantize,
    plane_values,
    random_raw,
    repack,
)

TYPES = list(BLOCK_SIZES)
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
# STREAM_ROWS (1): fused streaming; 2, 3, 8, 17, 23: dequantized tiles of 4 rows x 4 tokens, then
# x 2 and x 1 for the tokens left over (3: 2 + 1; 17: 4 x 4 + 1; 23: 5 x 4 + 2 + 1); 100 >
# SMALL_ROWS: dequantized chunks and BLAS.
ROWS = [STREAM_ROWS, 2, 3, 8, 17, 23, 100]


def gguf_weights(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(shape)


def magnitude(w: QuantWeight) -> np.ndarray:
    """|scale * q| + |offset| per weight: what the rounding error scales with."""
    if w.offset is None:
        return np.abs(dequantize(w)).astype(np.float64)
    part = np.abs(dequantize(dataclasses.replace(w, offset=None, offset_super=None))).astype(np.float64)
    return part + np.repeat(np.abs(plane_values(w.offset, w.offset_super, w.block)), w.block, axis=1)


def check_linear(x: np.ndarray, w: QuantWeight, reference: np.ndarray, parallel: bool) -> None:
    want = x.astype(np.float64) @ reference.astype(np.float64).T
    bound = (x.shape[1] + 2) * 2.0 ** -23 * (np.abs(x).astype(np.float64) @ magnitude(w).T)
    got = quant_linear(x, w, parallel=parallel)
    assert got.dtype == np.float32 and got.shape == want.shape
    err = np.abs(got - want)
    assert np.all(err <= bound), f"{w.qtype}: worst error {(err / bound).max():.3g} of the bound"


def test_block_sizes_are_ggmls():
    for qtype, sizes in BLOCK_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]] == sizes


@pytest.mark.parametrize("qtype", TYPES)
def test_repack_round_trips_exactly(qtype):
    rng = np.random.default_rng(1)
    bs = BLOCK_SIZES[qtype][0]
    shapes = [(5, 512), (3, 768)] + ([(4, 96)] if bs == 32 else []) + ([(3, 7)] if bs == 1 else [])
    for shape in shapes:
        raw = random_raw(qtype, shape, rng)
        w = repack(raw, qtype, shape)
        if qtype in FOUR_BIT:  # nibbles when the row fills 64-weight groups, else int8
            assert w.kind == ("u4" if shape[1] % 64 == 0 else "i8")
        want = gguf_weights(qtype, raw, shape)
        # every form of the scale planes: float32, factored (K-quants), float16 (exact halves)
        for form in (w, repack(raw, qtype, shape, factored=True), as_halves(w)):
            got = dequantize(form)
            assert got.dtype == np.float32 and got.shape == shape
            if w.kind == "u4" and qtype == "Q4_0":  # d * q + (-8 d) is +0.0 where gguf-py has d * 0
                np.testing.assert_array_equal(got, want)  # equal as numbers: -0.0 == 0.0
            else:
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit


K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("qtype", TYPES)
def test_compact_scale_planes(qtype):
    """repack(factored=True): the K-quants' scales as int8 factors [out, in / block] of float32
    super planes [out, in / 256] (d; -dmin), the other types as without it; as_halves: float32
    planes of exact halves (every legacy type's f16 fields) as float16, others as they are.
    nbytes counts every plane."""
    rng = np.random.default_rng(6)
    shape = (6, 768)
    raw = random_raw(qtype, shape, rng)
    plain, factored = repack(raw, qtype, shape), repack(raw, qtype, shape, factored=True)
    if qtype in K_QUANTS:
        assert factored.scale.dtype == np.int8 and factored.scale_super.shape == (6, 3)
        assert factored.scale_super.dtype == np.float32
        assert (factored.offset is None) == (factored.offset_super is None) == (plain.offset is None)
        planes = 1 if plain.offset is None else 2
        assert factored.nbytes == plain.q.nbytes + planes * (plain.scale.size + 4 * 6 * 3)
        assert as_halves(factored) is factored  # int8 factors stay
    else:
        assert all(a is b or np.array_equal(a, b)
                   for a, b in zip(factored.planes(), plain.planes(), strict=True))
        assert factored.scale_super is None
    halves = as_halves(plain)
    if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        assert halves.scale.dtype == np.float16 and halves.nbytes < plain.nbytes
        assert halves.offset is None or halves.offset.dtype == np.float16
    elif qtype in ("F32", "F16", "BF16"):
        assert halves is plain  # no planes to narrow
    if plain.scale is not None:
        tenth = dataclasses.replace(plain, scale=np.full_like(plain.scale, 0.1))
        assert as_halves(tenth) is tenth  # 0.1 is no half: kept float32


def test_rows_of_compact_weights():
    """take_rows and concat_rows carry the super planes and the fp16 planes; a factored weight
    never stacks with a plain one (concat_rows refuses, stack_packed keeps them apart)."""
    from ringserve.gpu.loader.packing import SplitWeight, as_fused, stack_packed
    from ringserve.gpu.loader.quant import concat_rows, take_rows
    from ringserve.gpu.loader.weights import GGMLTensor
    rng = np.random.default_rng(9)
    for qtype in ("Q4_K", "Q6_K", "Q4_1"):
        raws = [random_raw(qtype, (n, 512), rng) for n in (5, 3)]
        ws = [as_halves(repack(r, qtype, (len(r), 512), factored=True)) for r in raws]
        want = np.concatenate([dequantize(repack(r, qtype, (len(r), 512))) for r in raws])
        both = concat_rows(ws)
        assert both.shape == (8, 512) and both.nbytes == sum(w.nbytes for w in ws)
        np.testing.assert_array_equal(dequantize(both), want)
        perm = rng.permutation(8)
        np.testing.assert_array_equal(dequantize(take_rows(both, perm)), want[perm])
    raw = random_raw("Q4_K", (4, 512), rng)
    factored, plain = repack(raw, "Q4_K", (4, 512), factored=True), repack(raw, "Q4_K", (4, 512))
    with pytest.raises(ValueError, match="cannot stack"):
        concat_rows([factored, plain])
    split = as_fused(stack_packed([factored, GGMLTensor("Q4_K", (4, 512), raw)]))
    assert isinstance(split, SplitWeight) and [p.scale.dtype for p in split.parts] == [np.int8, np.float32]
    fused = as_fused(stack_packed([GGMLTensor("Q4_K", (4, 512), raw)] * 2, factored=True))
    assert isinstance(fused, QuantWeight) and fused.scale_super.shape == (8, 2)


def test_repack_refuses_what_it_cannot_hold():
    raw = np.zeros((2, 18), np.uint8)
    with pytest.raises(ValueError, match="not supported"):
        repack(raw, "IQ4_XS", (2, 32))
    with pytest.raises(ValueError, match="expected 36"):
        repack(raw[:, :17], "Q4_0", (2, 32))
    with pytest.raises(ValueError, match="whole number"):
        repack(raw, "Q4_0", (2, 48))


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_matches_gguf_dequantize(qtype, rows, parallel):
    assert rows <= SMALL_ROWS or rows == ROWS[-1]
    rng = np.random.default_rng(rows)
    shape = (150, 512)  # 150 rows: several tiles, and a partial one, per task
    raw = random_raw(qtype, shape, rng)
    w = repack(raw, qtype, shape)
    x = rng.standard_normal((rows, shape[1])).astype(np.float32)
    check_linear(x, w, gguf_weights(qtype, raw, shape), parallel)


@pytest.mark.parametrize("k", [96, 160, 576])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_1", "Q4_0", "Q4_1"])
def test_stream_kernels_with_sub_blocks_left_over(qtype, k):
    """Rows whose sub-blocks do not fill the fused kernels' groups: 576 = 18 sub-blocks (pairs,
    not 4s) = 9 nibble groups (singles, not pairs); 160 = 5 sub-blocks; 96 = 3 (and int8 planes
    for the 4-bit types: not whole 64-weight groups)."""
    rng = np.random.default_rng(k)
    shape = (13, k)
    raw = random_raw(qtype, shape, rng)
    w = repack(raw, qtype, shape)
    for rows in (1, 5):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        check_linear(x, w, gguf_weights(qtype, raw, shape), False)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_four_bit_rows_that_are_not_whole_nibble_groups(qtype):
    rng = np.random.default_rng(2)
    shape = (21, 96)  # int8 planes: 96 is 1.5 groups of 64
    raw = random_raw(qtype, shape, rng)
    w = repack(raw, qtype, shape)
    assert w.kind == "i8"
    for rows in ROWS:
        x = rng.standard_normal((rows, 96)).astype(np.float32)
        check_linear(x, w, gguf_weights(qtype, raw, shape), True)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "F16"])
def test_blas_path_in_several_chunks(qtype, monkeypatch):
    monkeypatch.setattr(cpu_quant_kernels, "WIDEN_FLOATS", 64 * 512)  # 64-row chunks: 3 for 150 rows
    rng = np.random.default_rng(3)
    shape = (150, 512)
    raw = random_raw(qtype, shape, rng)
    w = repack(raw, qtype, shape)
    for parallel in (False, True):
        check_linear(rng.standard_normal((SMALL_ROWS + 1, 512)).astype(np.float32), w,
                     gguf_weights(qtype, raw, shape), parallel)


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_f16_kernels_read_every_half_exactly(rows):
    """All 65536 half bit patterns (subnormals, infinities, nans, -0) as a [65536, 1] weight:
    y = x @ W.T with x = 1 is each half's value, on each path."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    w = repack(bits.view(np.uint8), "F16", (1 << 16, 1))
    with np.errstate(invalid="ignore"):  # BLAS on nans and infinities
        got = quant_linear(np.ones((rows, 1), np.float32), w)
    want = np.broadcast_to(bits.view(np.float16).astype(np.float32), got.shape)
    np.testing.assert_array_equal(got, want)  # nan == nan here; -0.0 == 0.0
    finite = np.isfinite(want[0])
    np.testing.assert_array_equal(np.signbit(got[0][finite & (want[0] != 0)]),
                                  np.signbit(want[0][finite & (want[0] != 0)]))


def test_bench_quant_tool(tmp_path, capsys):
    """tools/bench_quant.py at a tiny size: a table per shape and thread count, one row a type
    (a type whose blocks do not tile a row left out), and the --json rows."""
    import json

    from ringserve.tools import bench_quant
    path = tmp_path / "q.json"
    bench_quant.main(["--types", "Q4_0", "Q6_K", "--shape", "8x64", "--batch", "1", "3", "--int8-4bit",
                      "--threads", "1", "--repeats", "1", "--rounds", "1", "--json", str(path)])
    text = capsys.readouterr().out
    assert "W 8x64 (out x in), 1 thread(s):" in text
    assert "| numpy f32 |" in text and "| Q4_0 " in text and "Q6_K" not in text  # 64 < 256
    rows = json.loads(path.read_text())["rows"]
    types = ("numpy f32", "Q4_0", "Q4_0 i8")
    assert {(r["type"], r["batch"]) for r in rows} == {(t, b) for t in types for b in (1, 3)}
    kinds = {r["type"]: (r["kind"], r["bytes_per_weight"]) for r in rows}
    assert kinds == {"numpy f32": ("f32", 4), "Q4_0": ("u4", 0.75), "Q4_0 i8": ("i8", 1.125)}
    assert all(r["gweights_s"] > 0 for r in rows)
    from ringserve.gpu.cpu.int8_kernels import has_vnni
    if has_vnni():  # 16 rows: one tile of the int8-activation kernels (8 rows are not one)
        bench_quant.main(["--types", "Q4_0", "--shape", "16x64", "--batch", "1", "--activations", "int8",
                          "vnni", "--threads", "1", "--repeats", "1", "--rounds", "1", "--json", str(path)])
        rows = json.loads(path.read_text())["rows"]
        assert {(r["type"], r["kind"]) for r in rows} == {("numpy f32", "f32"), ("Q4_0 x int8", "u4x16"),
                                                          ("Q4_0 x int8 vnni", "u4x16")}


def test_default_model_gguf_packed(default_model_dir):
    """Every matrix of the real default model's GGUF (Q4_1, its embedding Q8_0) packed from the
    memory map: bit-identical to gguf-py's dequantize; a row permutation is the permuted rows; and
    one decode row and one 8-token batch through the layer-0 matrices and the embedding."""
    from ringserve.gpu.loader.gguf_convert import open_gguf
    from ringserve.gpu.loader.model_store import default_gguf_path
    from ringserve.gpu.loader.quant import from_gguf, take_rows

    reader = open_gguf(default_gguf_path())
    rng = np.random.default_rng(4)
    kinds = set()
    for tensor in reader.tensors:
        if len(tensor.shape) != 2:
            continue
        w = from_gguf(tensor)
        kinds.add((w.qtype, w.kind))
        want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [out, in], as the reader's rows
        assert w.shape == want.shape == (tensor.data.shape[0], int(tensor.shape[0]))
        np.testing.assert_array_equal(dequantize(w), want, err_msg=tensor.name)
        if tensor.name.startswith("blk.0.") or tensor.name == "token_embd.weight":
            perm = rng.permutation(w.shape[0])
            np.testing.assert_array_equal(dequantize(take_rows(w, perm)), want[perm])
            for rows in (1, 8):
                x = rng.standard_normal((rows, w.shape[1])).astype(np.float32)
                check_linear(x, w, want, parallel=True)
    assert kinds == {("Q4_1", "u4"), ("Q8_0", "i8")}


@pytest.mark.parametrize("qtype", FOUR_BIT)
def test_four_bit_types_as_int8_planes(qtype):
    """repack(nibbles=False): the same weights as int8 planes, on every path."""
    rng = np.random.default_rng(5)
    shape = (150, 512)
    raw = random_raw(qtype, shape, rng)
    w = repack(raw, qtype, shape, nibbles=False)
    assert w.kind == "i8" and w.q.dtype == np.int8
    want = gguf_weights(qtype, raw, shape)
    np.testing.assert_array_equal(dequantize(w), want)
    for rows in ROWS:
        check_linear(rng.standard_normal((rows, 512)).astype(np.float32), w, want, True)


def _step(tokens: list[int], start: int):
    from ringserve.gpu.batch import Batch
    pos = np.arange(start, start + len(tokens), dtype=np.int32)
    return Batch(input_ids=np.array(tokens, dtype=np.int32), positions=pos, slot_mapping=pos.copy(),
                 query_start_loc=np.array([0, len(tokens)], dtype=np.int32),
                 seq_lens=np.array([start + len(tokens)], dtype=np.int32),
                 block_tables=np.arange(8, dtype=np.int32)[None])
