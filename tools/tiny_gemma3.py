"""A tiny random Gemma 3 (text), made at test time from a committed config.json: a real HF-layout
folder (config.json as transformers' Gemma3TextConfig wrote it, random float32 model.safetensors,
the default model's tokenizer files) that ringserve and transformers both load.

    make_tiny_gemma3("out", config="tests/data/gemma3_tiny/config.json", tokenizer_dir=model_dir)

Deterministic from the seed, and numpy only (no ringserve, no torch): tools/make_gemma3_reference.py
runs it under transformers' Python to make the reference logits, the tests under ours, and both
get the same bytes. Norm weights are noise around 0 (Gemma multiplies by 1 + w, so a norm read
as w, or a missing one, shows), linears scaled by 1 / sqrt(fan-in) so activations stay O(1), the
embedding by a quarter of that.
"""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# HF name (after "model.layers.N.") -> llama.cpp's (after "blk.N.") for a gemma3 GGUF
# (gguf-py's MODEL_ARCH.GEMMA3 tensors: FFN_PRE_NORM is "ffn_norm", FFN_POST_NORM "post_ffw_norm")
GGUF_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gemma3_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of HF's Gemma3ForCausalLM for config c, [out, in] for projections."""
    hidden, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], hidden),
                                          "model.norm.weight": (hidden,)}
    if not c.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "post_attention_layernorm.weight": (hidden,),
                   p + "pre_feedforward_layernorm.weight": (hidden,),
                   p + "post_feedforward_layernorm.weight": (hidden,),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
    return shapes


def random_weights(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in gemma3_shapes(c).items():  # NOTE: dict order is the draw order: keep it fixed
        if len(shape) == 1:
            out[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            # NOTE: the embedding is multiplied by sqrt(hidden) on the way in and is the tied
            # lm_head: rows of norm ~2 leave the layers' (normed) outputs the larger part of the
            # final state, else every greedy token echoes the one before it
            scale = (0.25 if name.endswith("embed_tokens.weight") else 1.0) * shape[1] ** -0.5
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def make_tiny_gemma3(path: str | Path, *, config: str | Path, tokenizer_dir: str | Path,
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


@functools.lru_cache(maxsize=2)
def tokenizer_fields(path: str) -> tuple[tuple[str, Any, Any, Any], ...]:
    """The tokenizer.* keys of a GGUF: (key, value, type, array item type), read once (a 49k-token
    vocabulary takes gguf-py's reader seconds)."""
    import gguf

    out = []
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            out.append((key, field.contents(), kind, sub))
    return tuple(out)


def write_gemma3_gguf(folder: str | Path, path: str | Path, tokenizer_gguf: str | Path,
                      matrix_type: str = "F32") -> Path:
    """The folder's checkpoint as llama.cpp's convert_hf_to_gguf.py writes a Gemma 3 (architecture
    ``gemma3``: every norm stored as 1 + w, q/k rows as they are (NEOX RoPE), the window in
    ``gemma3.attention.sliding_window``; llama.cpp itself fixes the rest: every 6th layer full,
    sliding layers on RoPE base 10000, the attention scale 1 / sqrt(head_dim)), with the
    tokenizer.* keys of ``tokenizer_gguf``. Vectors are F32; matrices ``matrix_type`` (F32, or
    a block type quantized by gguf-py, as llama-quantize)."""
    import gguf
    from safetensors.numpy import load_file

    c = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    weights = load_file(str(Path(folder) / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    full = c["rope_parameters"]["full_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_sliding_window(c["sliding_window"])
    for key, value, kind, sub in tokenizer_fields(str(tokenizer_gguf)):
        w.add_key_value(key, value, kind, sub_type=sub)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(c["num_hidden_layers"]):
        names |= {f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for hf, g in GGUF_LAYER_TENSORS.items()}
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for hf_name, tensor in weights.items():
        data = np.ascontiguousarray(tensor, np.float32)
        if hf_name.endswith("norm.weight"):
            w.add_tensor(names[hf_name], data + np.float32(1))  # the converter's norm_shift
        elif tensor.ndim == 2 and matrix_type != "F32":
            w.add_tensor(names[hf_name], gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(names[hf_name], data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
