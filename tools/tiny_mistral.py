"""A tiny random Mistral (or Ministral), made at test time from a committed config.json: a real
HF-layout folder (config.json as transformers' MistralConfig / MinistralConfig wrote it, random
float32 model.safetensors, the default model's tokenizer files) that ringserve and transformers
both load.

    make_tiny_mistral("out", config="tests/data/mistral_tiny/config.json", tokenizer_dir=model_dir)

Mistral's tensors are Llama's: tools/tiny_qwen3.py's less the per-head q/k norms, so they are
drawn as tiny_qwen3 draws them (same seed, same bytes) and the norms dropped. Numpy only (no
ringserve, no torch): tools/make_mistral_reference.py runs it under transformers' Python, the
tests under ours, and both get the same bytes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ringserve.tools.tiny_qwen3 import TOKENIZER_FILES, random_weights


def mistral_weights(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF MistralForCausalLM's tensors for config c (which names its head_dim)."""
    return {name: w for name, w in random_weights(c, seed).items()
            if not name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))}


def make_tiny_mistral(path: str | Path, *, config: str | Path, tokenizer_dir: str | Path,
                      seed: int = 0) -> Path:
    """Write the folder into ``path`` (created if needed) and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = json.loads(Path(config).read_text(encoding="utf-8"))
    shutil.copyfile(config, path / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, path / name)
    save_file(mistral_weights(c, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_mistral_gguf(folder: str | Path, path: str | Path, tokenizer_gguf: str | Path,
                       matrix_type: str = "F32") -> Path:
    """The folder's checkpoint as llama.cpp's convert_hf_to_gguf.py writes a Mistral: architecture
    ``llama``, q/k rows permuted for its interleaved RoPE, and no sliding window (the converter
    writes none for llama, and llama.cpp's llama architecture reads none: full attention), with
    the tokenizer.* keys of ``tokenizer_gguf``. Vectors F32; matrices ``matrix_type`` (F32: the
    folder's numbers exactly; a block type such as Q8_0: quantized by gguf-py)."""
    import gguf
    from safetensors.numpy import load_file

    from ringserve.gpu.loader.gguf_convert import ARCHITECTURES
    from ringserve.tools.tiny_gguf import permute_qk

    c = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    weights = load_file(str(Path(folder) / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_dimension_count(c["head_dim"])
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
                  for g, hf in ARCHITECTURES["llama"].layer_tensors().items()}
    heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for hf_name, tensor in weights.items():
        data = np.ascontiguousarray(tensor, np.float32)
        if (proj := hf_name.split(".")[-2]) in heads:
            data = np.ascontiguousarray(permute_qk(data, heads[proj]))
        if tensor.ndim == 2 and matrix_type != "F32":
            w.add_tensor(names[hf_name], gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(names[hf_name], data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
