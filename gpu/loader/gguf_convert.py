"""Convert a llama.cpp GGUF file into an HF-layout model folder (docs/design.md §6).

The folder holds config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json. Every tensor keeps its GGUF type: F32, F16 and BF16 as safetensors
floats, the block-quantized types as their raw blocks (U8 [rows, bytes per row], the type named
in the header's metadata: gpu/loader/weights.py reads them back as GGMLTensor), so nothing is widened
on disk and the conversion is exact (but for Gemma 3's norms, stored by llama.cpp as 1 + w and
written back as w in float32). The architectures in ARCHITECTURES (llama, with llama3 rope
scaling through its rope_freqs tensor; qwen2, with q/k/v biases; qwen3, with q/k norms; phi3, with fused
attn_qkv and ffn_up, partial rotary dims and LongRoPE's factor tensors; gemma3, with its four
norms a layer and what llama.cpp assumes of it), the byte-level BPE
pre-tokenizers in PRE_TOKENIZERS and the tensor types in SUPPORTED_TYPES are accepted; anything
else is a ModelError that names what was refused.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "out_dir")

The caller (model_store) writes into a temporary folder and renames it into place.
"""
from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ringserve.gpu.errors import ModelError

FLOAT_TYPES = ("F32", "F16", "BF16")          # safetensors has the same names
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = FLOAT_TYPES + BLOCK_TYPES
BLOCK_TYPES_KEY = "ringserve.block_types"     # header metadata: JSON {tensor name: GGUF type}
TOKEN_TYPE_CONTROL = 3       # llama.cpp's token types: CONTROL tokens are the special ones
TOKEN_TYPE_USER_DEFINED = 4  # added tokens that are matched whole but are not special



@dataclass(frozen=True)
class _Arch:
    """A GGUF architecture we convert: its HF class, and how llama.cpp stored its tensors."""
    hf_architecture: str
    model_type: str
    permuted_qk: bool     # llama.cpp permutes q/k rows for its interleaved ("normal") RoPE
    qkv_bias: bool
    qk_norm: bool = False  # attn_q_norm / attn_k_norm per layer (Qwen3)
    fused: bool = False    # attn_qkv, and ffn_up holding gate then up (Phi-3): HF's fused names
    gemma: bool = False    # Gemma 3's four norms a layer, each stored as 1 + w (norm_shift)

    def layer_tensors(self) -> dict[str, str]:
        """GGUF tensor (after "blk.N.") -> HF name (after "model.layers.N.") for this architecture."""
        return {**(_FUSED_LAYER_TENSORS if self.fused else _LAYER_TENSORS),
                **(_BIAS_TENSORS if self.qkv_bias else {}), **(_QK_NORM_TENSORS if self.qk_norm else {}),
                **(_GEMMA3_NORMS if self.gemma else {})}


# GGUF general.architecture -> what it is in HF terms. Qwen2 and Qwen3 use llama.cpp's NEOX RoPE,
# the HF rotate_half layout, so their q/k rows are stored as they are.
ARCHITECTURES = {
    "llama": _Arch("LlamaForCausalLM", "llama", permuted_qk=True, qkv_bias=False),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", permuted_qk=False, qkv_bias=True),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", permuted_qk=False, qkv_bias=False, qk_norm=True),
    "phi3": _Arch("Phi3ForCausalLM", "phi3", permuted_qk=False, qkv_bias=False, fused=True),
    "gemma3": _Arch("Gemma3ForCausalLM", "gemma3_text", permuted_qk=False, qkv_bias=False, qk_norm=True,
                    gemma=True),
}
# What llama.cpp fixes for gemma3 rather than storing (src/llama-model.cpp): with a sliding
# window, every 6th layer full and the others on RoPE base 10000, unscaled; the attention scale
# 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the 62-layer 27B.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_27B_LAYERS = 62

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (src/llama-vocab.cpp
# llm_tokenizer_bpe): GPT-2's regex (built into the byte-level step), after every digit alone
# for smollm; its own regex for llama3 and qwen2, with the contractions spelled case by case as
# llama.cpp does (the HF files have (?i:'s|...)). Every match is kept as its own piece.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's o200k split (Phi-4-mini): a word is an optional capitalised run then lower-case letters
# (or an upper-case run then lower-case ones), its contraction a suffix; digits in threes; a
# punctuation run takes trailing newlines and "/". The tokenizer.json regex llama.cpp quotes.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTIONS + "?"
               + r"|[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTIONS + "?"
               + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _PreTokenizer:
    regex: str | None             # None: GPT-2's
    digits_alone: bool = False    # every digit its own piece first (smollm)
    ignore_merges: bool = False   # a piece that is itself a token is taken whole (llama3)
    add_bos: bool = False         # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


PRE_TOKENIZERS = {
    "default": _PreTokenizer(None),
    "gpt-2": _PreTokenizer(None),
    "smollm": _PreTokenizer(None, digits_alone=True),
    "llama-bpe": _PreTokenizer(LLAMA3_REGEX, ignore_merges=True, add_bos=True),
    "qwen2": _PreTokenizer(QWEN2_REGEX),
    "gpt-4o": _PreTokenizer(GPT4O_REGEX),
}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Phi-3's converter keeps HF's fused tensors whole: qkv_proj -> attn_qkv, gate_up_proj -> ffn_up.
_FUSED_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BIAS_TENSORS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_QK_NORM_TENSORS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma 3: ffn_norm is the MLP's pre-norm (post_attention_layernorm is the attention output's norm)
_GEMMA3_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_END_OF_TURN = {"phi3": "<|end|>", "gemma3": "<end_of_turn>"}  # a family's turn-end token, by text
ROPE_FREQS = "rope_freqs.weight"   # llama3 rope scaling: llama.cpp divides each frequency by it
# LongRoPE (phi3): each frequency divided by the long or the short factor (gpu/rope.py picks one)
ROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Write the HF-layout folder for ``gguf_path`` into ``out_dir`` (created if missing)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    meta = _Metadata(reader, gguf_path)
    names = {t.name: t for t in reader.tensors}
    config = hf_config(meta, tensor_names=set(names),
                       rope_freqs=_rope_freqs(names[ROPE_FREQS], gguf_path) if ROPE_FREQS in names else None,
                       rope_factors={k: _rope_freqs(names[t], gguf_path) for k, t in ROPE_FACTORS.items()
                                     if t in names})
    arch = meta.require("general.architecture")
    tensors = _plan_tensors(reader, arch, config, gguf_path)  # validates every tensor before writing
    tokenizer, tokenizer_config = build_tokenizer(meta)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_safetensors(out_dir / "model.safetensors", tensors, progress=progress,
                       desc=f"converting {gguf_path.name}")
    return out_dir


def _rope_freqs(tensor, path: Path) -> np.ndarray:
    if tensor.tensor_type.name != "F32" or tensor.data.nbytes != tensor.n_bytes:
        raise ModelError(f"{path}: tensor {tensor.name} must be whole F32 (is {tensor.tensor_type.name})")
    return np.asarray(tensor.data, dtype=np.float32)


def open_gguf(path: Path):
    """A GGUFReader over ``path``; a missing, truncated or corrupt file is a ModelError."""
    import gguf

    if not path.is_file():
        raise ModelError(f"{path}: file not found")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader fails in many ways (ValueError, IndexError, ...) on bad bytes
        raise ModelError(f"{path}: not a readable GGUF file ({_one_line(e)})") from None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, interleaved rotary pairs -> two halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- metadata


class _Metadata:
    """Typed access to GGUF key/values with errors that name the key."""

    def __init__(self, reader, path: Path):
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ModelError(f"{self.path}: unreadable metadata {key} ({_one_line(e)})") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelError(f"{self.path}: missing GGUF metadata {key}")
        return value


def _f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def hf_config(meta: _Metadata, tensor_names: set[str], rope_freqs: np.ndarray | None = None,
              rope_factors: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """config.json for the GGUF's metadata; ``rope_freqs``: its rope_freqs tensor, if it has one;
    ``rope_factors``: its LongRoPE factor tensors (ROPE_FACTORS' keys), if it has them."""
    arch = meta.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(f"{meta.path}: GGUF architecture {arch!r} is not supported "
                         f"({', '.join(ARCHITECTURES)})")
    kind = ARCHITECTURES[arch]

    def key(name: str) -> str:
        return f"{arch}.{name}"

    if meta.get(key("expert_count"), 0):
        raise ModelError(f"{meta.path}: {key('expert_count')} (mixture of experts) is not supported")
    hidden = _int(meta, key("embedding_length"))
    heads = _int(meta, key("attention.head_count"))
    kv_heads = _int(meta, key("attention.head_count_kv"), heads)
    head_dim = _int(meta, key("attention.key_length"), hidden // heads)
    rotary_dim = _int(meta, key("rope.dimension_count"), head_dim)
    if rotary_dim != head_dim and not (kind.fused and rotary_dim < head_dim):
        raise ModelError(f"{meta.path}: {key('rope.dimension_count')} {rotary_dim} != head_dim {head_dim} "
                         f"(partial rotary embeddings: phi3 only)")
    rope_theta = _f32(_number(meta, key("rope.freq_base"), 10000.0))
    scaling_type = meta.get(key("rope.scaling.type"), "none")
    if rope_factors:
        rope_scaling = longrope_scaling(meta, key, rope_factors, rotary_dim)
    elif scaling_type == "none":
        rope_scaling = None
    elif scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(_number(meta, key("rope.scaling.factor")))}
    else:
        raise ModelError(f"{meta.path}: {key('rope.scaling.type')} {scaling_type!r} is not supported "
                         "(none, linear; llama3 comes as the rope_freqs tensor)")
    if rope_freqs is not None:
        if rope_scaling is not None:
            raise ModelError(f"{meta.path}: tensor {ROPE_FREQS} together with {scaling_type} rope scaling "
                             "is not supported")
        rope_scaling = llama3_rope_scaling(rope_freqs, rope_theta, head_dim, meta.path)
    tokens = _tokens(meta)
    eos = _token_id(meta, "tokenizer.ggml.eos_token_id", len(tokens))
    pad = _token_id(meta, "tokenizer.ggml.padding_token_id", len(tokens), strict=False)
    layers = _int(meta, key("block_count"))
    gemma = _gemma3_config(meta, arch, layers, hidden, heads, head_dim) if kind.gemma else {}
    # NOTE: a turn's end is an eos too (llama.cpp stops at either): the file's eot token, and
    # Phi's <|end|> (Phi-4-mini's GGUF says eos <|endoftext|>; its generation_config lists both),
    # Gemma's <end_of_turn>
    turn_end = _END_OF_TURN.get(arch)
    ends = list(dict.fromkeys(i for i in (
        eos, _token_id(meta, "tokenizer.ggml.eot_token_id", len(tokens), strict=False),
        tokens.index(turn_end) if turn_end in tokens else None) if i is not None))
    return {
        "architectures": [kind.hf_architecture],
        "model_type": kind.model_type,
        "vocab_size": _int(meta, key("vocab_size"), len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": _int(meta, key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        **gemma,
        "max_position_embeddings": _int(meta, key("context_length")),
        "rms_norm_eps": _f32(_number(meta, key("attention.layer_norm_rms_epsilon"))),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "partial_rotary_factor": rotary_dim / head_dim,
        "attention_bias": kind.qkv_bias,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _token_id(meta, "tokenizer.ggml.bos_token_id", len(tokens)),
        "eos_token_id": ends[0] if len(ends) == 1 else (ends or None),
        "pad_token_id": eos if pad is None else pad,
        "torch_dtype": "float32",   # the activations' type: the weights keep their own
    } | ({"sliding_window": meta.get(key("attention.sliding_window")) or None}  # 0: none (Phi-4-mini)
         if kind.fused else {})


def longrope_scaling(meta: _Metadata, key, factors: dict[str, np.ndarray], rotary_dim: int) -> dict[str, Any]:
    """transformers' longrope ``rope_scaling`` from llama.cpp's phi3 form: the factor tensors,
    rope.scaling.original_context_length, and the attention factor its converter wrote (as it
    is: llama.cpp's, float32) when there is one."""
    if set(factors) != set(ROPE_FACTORS):
        raise ModelError(f"{meta.path}: LongRoPE needs both tensors {' and '.join(ROPE_FACTORS.values())}")
    original = _int(meta, key("rope.scaling.original_context_length"))
    scaling: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": original}
    for name, values in factors.items():
        if values.size != rotary_dim // 2 or not np.isfinite(values).all() or (values <= 0).any():
            raise ModelError(f"{meta.path}: tensor {ROPE_FACTORS[name]} must be {rotary_dim // 2} positive "
                             f"factors (rotary dims / 2), has {values.size}")
        scaling[name] = [_f32(v) for v in values.reshape(-1)]
    if meta.get(key("rope.scaling.attn_factor")) is not None:
        scaling["attention_factor"] = _f32(_number(meta, key("rope.scaling.attn_factor")))
    return scaling


def _gemma3_config(meta: _Metadata, arch: str, layers: int, hidden: int, heads: int,
                   head_dim: int) -> dict[str, Any]:
    """config.json's Gemma 3 fields, as llama.cpp reads a gemma3 GGUF (GEMMA3_* above); a final
    logit softcap is passed on (and refused by gpu/loader/config.py, as transformers' field)."""
    window = meta.get(f"{arch}.attention.sliding_window")
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": _int(meta, f"{arch}.attention.sliding_window") if window else 4096,
        "sliding_window_pattern": GEMMA3_SLIDING_PATTERN if window else 1,  # 1: every layer full
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "query_pre_attn_scalar": hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim,
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
        "attn_logit_softcapping": None,
    }


def _number(meta: _Metadata, key: str, default: float | None = None) -> float:
    value = meta.require(key) if default is None else meta.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value <= 0):
        raise ModelError(f"{meta.path}: GGUF metadata {key} {value!r} must be a positive number")
    return float(value)


def _int(meta: _Metadata, key: str, default: int | None = None) -> int:
    value = meta.require(key) if default is None else meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelError(f"{meta.path}: GGUF metadata {key} {value!r} must be a positive integer")
    return value


def _tokens(meta: _Metadata) -> list[str]:
    tokens = meta.require("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelError(f"{meta.path}: GGUF metadata tokenizer.ggml.tokens must be a list of strings")
    return tokens


def _token_id(meta: _Metadata, key: str, n_tokens: int, strict: bool = True) -> int | None:
    """A token id from the metadata (None if absent). Out of the vocabulary: a ModelError, or
    with ``strict=False`` (pad, unk: nothing relies on them) ignored as llama.cpp ignores it."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{meta.path}: GGUF metadata {key} {value!r} must be a token id")
    if not 0 <= value < n_tokens:
        if strict:
            raise ModelError(f"{meta.path}: GGUF metadata {key} {value} is outside the vocabulary "
                             f"of {n_tokens} tokens")
        return None
    return value


def llama3_rope_scaling(rope_freqs: np.ndarray, theta: float, head_dim: int, path: Path) -> dict[str, Any]:
    """transformers' llama3 ``rope_scaling`` that gives the frequencies llama.cpp gets from
    ``rope_freqs`` (each rotary frequency divided by its entry), checked to float32 rounding.

    llama.cpp's converter writes the tensor from (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings): 1 for fast wavelengths, `factor` for slow ones, and
    1 / ((1 - s) / factor + s) between, s = (orig / wavelength - low) / (high - low). The values
    fix only orig / (high - low) and low / (high - low), so low_freq_factor is taken as 1 (what
    Llama 3.x uses) and the rest fitted; Llama 3's own (8192, 1, 4) is tried when too few
    entries lie between to fit."""
    from ringserve.gpu.loader.config import ModelConfig
    from ringserve.gpu.rope import inv_freq

    rf = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if rf.size != head_dim // 2 or not np.isfinite(rf).all() or (rf < 1 - 1e-6).any():
        raise ModelError(f"{path}: tensor {ROPE_FREQS} must be {head_dim // 2} finite factors >= 1 "
                         f"(got {rf.size} values)")
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(rf.max())
    candidates = [(8192, 1.0, 4.0)]
    medium = (rf > 1 + 1e-6) & (rf < factor * (1 - 1e-6))
    if factor > 1 + 1e-6 and medium.sum() >= 2:
        s = (1 / rf[medium] - 1 / factor) / (1 - 1 / factor)
        # s = orig / (2 pi (high - low)) * frequency - low / (high - low)
        slope, intercept = np.polyfit(plain[medium], s, 1)
        if intercept < 0:
            high = 1 - 1 / intercept
            candidates.insert(0, (round(2 * math.pi * slope * (high - 1)), 1.0, float(f"{high:.6g}")))
    want = (plain / rf).astype(np.float32)
    for orig, low, high in candidates:
        scaling = {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": low,
                   "high_freq_factor": high, "original_max_position_embeddings": int(orig)}
        if orig <= 0 or high <= low:
            continue
        config = ModelConfig.from_dict({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 1, "hidden_size": head_dim,
            "intermediate_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": head_dim,
            "rope_theta": theta, "rope_scaling": scaling})
        if np.allclose(inv_freq(config), want, rtol=1e-5, atol=0):
            return scaling
    raise ModelError(f"{path}: tensor {ROPE_FREQS} is not llama3 rope scaling (no factor, low/high "
                     "frequency factors and original context reproduce it)")


# ----------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str, arch: str, path: Path) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = ARCHITECTURES[arch].layer_tensors()
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}"
    raise ModelError(f"{path}: tensor {gguf_name} is not part of a {arch} model we support")


class _Tensor:
    """One GGUF tensor on its way to the safetensors file."""

    def __init__(self, tensor, hf_name: str, shape: tuple[int, ...], unpermute_heads: int | None,
                 norm_shift: bool = False):
        """norm_shift: a Gemma norm, stored as 1 + w: written back as HF's w, in float32."""
        self.tensor, self.hf_name, self.shape, self.unpermute_heads = tensor, hf_name, shape, unpermute_heads
        self.norm_shift = norm_shift

    @property
    def type_name(self) -> str:
        return "F32" if self.norm_shift else self.tensor.tensor_type.name

    @property
    def nbytes(self) -> int:
        return 4 * int(np.prod(self.shape)) if self.norm_shift else int(self.tensor.n_bytes)

    @property
    def stored(self) -> tuple[str, list[int]]:
        """(safetensors dtype, shape) as written: blocks are U8 [rows, bytes per row]."""
        if self.type_name in FLOAT_TYPES:
            return self.type_name, list(self.shape)
        return "U8", [self.shape[0], self.nbytes // self.shape[0]]

    def data(self) -> bytes:
        """The tensor's bytes, its q/k rows unpermuted (a row is whole blocks: rows move as bytes)."""
        if self.norm_shift:  # NOTE: (1 + w) - 1 in float32: w to its rounding, as stored
            return (np.asarray(self.tensor.data, np.float32) - np.float32(1)).astype("<f4").tobytes()
        rows = np.ascontiguousarray(self.tensor.data).view(np.uint8).reshape(self.shape[0], -1)
        if self.unpermute_heads:
            rows = np.ascontiguousarray(unpermute_qk(rows, self.unpermute_heads))
        return rows.tobytes()


def _plan_tensors(reader, arch: str, config: dict[str, Any], path: Path) -> list[_Tensor]:
    planned = []
    for t in reader.tensors:
        if t.name == ROPE_FREQS or t.name in ROPE_FACTORS.values():  # in config.json's rope_scaling
            continue
        hf_name = _hf_name(t.name, arch, path)
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise ModelError(f"{path}: tensor {t.name} has type {type_name}, not supported "
                             f"({', '.join(SUPPORTED_TYPES)})")
        if t.data.nbytes != t.n_bytes:
            raise ModelError(f"{path}: tensor {t.name} is truncated ({t.data.nbytes} of {t.n_bytes} bytes)")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions fastest first
        if type_name in BLOCK_TYPES and len(shape) != 2:
            raise ModelError(f"{path}: tensor {t.name} of type {type_name} has shape {shape}; "
                             f"block-quantized tensors must be matrices")
        heads = None
        if ARCHITECTURES[arch].permuted_qk and t.name.endswith(".attn_q.weight"):
            heads = config["num_attention_heads"]
        elif ARCHITECTURES[arch].permuted_qk and t.name.endswith(".attn_k.weight"):
            heads = config["num_key_value_heads"]
        shift = ARCHITECTURES[arch].gemma and t.name.endswith("norm.weight")
        if shift and type_name not in ("F32", "F16"):
            raise ModelError(f"{path}: tensor {t.name} has type {type_name}; a gemma3 norm must be F32 "
                             "or F16")
        planned.append(_Tensor(t, hf_name, shape, heads, shift))
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{name}" for i in range(config["num_hidden_layers"])
        for name in ARCHITECTURES[arch].layer_tensors().values()}
    missing = sorted(expected - {t.hf_name for t in planned})
    if missing:
        raise ModelError(f"{path}: missing tensor for {missing[0]}"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return planned


def _write_safetensors(path: Path, tensors: list[_Tensor], *, progress: bool, desc: str) -> None:
    """Write the tensors one at a time: the header is known up front (every shape is), so the
    whole model never has to be held in memory at once, as safetensors' save_file would need."""
    blocks = {t.hf_name: t.type_name for t in tensors if t.type_name in BLOCK_TYPES}
    header: dict[str, Any] = {"__metadata__": {"format": "pt", BLOCK_TYPES_KEY: json.dumps(blocks)}}
    offset = 0
    for t in tensors:
        dtype, shape = t.stored
        header[t.hf_name] = {"dtype": dtype, "shape": shape,
                             "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    bar = tqdm(total=offset, unit="B", unit_scale=True, desc=desc, file=sys.stderr,
               disable=not progress)
    with open(path, "wb") as f, bar:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            f.write(t.data())
            bar.update(t.nbytes)


# ----------------------------------------------------------------------------- tokenizer


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the spelling of byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_types(meta: _Metadata, tokens: list[str]) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
        raise ModelError(f"{meta.path}: GGUF metadata tokenizer.ggml.token_type must be one integer "
                         f"per token ({len(tokens)})")
    return types


def _vocabulary(meta: _Metadata) -> tuple[list[str], list[int], list[tuple[str, str]]]:
    """tokens, their types and the merges, each checked: an odd file is a ModelError, not a crash."""
    tokens = _tokens(meta)
    types = _token_types(meta, tokens)
    merges = meta.require("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        merges = [merges]
    for m in merges:
        if not isinstance(m, str) or m.count(" ") != 1:
            raise ModelError(f"{meta.path}: GGUF metadata tokenizer.ggml.merges has {m!r}, not 'left right'")
    return tokens, types, [(a, b) for a, b in (m.split(" ") for m in merges)]


def build_tokenizer(meta: _Metadata):
    """(tokenizers.Tokenizer, tokenizer_config dict) for a GGUF vocabulary: 'gpt2' (byte-level
    BPE) or 'llama' (SentencePiece BPE: Gemma, Llama 2)."""
    from tokenizers import processors

    model = meta.require("tokenizer.ggml.model")
    if model == "gpt2":
        tok, tokens, add_bos_default = _byte_level_bpe(meta)
        post: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    elif model == "llama":
        tok, tokens, add_bos_default = _sentencepiece_bpe(meta)
        post = []
    else:
        raise ModelError(f"{meta.path}: tokenizer.ggml.model {model!r} is not supported "
                         "(gpt2 byte-level BPE, llama SentencePiece BPE)")
    vocab = {t: i for i, t in enumerate(tokens)}

    def token_at(key: str, strict: bool = True) -> str | None:
        i = _token_id(meta, key, len(tokens), strict)
        return None if i is None else tokens[i]

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos) or (add_eos and eos):
        specials = [(t, vocab[t]) for t in {bos if add_bos else None, eos if add_eos else None} if t]
        single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
        post.append(processors.TemplateProcessing(single=single, special_tokens=specials))
    tok.post_processor = processors.Sequence(post)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": token_at("tokenizer.ggml.padding_token_id", strict=False) or eos,
        "unk_token": token_at("tokenizer.ggml.unknown_token_id", strict=False),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tok, {k: v for k, v in config.items() if v is not None}


def _add_marked_tokens(tok, tokens: list[str], types: list[int]) -> None:
    """CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens: both
    matched whole in the raw text, as llama.cpp matches them."""
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=True) if kind == TOKEN_TYPE_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types, strict=True) if kind == TOKEN_TYPE_USER_DEFINED])


def _byte_level_bpe(meta: _Metadata):
    """(tokenizer, tokens, add-BOS default) of a 'gpt2' vocabulary with its pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in PRE_TOKENIZERS:
        raise ModelError(f"{meta.path}: tokenizer.ggml.pre {pre_name!r} is not supported "
                         f"({', '.join(PRE_TOKENIZERS)})")
    pre = PRE_TOKENIZERS[pre_name]
    tokens, types, merges = _vocabulary(meta)

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    added = {i for i, kind in enumerate(types) if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
    vocab = {}
    for i, token in enumerate(tokens):
        # Added tokens are matched on the raw text, so they keep their raw spelling; a plain
        # token outside the byte alphabet is its UTF-8 bytes, spelled the byte-level way.
        if i not in added and not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab[token] = i
    if len(vocab) != len(tokens):
        raise ModelError(f"{meta.path}: tokenizer.ggml.tokens has duplicate tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre.ignore_merges))
    splitters: list[pre_tokenizers.PreTokenizer] = []
    if pre.digits_alone:
        splitters.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.regex is not None:
        splitters.append(pre_tokenizers.Split(Regex(pre.regex), behavior="isolated", invert=False))
    splitters.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.regex is None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splitters)
    tok.decoder = decoders.ByteLevel()
    _add_marked_tokens(tok, tokens, types)
    return tok, tokens, pre.add_bos


SPM_SPACE = "\u2581"  # SentencePiece's spelling of a space
TOKEN_TYPE_NORMAL = 1


def _sentencepiece_bpe(meta: _Metadata):
    """(tokenizer, tokens, add-BOS default) of a 'llama' vocabulary: SentencePiece BPE as
    llama.cpp's llm_tokenizer_spm runs it: spaces spelled U+2581 (one prepended with
    tokenizer.ggml.add_space_prefix, llama.cpp's default; Gemma's files say false), no
    pre-splitting, then adjacent pieces merged while their join is a token, the highest-scoring
    join first; a character no token spells falls back to its <0xXX> byte tokens. The same as
    a `tokenizers` BPE whose merges are every split of every normal token into two tokens,
    ranked by the whole token's score (transformers builds Llama's and Gemma's tokenizer.json
    from their SentencePiece models this way)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = _tokens(meta)
    types = _token_types(meta, tokens)
    scores = meta.require("tokenizer.ggml.scores")
    if (not isinstance(scores, list) or len(scores) != len(tokens)
            or not all(isinstance(x, (int, float)) for x in scores)):
        raise ModelError(f"{meta.path}: GGUF metadata tokenizer.ggml.scores must be one number per token "
                         f"({len(tokens)})")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelError(f"{meta.path}: tokenizer.ggml.tokens has duplicate tokens")
    ranked = []
    for i, (piece, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != TOKEN_TYPE_NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()  # the highest score first; a tie by the halves' ids, as transformers orders them
    unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens), strict=False)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], byte_fallback=True,
                               fuse_unk=True, unk_token=None if unk is None else tokens[unk]))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPM_SPACE)] if prefix else []) + [normalizers.Replace(" ", SPM_SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    _add_marked_tokens(tok, tokens, types)
    return tok, tokens, True


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
