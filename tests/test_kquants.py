"""tools/kquants.py writes K-quant blocks gguf-py reads back (its dequantize is the yardstick of
the layout), and tools/quantize_gguf.py rewrites a whole GGUF in one type."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from ringserve.tools.kquants import K_TYPES, quantize_k
from ringserve.tools.quantize_gguf import K_FALLBACK, requantize
from ringserve.tools.tiny_gguf import make_tiny_gguf

# A sub-block's rounding step as a fraction of its largest magnitude: its range (at most twice
# that) over the top quant for the affine types, 1 / nmax for the symmetric ones. Rounding to
# it leaves an RMS error of step / sqrt(12); the median sub-block must be within 1.2x of that.
STEP = {"Q2_K": 2 / 3, "Q3_K": 1 / 4, "Q4_K": 2 / 15, "Q5_K": 2 / 31, "Q6_K": 1 / 32}


def sub_block_scaled(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Gaussian weights whose every 16-weight sub-block has its own size and mean: a scale or
    minimum read for the wrong sub-block shows as a large error."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols // 16, 16))
    x = x * rng.uniform(0.01, 1.0, (rows, cols // 16, 1)) + rng.normal(0, 0.3, (rows, cols // 16, 1))
    return x.reshape(rows, cols).astype(np.float32)


@pytest.mark.parametrize("type_name", K_TYPES)
def test_k_quant_blocks_read_back_by_gguf_py(type_name):
    x = sub_block_scaled(16, 512)
    x[3] = 0.0                                   # an all-zero row stays zero
    blocks = quantize_k(x, type_name)
    qtype = gguf.GGMLQuantizationType[type_name]
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    assert blocks.dtype == np.uint8 and blocks.shape == (16, 512 // block_weights * block_bytes)
    y = dequantize(blocks, qtype)
    assert np.all(y[3] == 0)
    err, xs = (x - y).reshape(16, -1, 16), x.reshape(16, -1, 16)
    rel = np.sqrt((err ** 2).mean(axis=-1)) / (np.abs(xs).max(axis=-1) + 1e-30)
    assert float(np.median(np.delete(rel, 3, axis=0))) < 1.2 * STEP[type_name] / np.sqrt(12)


def test_rows_not_of_whole_super_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.zeros((2, 576), np.float32), "Q4_K")


@pytest.mark.parametrize("type_name,hidden", [("Q6_K", 256), ("Q4_K", 64), ("Q8_0", 64)])
def test_requantize_rewrites_every_matrix(tmp_path, type_name, hidden):
    """Every 2-D tensor in the type (llama-quantize's fallback where a row is not whole super-
    blocks), 1-D ones float32, the metadata as it was but general.file_type."""
    src, out = tmp_path / "src.gguf", tmp_path / "out.gguf"
    make_tiny_gguf(src, hidden=hidden, heads=4, kv_heads=2, ffn=2 * hidden)
    requantize(src, type_name, out)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out)
    fields = lambda r: {k: f.contents() for k, f in r.fields.items()  # noqa: E731
                        if not k.startswith("GGUF.") and k != "general.file_type"}
    assert fields(a) == fields(b)
    expected = K_FALLBACK.get(type_name, type_name) if hidden % 256 else type_name
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert ta.name == tb.name and list(ta.shape) == list(tb.shape)
        wa, wb = dequantize(ta.data, ta.tensor_type), dequantize(tb.data, tb.tensor_type)
        if wa.ndim == 1:
            assert tb.tensor_type == gguf.GGMLQuantizationType.F32 and np.array_equal(wa, wb)
        else:
            assert tb.tensor_type.name == expected, ta.name
            assert np.sqrt(np.mean((wa - wb) ** 2)) < 0.1 * wa.std(), ta.name
