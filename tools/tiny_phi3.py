"""A tiny random Phi-3 (Phi-3.5-mini / Phi-4-mini's architecture), made at test time from a
committed config.json: a real HF-layout folder (config.json as transformers' Phi3Config wrote it,
random float32 model.safetensors with Phi-3's fused qkv_proj and gate_up_proj, the default
model's tokenizer files) that ringserve and transformers both load.

    make_tiny_phi3("out", config="tests/data/phi3_tiny/config.json", tokenizer_dir=model_dir)

Deterministic from the seed, and numpy only (no ringserve, no torch): tools/make_phi3_reference.py
runs it under transformers' Python to make the reference logits, the tests under ours, and both
get the same bytes (tools/tiny_qwen3.py's draw: norms 1 + noise, linears 1 / sqrt(fan-in)).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ringserve.tools.tiny_qwen3 import TOKENIZER_FILES, draw

# Phi-3.5 / Phi-4-mini's turn format (each message "<|role|>" + content + "<|end|>", then
# "<|assistant|>"; their templates add newlines (3.5) or tools in the system turn (4-mini)) and
# the special tokens it uses: <|end|> ends a turn, which generation_config.json lists as an eos.
PHI_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + "
                "'<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}"
                "{{ eos_token }}{% endif %}")
PHI_SPECIAL_TOKENS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>",
                      "<|/tool|>")

# HF name (after "model.layers.N.") -> llama.cpp's (after "blk.N."), as convert_hf_to_gguf.py maps
# a phi3: the fused tensors keep their layout (ffn_up holds gate then up).
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def phi3_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of HF's Phi3ForCausalLM for config c, [out, in] for projections."""
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    d = hidden // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], hidden),
                                          "model.norm.weight": (hidden,)}
    if not c.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.qkv_proj.weight": (qkv, hidden),
                   p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_up_proj.weight": (2 * inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
    return shapes


def make_tiny_phi3(path: str | Path, *, config: str | Path, tokenizer_dir: str | Path, seed: int = 0) -> Path:
    """Write the folder into ``path`` (created if needed) and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = json.loads(Path(config).read_text(encoding="utf-8"))
    shutil.copyfile(config, path / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, path / name)
    save_file(draw(phi3_shapes(c), seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_phi3_gguf(folder: str | Path, path: str | Path, tokenizer_gguf: str | Path,
                    matrix_type: str = "F32") -> Path:
    """The folder's checkpoint as llama.cpp's convert_hf_to_gguf.py writes a Phi-3 (architecture
    ``phi3``: fused ``attn_qkv`` and ``ffn_up`` (gate, then up); ``rope.dimension_count`` the
    rotary dims; LongRoPE as ``rope_factors_long`` / ``rope_factors_short`` tensors,
    ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``), with the
    tokenizer.* keys of ``tokenizer_gguf`` (the same vocabulary the folder has). Vectors are F32;
    matrices ``matrix_type`` (F32: exactly the folder's numbers; a block type: gguf-py's quantizer)."""
    import math

    import gguf
    from safetensors.numpy import load_file

    c = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    heads = c["num_attention_heads"]
    fraction = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    rotary_dim = int(fraction * c["hidden_size"]) // heads  # as the converter computes it
    orig = rope.get("original_max_position_embeddings", c.get("original_max_position_embeddings"))
    weights = load_file(str(Path(folder) / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(c["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(rotary_dim)
    w.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    w.add_sliding_window(c.get("sliding_window") or 0)
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), kind, sub_type=sub)
    if rope.get("long_factor"):
        scale = c["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(c["num_hidden_layers"]):
        names |= {f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for hf, g in GGUF_LAYER_NAMES.items()}
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
