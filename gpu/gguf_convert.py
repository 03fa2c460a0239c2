"""Convert a llama.cpp GGUF file into an HF-layout model folder (docs/design.md §6).

The folder holds config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json. Every tensor keeps its GGUF type: F32, F16 and BF16 as safetensors
floats, the block-quantized types as their raw blocks (U8 [rows, bytes per row], the type named
in the header's metadata: gpu/weights.py reads them back as GGMLTensor), so nothing is widened
on disk and the conversion is exact. Only the llama architecture and SUPPORTED_TYPES are
accepted; anything else is a ModelError that names what was refused.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "out_dir")

The caller (model_store) writes into a temporary folder and renames it into place.
"""
from __future__ import annotations

import json
import struct
import sys
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
    config = hf_config(meta, tensor_names={t.name for t in reader.tensors})
    tensors = _plan_tensors(reader, config, gguf_path)  # validates every tensor before writing
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None})
    tokenizer, tokenizer_config = build_tokenizer(meta)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_safetensors(out_dir / "model.safetensors", tensors, progress=progress,
                       desc=f"converting {gguf_path.name}")
    return out_dir


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


def hf_config(meta: _Metadata, tensor_names: set[str]) -> dict[str, Any]:
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise ModelError(f"{meta.path}: GGUF architecture {arch!r} is not supported (llama only)")
    if meta.get("llama.expert_count", 0):
        raise ModelError(f"{meta.path}: llama.expert_count (mixture of experts) is not supported")
    hidden = int(meta.require("llama.embedding_length"))
    heads = int(meta.require("llama.attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rotary_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ModelError(f"{meta.path}: llama.rope.dimension_count {rotary_dim} != head_dim {head_dim} "
                         f"(partial rotary embeddings are not supported)")
    scaling_type = meta.get("llama.rope.scaling.type", "none")
    if scaling_type == "none":
        rope_scaling = None
    elif scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(meta.require("llama.rope.scaling.factor"))}
    else:
        raise ModelError(f"{meta.path}: llama.rope.scaling.type {scaling_type!r} is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ModelError(f"{meta.path}: tensor rope_freqs.weight (llama3 rope frequencies) is not supported")
    tokens = meta.require("tokenizer.ggml.tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.require("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.require("llama.context_length")),
        "rms_norm_eps": _f32(meta.require("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", eos),
        "torch_dtype": "float32",   # the activations' type: the weights keep their own
    }


# ----------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise ModelError(f"{path}: tensor {gguf_name} is not part of a llama model we support")


class _Tensor:
    """One GGUF tensor on its way to the safetensors file."""

    def __init__(self, tensor, hf_name: str, shape: tuple[int, ...], unpermute_heads: int | None):
        self.tensor, self.hf_name, self.shape, self.unpermute_heads = tensor, hf_name, shape, unpermute_heads

    @property
    def type_name(self) -> str:
        return self.tensor.tensor_type.name

    @property
    def nbytes(self) -> int:
        return int(self.tensor.n_bytes)

    @property
    def stored(self) -> tuple[str, list[int]]:
        """(safetensors dtype, shape) as written: blocks are U8 [rows, bytes per row]."""
        if self.type_name in FLOAT_TYPES:
            return self.type_name, list(self.shape)
        return "U8", [self.shape[0], self.nbytes // self.shape[0]]

    def data(self) -> bytes:
        """The tensor's bytes, its q/k rows unpermuted (a row is whole blocks: rows move as bytes)."""
        rows = np.ascontiguousarray(self.tensor.data).view(np.uint8).reshape(self.shape[0], -1)
        if self.unpermute_heads:
            rows = np.ascontiguousarray(unpermute_qk(rows, self.unpermute_heads))
        return rows.tobytes()


def _plan_tensors(reader, config: dict[str, Any], path: Path) -> list[_Tensor]:
    planned = []
    for t in reader.tensors:
        hf_name = _hf_name(t.name, path)
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
        if t.name.endswith(".attn_q.weight"):
            heads = config["num_attention_heads"]
        elif t.name.endswith(".attn_k.weight"):
            heads = config["num_key_value_heads"]
        planned.append(_Tensor(t, hf_name, shape, heads))
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{name}" for i in range(config["num_hidden_layers"])
        for name in _LAYER_TENSORS.values()}
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


def build_tokenizer(meta: _Metadata):
    """(tokenizers.Tokenizer, tokenizer_config dict) for a GGUF 'gpt2' (byte-level BPE) vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = meta.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelError(f"{meta.path}: tokenizer.ggml.model {model!r} is not supported "
                         "(gpt2 byte-level BPE only)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in ("smollm", "default", "gpt-2"):
        raise ModelError(f"{meta.path}: tokenizer.ggml.pre {pre!r} is not supported (smollm, gpt-2)")
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]

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

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp's 'smollm' pre-tokenizer: every digit alone, then the GPT-2 regex.
    splitters: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre == "smollm":
        splitters.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splitters)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in sorted(added) if types[i] == TOKEN_TYPE_CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in sorted(added) if types[i] == TOKEN_TYPE_USER_DEFINED])

    def token_at(key: str) -> str | None:
        i = meta.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    post: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    if (add_bos and bos) or (add_eos and eos):
        specials = [(t, vocab[t]) for t in {bos if add_bos else None, eos if add_eos else None} if t]
        single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
        post.append(processors.TemplateProcessing(single=single, special_tokens=specials))
    tok.post_processor = processors.Sequence(post)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": token_at("tokenizer.ggml.padding_token_id") or eos,
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tok, {k: v for k, v in config.items() if v is not None}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
