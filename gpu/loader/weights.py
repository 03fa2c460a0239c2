"""Safetensors loading without torch: one ``model.safetensors`` or a sharded
``model.safetensors.index.json``, into numpy arrays; then a check that every tensor the
model's forward needs is there with the right shape.

numpy has no bfloat16, and a folder converted from a GGUF keeps block-quantized tensors as
their raw blocks (gpu/loader/gguf_convert.py): both load as GGMLTensor (memory-mapped raw bytes and
their GGML type), which numpy reads as its float32 values (np.asarray widens or dequantizes,
exactly), so a weight store that wants floats needs nothing special and one that keeps them
packed can take them as they are.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
from safetensors import SafetensorError, safe_open

from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.config import GEMMA3, ModelConfig

BLOCK_TYPES_KEY = "ringserve.block_types"  # gpu/loader/gguf_convert.py writes it; not imported: gguf_convert
#                                           imports tqdm and the tokenizer builder, not needed here
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, eq=False)
class GGMLTensor:
    """A weight kept in a GGML storage type numpy lacks, exactly as stored: a GGUF
    block-quantized matrix (llama.cpp's blocks) or bfloat16. `raw` is memory-mapped from the
    file, so loading costs no anonymous memory: a weight store reads it once into its own
    format and drops it."""
    ggml_type: str            # "Q4_K", "Q8_0", "BF16", ... (gguf.GGMLQuantizationType names)
    shape: tuple[int, int]    # the logical [rows, cols]
    raw: np.ndarray           # uint8 [rows, bytes per row]: each row is whole blocks

    dtype = np.dtype(np.float32)  # what it stands for
    ndim = 2

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        import gguf.quants

        w = gguf.quants.dequantize(self.raw, gguf.GGMLQuantizationType[self.ggml_type])
        return np.ascontiguousarray(w.reshape(self.shape), dtype=dtype or np.float32)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes


Tensor = Union[np.ndarray, GGMLTensor]


def load_weights(model_dir: str | Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint in ``model_dir``, by its HF name (an AWQ/GPTQ linear's
    packed tensors as one ``.weight`` QuantWeight: gpu/loader/hf_quant.py)."""
    from ringserve.gpu.loader.hf_quant import fold_int4

    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        return text_tower(fold_int4(_load_sharded(model_dir, index), model_dir))
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return text_tower(fold_int4(load_safetensors(single), model_dir))
    raise ModelError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


# A multimodal checkpoint's text model (Gemma3ForConditionalGeneration), by the prefixes
# transformers 4.x ("language_model.model.") and 5.x ("model.language_model.") save it under
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}


def text_tower(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The text model's tensors under the causal-LM names (model.layers..., lm_head); the vision
    tower's and projector's left out. Weights of a text-only checkpoint as they are."""
    if not any(name.startswith(p) for name in weights for p in _TEXT_PREFIXES):
        return weights
    out: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        for prefix, to in _TEXT_PREFIXES.items():
            if name.startswith(prefix):
                out[to + name[len(prefix):]] = tensor
                break
        else:
            if name == "lm_head.weight":
                out[name] = tensor
    return out


def _load_sharded(model_dir: Path, index: Path) -> dict[str, Tensor]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{index}: not a safetensors index ({e})") from None
    weights: dict[str, Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        path = model_dir / shard
        if not path.is_file():
            raise ModelError(f"{path}: file not found (listed in {INDEX_FILE})")
        weights.update(load_safetensors(path))
    for name, shard in weight_map.items():
        if name not in weights:
            raise ModelError(f"{model_dir / shard}: tensor {name!r} listed in {INDEX_FILE} is missing")
    return weights


QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}  # vLLM's kernel-named methods


def checkpoint_quantization(model_dir: Path) -> str | None:
    """How a model folder's weights are quantized: "awq" or "gptq" (config.json's
    quantization_config), "gguf" (converted from a GGUF: its blocks kept), or None."""
    method = ModelConfig.from_dir(model_dir).quantization
    if method is not None:
        return method
    index = model_dir / INDEX_FILE
    first = (model_dir / sorted(set(json.loads(index.read_text())["weight_map"].values()))[0]
             if index.is_file() else model_dir / "model.safetensors")
    try:
        with safe_open(str(first), framework="numpy") as f:
            return "gguf" if BLOCK_TYPES_KEY in (f.metadata() or {}) else None
    except (SafetensorError, OSError) as e:
        raise ModelError(f"{first}: not a valid safetensors file ({_one_line(e)})") from None


def check_quantization(requested: str | None, model_dir: Path) -> None:
    """--quantization (vLLM's flag) names the checkpoint's own method, or is refused: weights
    are served as stored, never quantized at load."""
    if requested is None:
        return
    have = checkpoint_quantization(Path(model_dir))
    if QUANTIZATION_ALIASES.get(requested, requested) != have:
        raise ModelError(f"--quantization {requested}: the checkpoint is "
                         f"{have + '-quantized' if have else 'not quantized'}, and this build serves a "
                         f"checkpoint's own quantization (awq, gptq, gguf), never quantizing at load")


def load_safetensors(path: Path) -> dict[str, Tensor]:
    """All tensors of one safetensors file (the library validates header and sizes). BF16 and
    GGUF blocks (the header's BLOCK_TYPES_KEY) come as memory-mapped GGMLTensors."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
            dtypes = {name: f.get_slice(name).get_dtype() for name in names}
            ggml_types = {name: "BF16" for name in names if dtypes[name] == "BF16"}
            ggml_types.update(json.loads((f.metadata() or {}).get(BLOCK_TYPES_KEY, "{}")))
            tensors: dict[str, Tensor] = {
                name: f.get_tensor(name) for name in names if name not in ggml_types}
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelError(f"{path}: not a valid safetensors file ({_one_line(e)})") from None
    if ggml_types:
        tensors.update(_mapped(path, ggml_types))
    return tensors


def _mapped(path: Path, ggml_types: dict[str, str]) -> dict[str, Tensor]:
    import gguf

    # Layout: u64 header length, JSON header {name: {dtype, shape, data_offsets}}, data.
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    out: dict[str, Tensor] = {}
    for name, ggml_type in ggml_types.items():
        qtype = getattr(gguf.GGMLQuantizationType, str(ggml_type), None)
        entry = header.get(name)
        if ggml_type == "BF16" and entry is not None and len(entry["shape"]) != 2:
            begin, end = entry["data_offsets"]   # a norm or a bias: widened at once (it is small)
            bits = np.fromfile(path, "<u2", (end - begin) // 2, offset=data_start + begin)
            out[name] = (bits.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])
            continue
        if qtype is None or entry is None or len(entry["shape"]) != 2:
            raise ModelError(f"{path}: tensor {name!r} is not a {ggml_type} matrix")
        rows, cols = entry["shape"]
        begin, end = entry["data_offsets"]
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if ggml_type == "BF16":          # a float tensor: its shape is the logical one
            row_bytes, logical = 2 * cols, (rows, cols)
        elif entry["dtype"] == "U8" and cols % type_size == 0:
            row_bytes, logical = cols, (rows, cols // type_size * block_size)
        else:
            raise ModelError(f"{path}: tensor {name!r}: {entry['dtype']} rows of {cols} are not whole "
                             f"{ggml_type} blocks of {type_size} bytes")
        if end - begin != rows * row_bytes:
            raise ModelError(f"{path}: tensor {name!r} has {end - begin} bytes, expected {rows * row_bytes}")
        raw = np.memmap(path, np.uint8, mode="r", offset=data_start + begin, shape=(rows, row_bytes))
        out[name] = GGMLTensor(ggml_type, logical, raw)
    return out


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors the forward reads, with their shapes ([out, in] for projections)."""
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
        if c.fused_projections:  # Phi-3: already our fused layouts
            shapes[p + "self_attn.qkv_proj.weight"] = (c.q_size + 2 * c.kv_size, c.hidden_size)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
            shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
            shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        if c.fused_projections:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * c.intermediate_size, c.hidden_size)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
            shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        if c.architecture == GEMMA3:  # the norms around the MLP (post_attention_layernorm: attention's)
            shapes[p + "pre_feedforward_layernorm.weight"] = (c.hidden_size,)
            shapes[p + "post_feedforward_layernorm.weight"] = (c.hidden_size,)
    return shapes


def check_weights(weights: dict[str, Tensor], config: ModelConfig) -> None:
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
