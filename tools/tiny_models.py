"""Tiny random checkpoints of every family the tests compare with transformers, made at test time
from a committed config.json: a real HF-layout folder (config.json as transformers' config class
wrote it, random float32 model.safetensors, the default model's tokenizer files) that ringserve
and transformers both load, and the GGUF llama.cpp's convert_hf_to_gguf.py would write from it.

    make_tiny_model("qwen3", "out", config="tests/data/qwen3_tiny/config.json", tokenizer_dir=model_dir)
    write_gguf("qwen3", "out", "out.gguf", default_gguf_path(), "Q8_0")

Deterministic from the seed, and numpy only (no ringserve, no torch) up to the GGUF:
tools/make_reference.py runs it under transformers' Python to make the reference logits, the
tests under ours, and both get the same bytes. Each family (FAMILIES) says only what differs:
its tensors (in draw order), how its norms and embedding are drawn, and its GGUF keys and names.
Norm weights are 1 + noise (noise around 0 for Gemma, which multiplies by 1 + w), so a misplaced
or missing norm shows; linears are scaled by 1 / sqrt(fan-in) so activations stay O(1).
"""
from __future__ import annotations

import functools
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
Shapes = dict[str, tuple[int, ...]]

# Phi-3.5 / Phi-4-mini's turn format (each message "<|role|>" + content + "<|end|>", then
# "<|assistant|>"; their templates add newlines (3.5) or tools in the system turn (4-mini)) and
# the special tokens it uses: <|end|> ends a turn, which generation_config.json lists as an eos.
PHI_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + "
                "'<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}"
                "{{ eos_token }}{% endif %}")
PHI_SPECIAL_TOKENS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>",
                      "<|/tool|>")


def _attention(c: dict) -> Shapes:
    hidden, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
            "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}


def _mlp(c: dict) -> Shapes:
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    return {"mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter)}


def qwen3_layer(c: dict) -> Shapes:
    """Qwen3's (and, less the q/k norms, Mistral's) tensors of one layer, after "model.layers.N."."""
    hidden = c["hidden_size"]
    return {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
            **_attention(c), **_mlp(c)}


def phi3_layer(c: dict) -> Shapes:
    """Phi-3's: fused qkv_proj and gate_up_proj (gate, then up), head_dim hidden / heads."""
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * (hidden // c["num_attention_heads"])
    return {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
            "self_attn.qkv_proj.weight": (qkv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
            "mlp.gate_up_proj.weight": (2 * inter, hidden), "mlp.down_proj.weight": (hidden, inter)}


def gemma3_layer(c: dict) -> Shapes:
    """Gemma 3's: four norms a layer (before and after attention and the MLP) and q/k norms."""
    hidden = c["hidden_size"]
    return {"input_layernorm.weight": (hidden,), **_attention(c),
            "post_attention_layernorm.weight": (hidden,), "pre_feedforward_layernorm.weight": (hidden,),
            "post_feedforward_layernorm.weight": (hidden,), **_mlp(c)}


def converter_names(arch: str) -> dict[str, str]:
    """HF layer tensor -> llama.cpp's for ``arch``, as our GGUF converter maps them."""
    from ringserve.gpu.loader.gguf_convert import ARCHITECTURES
    return {hf: g for g, hf in ARCHITECTURES[arch].layer_tensors().items()}


# HF name (after "model.layers.N.") -> llama.cpp's (after "blk.N."), as convert_hf_to_gguf.py maps
# a phi3: the fused tensors keep their layout (ffn_up holds gate then up)
PHI3_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# ... and for a gemma3 (gguf-py's MODEL_ARCH.GEMMA3: FFN_PRE_NORM is "ffn_norm", FFN_POST_NORM
# "post_ffw_norm")
GEMMA3_GGUF_NAMES = {
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


def _dims(w: Any, c: dict) -> None:
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])


def qwen3_header(w: Any, c: dict) -> None:
    """A qwen3: q/k rows as they are (NEOX RoPE), head_dim as key/value lengths."""
    _dims(w, c)
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])


def mistral_header(w: Any, c: dict) -> None:
    """A Mistral as architecture llama: no sliding window (the converter writes none for llama, and
    llama.cpp's llama architecture reads none: full attention)."""
    _dims(w, c)
    w.add_rope_dimension_count(c["head_dim"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])


def _phi3_rope(c: dict) -> tuple[dict, Any]:
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return rope, rope.get("original_max_position_embeddings", c.get("original_max_position_embeddings"))


def phi3_header(w: Any, c: dict) -> None:
    """A phi3: ``rope.dimension_count`` the rotary dims, ``rope.scaling.original_context_length``."""
    rope, orig = _phi3_rope(c)
    heads = c["num_attention_heads"]
    fraction = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    w.add_context_length(c["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(int(fraction * c["hidden_size"]) // heads)  # as the converter computes it
    w.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    w.add_sliding_window(c.get("sliding_window") or 0)


def phi3_longrope(w: Any, c: dict) -> None:
    """LongRoPE as ``rope_factors_long`` / ``rope_factors_short`` tensors and
    ``rope.scaling.attn_factor`` (written after the tokenizer keys, as the converter does)."""
    rope, orig = _phi3_rope(c)
    if rope.get("long_factor"):
        scale = c["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))


def gemma3_header(w: Any, c: dict) -> None:
    """A gemma3: the window in ``gemma3.attention.sliding_window``; llama.cpp itself fixes the rest
    (every 6th layer full, sliding layers on RoPE base 10000, the attention scale 1 / sqrt(head_dim))."""
    import gguf

    _dims(w, c)
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    full = c["rope_parameters"]["full_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_sliding_window(c["sliding_window"])


def permute_qk_rows(name: str, data: np.ndarray, c: dict) -> np.ndarray:
    """llama.cpp's llama architecture: q/k rows permuted for its interleaved RoPE."""
    from ringserve.tools.tiny_gguf import permute_qk

    heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
    if (proj := name.split(".")[-2]) in heads:
        return np.ascontiguousarray(permute_qk(data, heads[proj]))
    return data


def shift_norms(name: str, data: np.ndarray, c: dict) -> np.ndarray:
    """Gemma: every norm stored as 1 + w (the converter's norm_shift)."""
    return data + np.float32(1) if name.endswith("norm.weight") else data


@dataclass(frozen=True)
class Family:
    """What one family's tiny checkpoint and GGUF differ in."""
    layer: Callable[[dict], Shapes]          # one layer's tensors, in draw order
    gguf_arch: str
    gguf_header: Callable[[Any, dict], None]  # the architecture's keys, before the tokenizer's
    gguf_names: Callable[[], dict[str, str]]  # HF layer tensor -> llama.cpp's
    norm_mean: float = 1.0
    embed_scale: Callable[[int], float] = lambda hidden: 1.0
    tied_default: bool = False               # tie_word_embeddings when config.json omits it
    dropped: tuple[str, ...] = ()            # drawn (to keep another family's bytes) but not written
    gguf_tail: Callable[[Any, dict], None] | None = None  # keys and tensors after the tokenizer's
    gguf_tensor: Callable[[str, np.ndarray, dict], np.ndarray] | None = None  # how a tensor is stored


FAMILIES = {
    "qwen3": Family(qwen3_layer, "qwen3", qwen3_header, functools.partial(converter_names, "qwen3")),
    # Mistral's tensors are Llama's: Qwen3's less the per-head q/k norms, drawn as Qwen3's (same
    # seed, same bytes) and the norms dropped
    "mistral": Family(qwen3_layer, "llama", mistral_header, functools.partial(converter_names, "llama"),
                      dropped=("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
                      gguf_tensor=permute_qk_rows),
    "phi3": Family(phi3_layer, "phi3", phi3_header, lambda: PHI3_GGUF_NAMES, gguf_tail=phi3_longrope),
    # NOTE: the embedding is multiplied by sqrt(hidden) on the way in and is the tied lm_head:
    # rows of norm ~2 leave the layers' (normed) outputs the larger part of the final state, else
    # every greedy token echoes the one before it
    "gemma3": Family(gemma3_layer, "gemma3", gemma3_header, lambda: GEMMA3_GGUF_NAMES, norm_mean=0.0,
                     embed_scale=lambda hidden: 0.25 * hidden ** -0.5, tied_default=True,
                     gguf_tensor=shift_norms),
}


def family_shapes(family: str, c: dict) -> Shapes:
    """The tensors of HF's ...ForCausalLM for config c, [out, in] for projections, in draw order."""
    f = FAMILIES[family]
    hidden = c["hidden_size"]
    shapes: Shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not c.get("tie_word_embeddings", f.tied_default):
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    for i in range(c["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in f.layer(c).items()}
    return shapes


def random_weights(family: str, c: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors: vectors norm_mean + noise, matrices scaled by 1 / sqrt(fan-in)."""
    f = FAMILIES[family]
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in family_shapes(family, c).items():  # NOTE: dict order is the draw order: keep it
        if len(shape) == 1:
            out[name] = (f.norm_mean + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            scale = f.embed_scale(shape[1]) if name.endswith("embed_tokens.weight") else shape[1] ** -0.5
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return {name: w for name, w in out.items() if not name.endswith(f.dropped)}


def make_tiny_model(family: str, path: str | Path, *, config: str | Path, tokenizer_dir: str | Path,
                    seed: int = 0) -> Path:
    """Write the folder into ``path`` (created if needed) and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = json.loads(Path(config).read_text(encoding="utf-8"))
    shutil.copyfile(config, path / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, path / name)
    save_file(random_weights(family, c, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
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


def write_gguf(family: str, folder: str | Path, path: str | Path, tokenizer_gguf: str | Path,
               matrix_type: str = "F32") -> Path:
    """The folder's checkpoint as llama.cpp's convert_hf_to_gguf.py writes one of ``family``, with
    the tokenizer.* keys of ``tokenizer_gguf`` (the default model's GGUF: the same vocabulary the
    folder has). Vectors are F32; matrices ``matrix_type`` (F32: the file holds exactly the
    folder's numbers; a block type such as Q8_0: quantized by gguf-py, as llama-quantize)."""
    import gguf
    from safetensors.numpy import load_file

    f = FAMILIES[family]
    c = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    weights = load_file(str(Path(folder) / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), f.gguf_arch)
    f.gguf_header(w, c)
    for key, value, kind, sub in tokenizer_fields(str(tokenizer_gguf)):
        w.add_key_value(key, value, kind, sub_type=sub)
    if f.gguf_tail:
        f.gguf_tail(w, c)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(c["num_hidden_layers"]):
        names |= {f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for hf, g in f.gguf_names().items()}
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for hf_name, tensor in weights.items():
        data = np.ascontiguousarray(tensor, np.float32)
        if f.gguf_tensor:
            data = f.gguf_tensor(hf_name, data, c)
        if tensor.ndim == 2 and matrix_type != "F32":
            w.add_tensor(names[hf_name], gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(names[hf_name], data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
