"""A tiny random Qwen3 (dense), made at test time from a committed config.json: a real HF-layout
folder (config.json as transformers' Qwen3Config wrote it, random float32 model.safetensors, the
default model's tokenizer files) that ringserve and transformers both load.

    make_tiny_qwen3("out", config="tests/data/qwen3_tiny/config.json", tokenizer_dir=model_dir)

Deterministic from the seed, and numpy only (no ringserve, no torch): tools/make_qwen3_reference.py
runs it under transformers' Python to make the reference logits, the tests under ours, and both
get the same bytes. Norm weights are 1 + noise (so a misplaced or missing norm shows), linears
scaled by 1 / sqrt(fan-in) so activations stay O(1).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def qwen3_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of HF's Qwen3ForCausalLM for config c, [out, in] for projections."""
    hidden, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], hidden),
                                          "model.norm.weight": (hidden,)}
    if not c.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
    return shapes


def random_weights(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
    return draw(qwen3_shapes(c), seed)


def draw(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Random tensors of these shapes: vectors 1 + noise, matrices scaled by 1 / sqrt(fan-in)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():  # NOTE: dict order is the draw order: keep it fixed
        if len(shape) == 1:
            out[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            scale = 1.0 if name.endswith("embed_tokens.weight") else shape[1] ** -0.5
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def make_tiny_qwen3(path: str | Path, *, config: str | Path, tokenizer_dir: str | Path,
                    seed: int = 0) -> Path:
    """Write the folder into ``path`` (created if needed) and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = json.loads(Path(config).read_text(encoding="utf-8"))
    shutil.copyfile(config, path / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, path / name)
    save_file(random_weights(c, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_qwen3_gguf(folder: str | Path, path: str | Path, tokenizer_gguf: str | Path,
                     matrix_type: str = "F32") -> Path:
    """The folder's checkpoint as llama.cpp's convert_hf_to_gguf.py writes a Qwen3 (architecture
    ``qwen3``: q/k rows as they are, NEOX RoPE; ``blk.N.attn_q_norm`` / ``attn_k_norm``), with
    the tokenizer.* keys of ``tokenizer_gguf`` (the default model's GGUF: the same vocabulary
    the folder has). Vectors are F32; matrices ``matrix_type`` (F32: the file holds exactly the
    folder's numbers; a block type such as Q8_0: quantized by gguf-py, as llama-quantize)."""
    import gguf
    from safetensors.numpy import load_file

    from ringserve.gpu.loader.gguf_convert import ARCHITECTURES

    c = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    weights = load_file(str(Path(folder) / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), kind, sub_type=sub)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(c["num_hidden_layers"]):
        names |= {f"model.layers.{i}.{hf}": f"blk.{i}.{g}"
                  for g, hf in ARCHITECTURES["qwen3"].layer_tensors().items()}
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for hf_name, tensor in weights.items():
        data = np.ascontiguousarray(tensor, np.float32)
        if tensor.ndim == 2 and matrix_type != "F32":
            w.add_tensor(names[hf_name], gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(names[hf_name], data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
