"""Model config and weights: unsupported input is refused with one line that names the field,
file or tensor; sharded checkpoints load exactly like single files."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ringserve.gpu.bfloat16 import to_bfloat16, widen_bfloat16
from ringserve.gpu.cpu.ops import CpuWeightStore
from ringserve.gpu.cuda.buffers import DenseStore
from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.config import ModelConfig, RopeScaling
from ringserve.gpu.loader.weights import load_weights
from ringserve.gpu.models.llama import LlamaWeights
from ringserve.gpu.rope import inv_freq
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig
from ringserve.tools.tiny_llama import save_bf16


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


_DELETE = object()


def one_line_error(match: str, fn, *args) -> str:
    with pytest.raises(ModelError, match=match) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message and message
    return message


def test_tiny_config(tiny_model_dir):
    c = ModelConfig.from_dir(tiny_model_dir)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (2, 64, 4, 2)
    assert c.head_dim == 16 and c.tie_word_embeddings and c.rope_scaling is None
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)


@pytest.mark.parametrize("changes, match", [
    ({"architectures": ["GPT2LMHeadModel"]},
     r"config.json: architectures \['GPT2LMHeadModel'\] is not supported \(supported: LlamaForCausalLM"),
    ({"architectures": _DELETE}, r"config.json: architectures None is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"config.json: rope_scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     r"config.json: rope_scaling type 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"config.json: missing field 'low_freq_factor'"),
    ({"layer_types": ["full_attention", "chunked_attention"]},
     r"config.json: layer_types\[1\] 'chunked_attention' is not supported \('full_attention' or "),
    ({"layer_types": ["full_attention"]},
     r"config.json: layer_types must be a list of num_hidden_layers \(2\) entries, not \['full_att"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": "4k"},
     r"config.json: sliding_window '4k' must be a positive integer"),
    ({"hidden_act": "gelu"}, r"config.json: hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, r"config.json: mlp_bias"),
    ({"hidden_size": _DELETE}, r"config.json: missing field 'hidden_size'"),
    ({"num_hidden_layers": "2"}, r"config.json: num_hidden_layers '2' must be a positive integer"),
    ({"num_key_value_heads": 3},
     r"config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"tie_word_embeddings": "yes"}, r"config.json: tie_word_embeddings 'yes' must be true or false"),
])
def test_config_errors_name_the_field(model_copy, changes, match):
    edit_config(model_copy, **changes)
    one_line_error(match, ModelConfig.from_dir, model_copy)


_SHAPE = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4, num_attention_heads=2,
              max_position_embeddings=4096)
S, F = "sliding_attention", "full_attention"


def arch(family: str, **raw) -> dict:
    return dict(architectures=[f"{family}ForCausalLM"], **raw)


@pytest.mark.parametrize("raw, windows", [
    # Mistral: every layer slides (transformers' MistralForCausalLM); a layer_types list
    # interleaves, as Ministral-8B's config and vLLM read it
    (arch("Mistral", sliding_window=24), (24, 24, 24, 24)),
    (arch("Mistral", sliding_window=None), (0, 0, 0, 0)),
    (arch("Mistral", sliding_window=4096), (0, 0, 0, 0)),  # >= max positions
    (arch("Mistral", sliding_window=24, layer_types=[S, F, S, F]), (24, 0, 24, 0)),
    (arch("Ministral", sliding_window=24, layer_types=[F, S, S, S]), (0, 24, 24, 24)),
    # Qwen2/Qwen3: only with use_sliding_window, and then layers >= max_window_layers (default 28)
    (arch("Qwen3", sliding_window=24), (0, 0, 0, 0)),
    (arch("Qwen3", sliding_window=24, use_sliding_window=True), (0, 0, 0, 0)),
    (arch("Qwen2", sliding_window=24, use_sliding_window=True, max_window_layers=1),
     (0, 24, 24, 24)),
    (arch("Qwen3", sliding_window=24, use_sliding_window=True, max_window_layers=0),
     (24, 24, 24, 24)),
    (arch("Llama", sliding_window=24), (0, 0, 0, 0)),  # transformers ignores it
])
def test_layer_windows_as_transformers_derives_them(raw, windows):
    c = ModelConfig.from_dict(_SHAPE | raw)
    assert c.layer_windows == windows
    assert c.uniform_window == (windows[0] if len(set(windows)) == 1 else 0)


def test_config_file_errors(model_copy):
    (model_copy / "config.json").write_text("{not json")
    one_line_error(r"config.json: cannot read JSON", ModelConfig.from_dir, model_copy)
    (model_copy / "config.json").unlink()
    one_line_error(r"config.json: file not found", ModelConfig.from_dir, model_copy)


def test_eos_ids_merge_generation_config(model_copy):
    edit_config(model_copy, eos_token_id=[2, 5])
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert ModelConfig.from_dir(model_copy).eos_token_ids == (2, 5, 7)


def test_llama3_rope_scaling(model_copy):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    edit_config(model_copy, rope_scaling=scaling, rope_theta=500000.0)
    c = ModelConfig.from_dir(model_copy)
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    plain = inv_freq(ModelConfig.from_dict({**json.loads((model_copy / "config.json").read_text()),
                                            "rope_scaling": None}))
    scaled = inv_freq(c)
    wavelen = 2 * np.pi / plain
    # Fast (short-wavelength) pairs kept, slow ones divided by the factor, the middle between.
    np.testing.assert_allclose(scaled[wavelen < 64 / 4], plain[wavelen < 64 / 4])
    np.testing.assert_allclose(scaled[wavelen > 64], plain[wavelen > 64] / 8.0, rtol=1e-6)
    middle = (wavelen >= 16) & (wavelen <= 64)
    assert middle.any()
    assert np.all(scaled[middle] < plain[middle]) and np.all(scaled[middle] > plain[middle] / 8.0)


def shard(model_dir: Path, num_shards: int) -> None:
    """Rewrite model_dir's single file as num_shards files with an index, as HF does."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, str(model_dir / file))
        weight_map.update({n: file for n in part})
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model_dir / "model.safetensors").unlink()


def test_sharded_equals_single_file(tiny_model_dir, model_copy):
    shard(model_copy, 3)
    single, sharded = load_weights(tiny_model_dir), load_weights(model_copy)
    assert sorted(single) == sorted(sharded)
    for name in single:
        np.testing.assert_array_equal(single[name], sharded[name])
    ModelRunner(model_copy, DeviceConfig(device="cpu"),
                CacheConfig(num_gpu_blocks_override=4))  # and the runner takes it


def test_bf16_tensors_widen_exactly(model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    # Every tensor cut to a bf16 bit pattern (so writing it as BF16 rounds nothing), then written
    # as a BF16 safetensors file: each must load back as exactly those float32 values.
    expected = {name: ((t.view(np.uint32) >> 16) << 16).view(np.float32) for name, t in tensors.items()}
    save_bf16(expected, model_copy / "model.safetensors")
    loaded = load_weights(model_copy)
    for name, want in expected.items():
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], want)


def test_missing_weights_file(model_copy):
    (model_copy / "model.safetensors").unlink()
    one_line_error(r"no model.safetensors or model.safetensors.index.json", load_weights, model_copy)


def test_missing_shard(model_copy):
    shard(model_copy, 2)
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    msg = one_line_error(r"model-00002-of-00002.safetensors: file not found", load_weights, model_copy)
    assert "index.json" in msg


@pytest.mark.parametrize("cut", [4, 100, 1000])
def test_truncated_safetensors(model_copy, cut):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-cut] if cut != 4 else data[:4])
    msg = one_line_error(r"model.safetensors: not a valid safetensors file", load_weights, model_copy)
    assert str(path) in msg


def test_garbage_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    one_line_error(r"model.safetensors: not a valid safetensors file", ModelRunner, model_copy)


def test_missing_tensor(model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(model_copy / "model.safetensors"))
    one_line_error(r"weights: tensor 'model.layers.1.mlp.up_proj.weight' is missing", ModelRunner, model_copy)


def test_misshapen_tensor(model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
    save_file(tensors, str(model_copy / "model.safetensors"))
    one_line_error(r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(64, 64\), "
                   r"config.json implies \(32, 64\)", ModelRunner, model_copy)


def test_untied_lm_head_is_required(model_copy):
    edit_config(model_copy, tie_word_embeddings=False)
    one_line_error(r"weights: tensor 'lm_head.weight' is missing", ModelRunner, model_copy)


def as_float32(a: np.ndarray) -> np.ndarray:
    return widen_bfloat16(np, a) if a.dtype == np.uint16 else a.astype(np.float32)


@pytest.mark.parametrize("store", [CpuWeightStore("float32"), CpuWeightStore("bfloat16"),
                                   DenseStore(np, "float16"), DenseStore(np, "bfloat16")],
                         ids=["cpu-float32", "cpu-bfloat16", "cuda-fp16", "cuda-bf16"])
def test_one_weight_mapping_for_every_backend(tiny_model_dir, store):
    """gpu/models/llama.py LlamaWeights.fuse is the one HF -> fused mapping: each backend's store gets
    q|k|v and gate|up stacked in that order, the tied lm_head is the embedding, norms stay
    vectors; and every backend refuses a checkpoint with a tensor missing, by name."""
    c = ModelConfig.from_dir(tiny_model_dir)
    hf = load_weights(tiny_model_dir)
    fused = LlamaWeights.fuse(c, hf, store)
    p = "model.layers.1."
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    parts = {"qkv": [("self_attn.q_proj", 0, q), ("self_attn.k_proj", q, q + kv),
                     ("self_attn.v_proj", q + kv, q + 2 * kv)],
             "gate_up": [("mlp.gate_proj", 0, inter), ("mlp.up_proj", inter, 2 * inter)]}
    for name, pieces in parts.items():
        stacked = as_float32(getattr(fused.layers[1], name))
        assert stacked.shape[0] == pieces[-1][2]
        for hf_name, lo, hi in pieces:
            want = as_float32(store.linear([hf[p + hf_name + ".weight"]]))
            np.testing.assert_array_equal(stacked[lo:hi], want, err_msg=f"{name} {hf_name}")
    assert fused.lm_head is fused.embed and c.tie_word_embeddings
    np.testing.assert_array_equal(fused.layers[1].post_norm,
                                  stored_vector(store, hf[p + "post_attention_layernorm.weight"]))
    del hf[p + "mlp.down_proj.weight"]
    one_line_error(r"weights: tensor 'model.layers.1.mlp.down_proj.weight' is missing",
                   LlamaWeights.fuse, c, hf, store)


def stored_vector(store, v: np.ndarray) -> np.ndarray:
    """Norm weights: float32 on the CPU (also with bfloat16 linears), the serving dtype on CUDA
    (fp16, or bf16 bits rounded to nearest even)."""
    if not isinstance(store, DenseStore):
        return v.astype(np.float32)
    return v.astype(np.float16) if store.dtype == "float16" else to_bfloat16(np, v)
