"""Safetensors loading without torch: one ``model.safetensors`` or a sharded
``model.safetensors.index.json``, into numpy arrays; then a check that every tensor the
Llama forward needs is there with the right shape.

numpy has no bfloat16, so BF16 tensors (the usual dtype of HF checkpoints) are read from
their raw bytes and widened to float32, which is exact.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from ringserve.gpu.config import ModelConfig
from ringserve.gpu.errors import ModelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_weights(model_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in ``model_dir``, by its HF name."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        return _load_sharded(model_dir, index)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return load_safetensors(single)
    raise ModelError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


def _load_sharded(model_dir: Path, index: Path) -> dict[str, np.ndarray]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{index}: not a safetensors index ({e})") from None
    weights: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        path = model_dir / shard
        if not path.is_file():
            raise ModelError(f"{path}: file not found (listed in {INDEX_FILE})")
        weights.update(load_safetensors(path))
    for name, shard in weight_map.items():
        if name not in weights:
            raise ModelError(f"{model_dir / shard}: tensor {name!r} listed in {INDEX_FILE} is missing")
    return weights


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file (the library validates header and sizes)."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
            dtypes = {name: f.get_slice(name).get_dtype() for name in names}
            tensors = {name: f.get_tensor(name) for name in names if dtypes[name] != "BF16"}
    except (SafetensorError, OSError) as e:
        raise ModelError(f"{path}: not a valid safetensors file ({_one_line(e)})") from None
    bf16 = [name for name in names if dtypes[name] == "BF16"]
    if bf16:
        tensors.update(_read_bf16(path, bf16))
    return tensors


def _read_bf16(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    # Layout: u64 header length, JSON header {name: {dtype, shape, data_offsets}}, data.
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        out = {}
        for name in names:
            begin, end = header[name]["data_offsets"]
            f.seek(data_start + begin)
            raw = np.frombuffer(f.read(end - begin), dtype="<u2")
            out[name] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(header[name]["shape"])
    return out


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors the Llama forward reads, with their shapes ([out, in] for projections)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    return shapes


def check_weights(weights: dict[str, np.ndarray], config: ModelConfig) -> None:
    """Raise ModelError naming the first needed tensor that is missing or misshapen."""
    for name, shape in expected_shapes(config).items():
        tensor = weights.get(name)
        if tensor is None:
            raise ModelError(f"weights: tensor {name!r} is missing")
        if tuple(tensor.shape) != shape:
            raise ModelError(f"weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"config.json implies {shape}")
        if not np.issubdtype(tensor.dtype, np.floating):
            raise ModelError(f"weights: tensor {name!r} has dtype {tensor.dtype}, expected floating point")
