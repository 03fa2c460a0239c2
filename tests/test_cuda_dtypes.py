"""The CUDA backend's serving dtype without a GPU (gpu/cuda/dtypes.py, issue 25 item 2): what
`--dtype` resolves to for each checkpoint dtype, the refusal of weights fp16 cannot hold (and
of fp16 for Gemma 3), and the dense store's bf16 bits (a BF16 checkpoint's own, exactly)."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from ringserve.gpu.bfloat16 import to_bfloat16, widen_bfloat16
from ringserve.gpu.cuda.buffers import DenseStore
from ringserve.gpu.cuda.dtypes import (
    check_fp16_range,
    checkpoint_dtype,
    resolve_dtype,
    serving_dtype,
)
from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.weights import GGMLTensor, load_safetensors, load_weights
from ringserve.gpu.models.llama import LlamaWeights
from ringserve.tools.tiny_llama import make_tiny_llama, save_bf16

# (requested, checkpoint) -> served; None: refused
TABLE = {
    ("auto", "bfloat16"): "bfloat16", ("auto", "float16"): "float16", ("auto", "float32"): "float16",
    ("auto", "quantized"): "float16",
    ("float16", "bfloat16"): "float16", ("float16", "float16"): "float16", ("float16", "float32"): "float16",
    ("float16", "quantized"): "float16",
    ("bfloat16", "bfloat16"): "bfloat16", ("bfloat16", "float16"): "bfloat16",
    ("bfloat16", "float32"): "bfloat16", ("bfloat16", "quantized"): "bfloat16",
    ("float32", "bfloat16"): None, ("float32", "float32"): None,
}


@pytest.mark.parametrize("requested,checkpoint", sorted(TABLE))
def test_the_dtype_table(requested, checkpoint):
    want = TABLE[requested, checkpoint]
    if want is None:
        with pytest.raises(ValueError, match=f"dtype '{requested}'"):
            resolve_dtype(requested, checkpoint)
    else:
        assert resolve_dtype(requested, checkpoint) == want


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same tiny model as a bfloat16, a float16 and a float32 checkpoint."""
    root = tmp_path_factory.mktemp("dtypes")
    bf16 = make_tiny_llama(root / "bf16", dtype="bfloat16")
    f32 = make_tiny_llama(root / "f32")
    f16 = make_tiny_llama(root / "f16")
    save_file({k: v.astype(np.float16) for k, v in load_weights(f32).items()}, str(f16 / "model.safetensors"))
    return {"bfloat16": bf16, "float16": f16, "float32": f32}


def test_the_checkpoint_dtype_is_read_from_its_weights(folders):
    for dtype, folder in folders.items():
        assert checkpoint_dtype(load_weights(folder)) == dtype


def test_a_bf16_checkpoint_keeps_its_bits_in_bf16_and_narrows_exactly_to_fp16(folders):
    """Served in bf16 every weight is the file's bits; in fp16 each is the same value (tiny
    weights are normal fp16 numbers with 8 significant bits: exact)."""
    c = ModelConfig.from_dir(folders["bfloat16"])
    hf = load_weights(folders["bfloat16"])
    as_bf16 = LlamaWeights.fuse(c, hf, DenseStore(np, "bfloat16"))
    as_fp16 = LlamaWeights.fuse(c, hf, DenseStore(np, "float16"))
    raw = hf["model.layers.0.mlp.down_proj.weight"]
    assert as_bf16.layers[0].down.dtype == np.uint16
    bits = np.asarray(raw.raw).view(np.uint16).reshape(raw.shape)
    np.testing.assert_array_equal(as_bf16.layers[0].down, bits)
    np.testing.assert_array_equal(widen_bfloat16(np, as_bf16.layers[0].gate_up),
                                  as_fp16.layers[0].gate_up.astype(np.float32))
    assert as_bf16.final_norm.dtype == np.uint16  # norms too: the file's values, exactly
    np.testing.assert_array_equal(widen_bfloat16(np, as_bf16.final_norm), hf["model.norm.weight"])
    assert as_bf16.nbytes_by_type().keys() == {"BF16"}


def test_bf16_rounding_is_torchs():
    """Round to nearest, ties to even; exact for values bf16 holds (a subnormal too)."""
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -7), 2 ** -130], np.float32)
    want = np.array([1.0, 1.0, 1 + 2 ** -6, -(1 + 2 ** -7), 2 ** -130], np.float32)
    np.testing.assert_array_equal(widen_bfloat16(np, to_bfloat16(np, x)), want)


# (checkpoint, largest |w|, refused): bf16's largest below 2^16 is 65280; float32 rounds to
# fp16's 65504 up to 65519.99, to inf from 65520
RANGE_CASES = [("bfloat16", 65280.0, False), ("bfloat16", 65536.0, True), ("bfloat16", -1048576.0, True),
               ("float32", 65504.0, False), ("float32", 65519.0, False), ("float32", 65520.0, True),
               ("float32", -1048576.0, True)]


@pytest.mark.parametrize("dtype,value,refused", RANGE_CASES)
def test_narrowing_to_fp16_refuses_what_fp16_cannot_hold(folders, tmp_path, dtype, value, refused):
    """One weight beyond fp16's range (|w| rounding to inf) in a bf16 or float32 checkpoint:
    refused in one line naming the tensor; what fp16 holds (or rounds down into it) taken."""
    name = "model.layers.1.self_attn.o_proj.weight"
    weights = {k: np.asarray(v, np.float32) for k, v in load_weights(folders[dtype]).items()}
    weights[name][3, 5] = value
    path = tmp_path / "model.safetensors"
    if dtype == "bfloat16":
        save_bf16(weights, path)
    else:
        save_file(weights, str(path))
    loaded = load_safetensors(path)
    if refused:
        with pytest.raises(ModelError, match=f"tensor '{name}' holds values up to .* beyond float16") as e:
            check_fp16_range(loaded)
        assert "\n" not in str(e.value) and f"{abs(value):.6g}" in str(e.value)
    else:
        check_fp16_range(loaded)


@pytest.mark.parametrize("weights", [
    {"w": np.zeros((2, 32), np.float32)},                                     # a float32 checkpoint
    {"w": GGMLTensor("Q8_0", (2, 32), np.zeros((2, 34), np.uint8))},           # a GGUF's blocks
])
def test_gemma3_is_served_in_bf16_and_refused_in_fp16(weights):
    """Gemma 3's activations outgrow fp16 (vLLM refuses float16 for it): auto serves it in bf16
    whatever the checkpoint would get otherwise, float16 is refused in one line; a Llama keeps
    the table's choice."""
    assert serving_dtype("auto", weights, "LlamaForCausalLM") == "float16"
    assert serving_dtype("auto", weights, "Gemma3ForCausalLM") == "bfloat16"
    assert serving_dtype("bfloat16", weights, "Gemma3ForCausalLM") == "bfloat16"
    with pytest.raises(ModelError, match="--dtype float16: Gemma 3's activations overflow float16") as e:
        serving_dtype("float16", weights, "Gemma3ForCausalLM")
    assert "\n" not in str(e.value)
