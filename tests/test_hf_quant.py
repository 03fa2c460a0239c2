"""AWQ and GPTQ int4 checkpoints (gpu/loader/hf_quant.py): unpacked at load into u4 planes that
dequantize exactly as the formats define, against packers written here from AutoAWQ's and
AutoGPTQ's packing loops (numpy, element by element, independent of the unpacker); config
refusals; a tiny AWQ/GPTQ checkpoint loaded by load_weights. The kernels that read the planes
are run in tests/test_cuda_quant_host.py and the whole forward in
tests/test_cuda_forward_host.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.config import INT4_GROUP_SIZE, ModelConfig, int4_scheme
from ringserve.gpu.loader.hf_quant import unpack_awq, unpack_gptq
from ringserve.gpu.loader.quant import QuantWeight, dequantize
from ringserve.gpu.loader.weights import load_weights
from ringserve.tools.tiny_llama import make_tiny_llama

AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def pack_awq(intweight: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AutoAWQ WQLinear_GEMM.from_linear: intweight [K, N], zeros [K/g, N] -> qweight, qzeros
    (int32 [., N/8]; nibble i of word c holds column 8c + order_map[i])."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack(values: np.ndarray) -> np.ndarray:
        words = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
        for col in range(values.shape[1] // 8):
            for i in range(8):
                words[:, col] |= values[:, col * 8 + order_map[i]].astype(np.uint32) << (i * 4)
        return words.view(np.int32)
    return pack(intweight), pack(zeros)


def pack_gptq(intweight: np.ndarray) -> np.ndarray:
    """AutoGPTQ QuantLinear.pack: intweight [K, N] -> qweight int32 [K/8, N] (nibble j of row r:
    input row 8r + j)."""
    words = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), np.uint32)
    for row in range(words.shape[0]):
        for j in range(8):
            words[row] |= intweight[row * 8 + j].astype(np.uint32) << (4 * j)
    return words.view(np.int32)


def random_int4(n: int, k: int, rng: np.random.Generator, method: str) -> tuple[dict, np.ndarray]:
    """One random linear W [n, k] in `method`'s tensors, and its float32 values by the format's
    formula ((q - z) * s)."""
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    s = (rng.random((k // INT4_GROUP_SIZE, n)) * 0.004 + 0.001).astype(np.float16)
    if method == "awq":
        z = rng.integers(0, 16, (k // INT4_GROUP_SIZE, n), dtype=np.uint8)
        qweight, qzeros = pack_awq(q, z)
        tensors = {"qweight": qweight, "qzeros": qzeros, "scales": s}
    else:
        z = np.full((k // INT4_GROUP_SIZE, n), 8, np.uint8)
        zeros_minus_one = pack_awq(np.zeros((1, n), np.uint8),
                                   np.full((k // INT4_GROUP_SIZE, n), 7, np.uint8))[1]
        tensors = {"qweight": pack_gptq(q), "qzeros": zeros_minus_one, "scales": s,
                   "g_idx": (np.arange(k) // INT4_GROUP_SIZE).astype(np.int32)}
    group = np.arange(k) // INT4_GROUP_SIZE
    w = (q.astype(np.float32) - z[group].astype(np.float32)) * s[group].astype(np.float32)
    return tensors, np.ascontiguousarray(w.T)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_unpacked_planes_dequantize_exactly_as_the_format(method):
    rng = np.random.default_rng(1)
    tensors, want = random_int4(24, 384, rng, method)
    w = (unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"]) if method == "awq"
         else unpack_gptq(tensors["qweight"], tensors["scales"], tensors["g_idx"]))
    assert (w.kind, w.block, w.shape) == ("u4", INT4_GROUP_SIZE, (24, 384))
    np.testing.assert_array_equal(dequantize(w), want)


def test_gptq_act_order_is_refused():
    tensors, _ = random_int4(8, 256, np.random.default_rng(2), "gptq")
    with pytest.raises(ModelError, match="g_idx"):
        unpack_gptq(tensors["qweight"], tensors["scales"], tensors["g_idx"][::-1].copy())


@pytest.mark.parametrize("cfg", [
    dict(AWQ_CONFIG, version="gemv"), dict(AWQ_CONFIG, zero_point=False), dict(AWQ_CONFIG, group_size=64),
    dict(AWQ_CONFIG, bits=8), dict(GPTQ_CONFIG, desc_act=True), dict(GPTQ_CONFIG, sym=False),
    dict(GPTQ_CONFIG, checkpoint_format="gptq_v2"), {"quant_method": "fp8"},
    {"quant_method": "bitsandbytes", "load_in_4bit": True}, "awq"])
def test_any_other_quantization_config_is_refused_in_one_line_naming_it(cfg):
    with pytest.raises(ModelError) as e:
        int4_scheme(cfg)
    message = str(e.value)
    assert "\n" not in message and "quantization_config" in message
    assert json.dumps(cfg, sort_keys=True) in message


def test_the_config_refuses_it_at_load():
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelConfig.from_dict(dict(raw, quantization_config=AWQ_CONFIG)).quantization == "awq"
    assert ModelConfig.from_dict(dict(raw, quantization_config=GPTQ_CONFIG)).quantization == "gptq"
    assert ModelConfig.from_dict(raw).quantization is None
    with pytest.raises(ModelError, match="quantization_config"):
        ModelConfig.from_dict(dict(raw, quantization_config={"quant_method": "fp8"}))


def make_int4_llama(path: Path, method: str, seed: int = 0) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny random Llama (head_dim 64, every linear's input a multiple of 128) whose
    linears are random int4 in `method`'s checkpoint layout; returns the folder and each
    linear's float32 values (by the format's formula)."""
    make_tiny_llama(path, seed=seed, hidden=256, heads=4, kv_heads=2, ffn=256, tie_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = AWQ_CONFIG if method == "awq" else GPTQ_CONFIG
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(seed)
    values = {}
    for i in range(config["num_hidden_layers"]):
        for name in LINEARS:
            prefix = f"model.layers.{i}.{name}"
            n, k = tensors.pop(prefix + ".weight").shape
            packed, values[prefix + ".weight"] = random_int4(n, k, rng, method)
            tensors.update({f"{prefix}.{key}": a for key, a in packed.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, values


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_checkpoint_loads_with_each_linear_one_packed_weight(tmp_path, method):
    path, values = make_int4_llama(tmp_path / method, method)
    weights = load_weights(path)
    assert not any(name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for name in weights)
    for name, want in values.items():
        w = weights[name]
        assert isinstance(w, QuantWeight) and w.qtype == method.upper()
        np.testing.assert_array_equal(np.asarray(w), want)  # a float store widens it as it is
