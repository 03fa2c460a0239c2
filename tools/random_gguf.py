"""Random-weight llama GGUFs of real shapes, written without a hub, for memory and speed runs.

    python -m ringserve.tools.random_gguf --shape llama-3.2-1b --layout q4_k_m out.gguf
    python -m ringserve.tools.random_gguf --shape llama-3.2-1b --arch llama3 out.gguf
    python -m ringserve.tools.random_gguf --shape qwen2.5-0.5b --arch qwen2 out.gguf
    python -m ringserve.tools.random_gguf --shape phi-4-mini --arch phi3 out.gguf
    python -m ringserve.tools.random_gguf --shape gemma-3-1b --arch gemma3 out.gguf

Any bytes are a valid block of a GGML type once its float16 scale fields are finite, so the
blocks are random bytes with their scales set to small random values (weights of about the size
a trained model has, so that activations stay finite through the layers). The layouts are
llama.cpp's: Q4_K_M (llama_tensor_get_type: Q4_K, with Q6_K for the output (the embedding when
it is tied) and for attn_v and ffn_down in the "more bits" layers), Q8_0, or any one type for
every matrix. Tensors are made and written one at a time, so an 8B file needs no more memory
than its largest tensor. The text it gives is meaningless, the shapes and bytes are real.

`--arch` picks what the file says it is, as llama.cpp's converter writes each family:
- llama: the tiny test vocabulary (4 merges), padded with filler tokens, pre-tokenizer "default";
- llama3: arch "llama" with Llama 3's tokenizer (pre-tokenizer "llama-bpe", <|begin_of_text|>
  added, <|eot_id|> the end of a turn, its chat template) and its rope scaling as llama.cpp
  stores it: the rope_freqs tensor (factor 32, low/high frequency factors 1 and 4, original
  context 8192: Llama 3.2's);
- qwen2: arch "qwen2", q/k/v biases, Qwen2's tokenizer (pre-tokenizer "qwen2", ChatML).
- qwen3: arch "qwen3", per-head q/k norms (attn_q_norm, attn_k_norm), the shape's head_dim
  (Qwen3's is not hidden / heads), Qwen2's tokenizer.
- phi3: arch "phi3" as Phi-4-mini: fused attn_qkv and ffn_up (gate, then up; Q4_K_M gives
  attn_qkv Q5_K, as llama.cpp), the shape's rotary dims (rope.dimension_count), LongRoPE
  (rope_factors_long/short, the original context, the attention factor), Phi's turn tokens
  (<|user|>, <|assistant|>, <|end|> ...) with Phi-4-mini's pre-tokenizer "gpt-4o" over the
  trained merges.
- gemma3: arch "gemma3", q/k norms and the four norms a layer (post_attention_norm, ffn_norm
  as the MLP's pre-norm, post_ffw_norm), the shape's head_dim and sliding window; Gemma's
  special tokens (<bos> added, <start_of_turn>, <end_of_turn>), chat template and a
  SentencePiece vocabulary (tokenizer.ggml.model "llama", as Gemma's GGUFs: pieces, scores
  and types from the trained merges, byte fallback, no space prefix).
The llama3 and qwen2 vocabularies are a byte-level BPE trained here (`train_merges`, the
`tokenizers` library) on `sample_texts`, so real merges apply to varied text (digits, CJK,
emoji, code, whitespace runs), then padded with reserved CONTROL tokens to the shape's size.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.tools.tiny_gguf import CHATML_TEMPLATE, MERGES, SPECIAL_TOKENS, byte_level_alphabet
from ringserve.tools.tiny_models import PHI_SPECIAL_TOKENS, PHI_TEMPLATE


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256
    tied: bool = True
    rope_theta: float = 500000.0
    context: int = 8192
    head_dim: int | None = None  # None: hidden / heads
    rotary_dim: int | None = None  # None: head_dim (phi3: partial rotary)
    original_context: int = 4096   # phi3: LongRoPE's original_max_position_embeddings
    sliding_window: int | None = None  # gemma3: the sliding layers' window

    @property
    def dim(self) -> int:
        """The attention head size."""
        return self.head_dim or self.hidden // self.heads


SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "llama-3.2-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    "llama-3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False),
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49152,
                          rope_theta=100000.0),
    "qwen2.5-0.5b": Shape(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936,
                          rope_theta=1000000.0, context=32768),
    "qwen3-0.6b": Shape(hidden=1024, layers=28, heads=16, kv_heads=8, ffn=3072, vocab=151936,
                        rope_theta=1000000.0, context=40960, head_dim=128),
    "phi-4-mini": Shape(hidden=3072, layers=32, heads=24, kv_heads=8, ffn=8192, vocab=200064,
                        rope_theta=10000.0, context=131072, rotary_dim=96),
    # Llama-3.2-1B's dims as a phi3 (fused, 3/4 rotary, LongRoPE): bench_forward's 1B-class
    # Phi beside it, the same bytes and FLOPs per token
    "phi3-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, rope_theta=10000.0,
                     context=131072, rotary_dim=48),
    "gemma-3-1b": Shape(hidden=1152, layers=26, heads=4, kv_heads=1, ffn=6912, vocab=262144,
                        rope_theta=1000000.0, context=32768, head_dim=256, sliding_window=512),
}
ARCHS = ("llama", "llama3", "qwen2", "qwen3", "phi3", "gemma3")

# Byte offsets of each block's float16 scale fields (ggml-common.h), and a scale that gives
# weights of about 0.02: the value is scale x (quant) with quants of the size in the comment.
_SCALES = {
    "Q4_0": ((0,), 0.02 / 4),          # d * (q - 8), |q - 8| ~ 4
    "Q4_1": ((0, 2), 0.02 / 8),        # d * q - m
    "Q5_0": ((0,), 0.02 / 8),          # d * (q - 16)
    "Q5_1": ((0, 2), 0.02 / 16),
    "Q8_0": ((0,), 0.02 / 64),         # d * q, q int8
    "Q2_K": ((80, 82), 0.02 / 16),     # d * sc * q - dmin * m, sc 4-bit, q 2-bit
    "Q3_K": ((108,), 0.02 / 64),
    "Q4_K": ((0, 2), 0.02 / 256),      # sc, m 6-bit, q 4-bit
    "Q5_K": ((0, 2), 0.02 / 512),
    "Q6_K": ((208,), 0.02 / 2048),     # d * sc * (q - 32), sc int8
}
LAYOUTS = ("q4_k_m", "q8_0", *(t.lower() for t in _SCALES))


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row]: random blocks of `type_name` with finite, small scales."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise ValueError(f"{type_name}: {cols} columns are not whole blocks of {block_size}")
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    offsets, scale = _SCALES[type_name]
    for at in offsets:
        d = (rng.random((rows, cols // block_size)) * 2 * scale).astype(np.float16)
        blocks[:, :, at:at + 2] = d.view(np.uint8).reshape(rows, cols // block_size, 2)
    return blocks.reshape(rows, -1)


# llama.cpp's fallback for a row that is not whole 256-blocks (SmolLM2's 576 columns, say)
_K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def tensor_type(layout: str, name: str, layer: int | None, num_layers: int, tied: bool,
                cols: int) -> str:
    """The GGML type llama.cpp gives tensor `name` (after "blk.N.") of `cols` columns in `layout`."""
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return "F32"
    kind = layout.upper()
    if layout == "q4_k_m":
        kind = "Q4_K"
        if name == "output.weight" or (tied and name == "token_embd.weight"):  # the lm_head
            kind = "Q6_K"
        elif name == "attn_qkv.weight":
            kind = "Q5_K"
        elif (name in ("attn_v.weight", "ffn_down.weight") and layer is not None
              and _more_bits(layer, num_layers)):
            kind = "Q6_K"
    return _K_FALLBACK[kind] if kind in _K_FALLBACK and cols % 256 else kind


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _vocabulary(size: int) -> list[str]:
    base = SPECIAL_TOKENS + byte_level_alphabet() + ["".join(m.split(" ")) for m in MERGES]
    return base + [f"filler{i}" for i in range(size - len(base))]


@dataclass(frozen=True)
class Tokenizer:
    """What a family's GGUF says about its tokenizer (convert_hf_to_gguf.py writes these keys)."""
    pre: str
    specials: tuple[str, ...]     # CONTROL tokens, after the BPE tokens as in the real files
    bos: str
    eos: str
    add_bos: bool
    chat_template: str


LLAMA3_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] "
                   "+ '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
                   "{% endif %}")
TOKENIZERS = {
    "llama3": Tokenizer("llama-bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "<|eot_id|>"),
                        bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True,
                        chat_template=LLAMA3_TEMPLATE),
    "qwen2": Tokenizer("qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                       bos="<|endoftext|>", eos="<|im_end|>", add_bos=False, chat_template=CHATML_TEMPLATE),
}
TOKENIZERS["qwen3"] = TOKENIZERS["qwen2"]  # Qwen3 ships Qwen2's tokenizer
# eos <|endoftext|> as Phi-4-mini's GGUF says (the converter adds <|end|>, the turn's end)
TOKENIZERS["phi3"] = Tokenizer("gpt-4o", PHI_SPECIAL_TOKENS, bos="<|endoftext|>", eos="<|endoftext|>",
                               add_bos=False, chat_template=PHI_TEMPLATE)
# Gemma 3's turns (its instruction models' template, reduced to text: the system message is
# prefixed to the first user turn, roles must alternate, the assistant is "model")
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = "
    "messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}{% else %}"
    "{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
TOKENIZERS["gemma3"] = Tokenizer("default", ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
                                 bos="<bos>", eos="<eos>", add_bos=True, chat_template=GEMMA3_TEMPLATE)
LLAMA3_ROPE: dict[str, Any] = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}

_WORDS = ("the of and to in is it you that he was for on are with as I his they be at one have this "
          "from or had by word but what some we can out other were all there when up use your how said "
          "an each she which do their time if will way about many then them write would like so these "
          "her long make thing see him two has look more day could go come did number sound no most "
          "people my over know water than call first who may down side been now find cache token server "
          "engine request model stream batch kernel memory quantized weights").split()
_PIECES = ("1234567890", "3.14159", "2024-12-01", "0x1F", "1,000,000", "42", "007", "9999999",
           "日本語のテキスト", "中文分词测试", "한국어 문장", "Привет, мир", "Ελληνικά", "مرحبا بالعالم",
           "हिन्दी पाठ", "😀", "👍🏽", "🇫🇷", "👨‍👩‍👧", "✨🚀", "café", "naïve", "Straße", "ﬁ",
           "I'm", "you're", "he'S", "we'LL", "they've", "don't", "IT'D", "o'clock",
           "def f(x):\n    return x ** 2\n", "if (a && b) { c++; }", "<div class=\"x\">y</div>",
           "SELECT * FROM t;", "#include <stdio.h>", "a_b-c.d/e\\f", "$HOME/.cache", "[1, 2, 3]",
           "   ", "\t\t", "\n\n\n", " \n ", "\r\n", "\u00a0", "\u3000", "  \t \n")


def sample_texts(n: int, seed: int = 0) -> list[str]:
    """n varied strings: words, numbers, CJK and other scripts, emoji, contractions, code,
    whitespace runs, glued together in random ways (the vocabulary's training text, and the
    strings tools/check_gguf_peer.py tokenizes on both sides)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            parts.append(rng.choice(_WORDS) if rng.random() < 0.5 else rng.choice(_PIECES))
            parts.append(rng.choice((" ", " ", " ", "", "  ", "\n", "\t", ", ", ". ")))
        text = "".join(parts)
        out.append(text.capitalize() if rng.random() < 0.3 else text)
    return out


def train_merges(num_merges: int, seed: int = 0) -> list[str]:
    """Byte-level BPE merges ("a b") learnt by the `tokenizers` library on sample_texts."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=256 + num_merges, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample_texts(4000, seed), trainer)
    return [" ".join(pair) for pair in
            json.loads(tok.to_str())["model"]["merges"]][:num_merges]


# Whole words that no merge builds: Llama 3's vocabulary has such tokens, and its ignore_merges
# takes a piece that is exactly one of them whole (qwen2 merges it by rank instead).
UNMERGED_WORDS = (" serverless", " tokenizers", "Quantized", " kernels", "llama")


def bpe_vocabulary(arch: str, size: int, merges: list[str]) -> tuple[list[str], int]:
    """(tokens, how many are plain): the 256 byte tokens, one per merge, UNMERGED_WORDS, the
    family's specials, reserved CONTROL tokens up to `size`."""
    alphabet = byte_level_alphabet()
    base = alphabet + ["".join(m.split(" ")) for m in merges]
    spelled = ["".join(alphabet[b] for b in word.encode()) for word in UNMERGED_WORDS]
    base += [w for w in spelled if w not in base]
    specials = list(TOKENIZERS[arch].specials)
    if len(base) + len(specials) > size:
        raise ValueError(f"{len(merges)} merges do not fit a vocabulary of {size}")
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(size - len(base) - len(specials))]
    return base + specials + reserved, len(base)


# Merges that join what a pre-tokenizer must keep apart ("it'Sx" is it | 'S | x: a contraction
# before more letters), so that a wrong split shows in the ids.
ACROSS_MERGES = ("' S", "'S x", "' R", "'R e", "'Re A", "'ReA L")


def merges_for(size: int, seed: int = 0) -> list[str]:
    """train_merges for a vocabulary of `size`, then ACROSS_MERGES (room for UNMERGED_WORDS and
    5 specials)."""
    trained = train_merges(size - 256 - len(UNMERGED_WORDS) - len(ACROSS_MERGES) - 5, seed)
    return trained + [m for m in ACROSS_MERGES if m not in trained]


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                      high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """The rope_freqs tensor as llama.cpp's convert_hf_to_gguf.py writes it for Llama 3."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


SPM_SPACE = "\u2581"
# llama.cpp's token types (gguf-py TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _UNUSED, _BYTE = 1, 2, 3, 5, 6


def sentencepiece_vocabulary(size: int, merges: list[str], specials: tuple[str, ...]
                             ) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, types) of a SentencePiece BPE vocabulary as llama.cpp's converter writes
    Gemma's: the specials (CONTROL; <unk> UNKNOWN), the 256 byte-fallback pieces <0xXX>, every
    character of sample_texts, then the byte-level merges' results that are whole UTF-8 text
    (spaces as U+2581), each scored by its merge's rank, padded with <unusedN> (UNUSED)."""
    from ringserve.server.tokenizer import byte_level_alphabet

    byte_of = {c: b for b, c in enumerate(byte_level_alphabet())}
    pieces = [*specials, "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [_CONTROL] * len(specials) + [_UNKNOWN] + [_BYTE] * 256
    scores = [0.0] * len(pieces)
    chars = sorted({c for text in sample_texts(4000) for c in text.replace(" ", SPM_SPACE)})
    seen = set(pieces)
    for rank, text in enumerate([c for c in chars] + ["".join(m.split(" ")) for m in merges]):
        try:
            piece = bytes(byte_of[c] for c in text).decode("utf-8") if rank >= len(chars) else text
        except (KeyError, UnicodeDecodeError):  # a merge inside one character's bytes
            continue
        piece = piece.replace(" ", SPM_SPACE)
        if piece not in seen and len(pieces) < size:
            seen.add(piece)
            pieces.append(piece)
            types.append(_NORMAL)
            scores.append(0.0 if rank < len(chars) else -float(rank))
    unused = size - len(pieces)
    return (pieces + [f"<unused{i}>" for i in range(unused)], scores + [0.0] * unused,
            types + [_UNUSED] * unused)


def _add_tokenizer(w, arch: str, vocab: int, merges: list[str] | None, seed: int) -> None:
    """The tokenizer.* keys of the family's vocabulary (module docstring)."""
    if arch == "gemma3":  # SentencePiece, as Gemma's GGUFs are
        t = TOKENIZERS[arch]
        pieces, scores, types = sentencepiece_vocabulary(
            vocab, merges_for(vocab, seed) if merges is None else merges, t.specials)
        w.add_tokenizer_model("llama")
        w.add_token_list(pieces)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(pieces.index(t.bos))
        w.add_eos_token_id(pieces.index(t.eos))
        w.add_unk_token_id(pieces.index("<unk>"))
        w.add_pad_token_id(pieces.index("<pad>"))
        w.add_add_space_prefix(False)
        w.add_add_bos_token(t.add_bos)
        w.add_chat_template(t.chat_template)
        return
    w.add_tokenizer_model("gpt2")
    if arch == "llama":
        tokens = _vocabulary(vocab)
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML_TEMPLATE)
    else:
        t = TOKENIZERS[arch]
        merges = merges_for(vocab, seed) if merges is None else merges
        tokens, plain = bpe_vocabulary(arch, vocab, merges)
        w.add_tokenizer_pre(t.pre)
        w.add_token_list(tokens)
        w.add_token_types([1] * plain + [3] * (len(tokens) - plain))
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index(t.bos))
        w.add_eos_token_id(tokens.index(t.eos))
        if arch in ("qwen2", "qwen3", "phi3"):
            w.add_pad_token_id(tokens.index(t.bos))
        w.add_add_bos_token(t.add_bos)
        w.add_chat_template(t.chat_template)


def _edit_metadata(w, metadata: dict[str, Any]) -> None:
    """Set (str, bool, int, float) or, with None, drop each key: odd files for the tests."""
    import gguf

    kinds = {str: gguf.GGUFValueType.STRING, bool: gguf.GGUFValueType.BOOL,
             int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32}
    for key, value in metadata.items():
        if value is None:
            w.kv_data[0].pop(key, None)
        else:
            w.kv_data[0][key] = gguf.GGUFValue(value=value, type=kinds[type(value)])


def longrope_factors(rotary_dim: int) -> dict[str, np.ndarray]:
    """Smooth LongRoPE factors of Phi's form (short near 1, long growing to ~40 for the slowest
    dims), rotary_dim / 2 each: the tensors' shapes and magnitudes, not Phi-4-mini's values."""
    s = np.linspace(0.0, 1.0, rotary_dim // 2, dtype=np.float32)
    return {"rope_factors_short.weight": (1.0 + 0.1 * s).astype(np.float32),
            "rope_factors_long.weight": (1.0 + 39.0 * s * s).astype(np.float32)}


def _tensor_data(full: str, kind: str, dims: tuple[int, ...], shape: Shape, rng: np.random.Generator):
    if full == "rope_freqs.weight":
        return llama3_rope_freqs(shape.dim, shape.rope_theta, **LLAMA3_ROPE)
    if full.startswith("rope_factors_"):
        return longrope_factors(shape.rotary_dim or shape.dim)[full]
    if full.endswith(".bias"):
        return (0.1 * rng.standard_normal(dims)).astype(np.float32)
    if kind == "F32":
        return (1.0 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
    return random_blocks(kind, dims[0], dims[1], rng)


def _plan(s: Shape, arch: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, name after "blk.N." or "", dimensions) of every tensor, in file order."""
    head_dim = s.dim
    plan: list[tuple[str, str, tuple[int, ...]]] = [("token_embd.weight", "", (s.vocab, s.hidden))]
    if arch == "llama3":
        plan.append(("rope_freqs.weight", "", (head_dim // 2,)))
    if arch == "phi3":
        plan += [(name, "", ((s.rotary_dim or head_dim) // 2,)) for name in
                 ("rope_factors_long.weight", "rope_factors_short.weight")]
    per_layer = {"attn_norm.weight": (s.hidden,), "attn_q.weight": (s.heads * head_dim, s.hidden),
                 "attn_k.weight": (s.kv_heads * head_dim, s.hidden),
                 "attn_v.weight": (s.kv_heads * head_dim, s.hidden),
                 "attn_output.weight": (s.hidden, s.heads * head_dim), "ffn_norm.weight": (s.hidden,),
                 "ffn_gate.weight": (s.ffn, s.hidden), "ffn_up.weight": (s.ffn, s.hidden),
                 "ffn_down.weight": (s.hidden, s.ffn)}
    if arch == "qwen2":
        per_layer.update({"attn_q.bias": (s.heads * head_dim,), "attn_k.bias": (s.kv_heads * head_dim,),
                          "attn_v.bias": (s.kv_heads * head_dim,)})
    if arch in ("qwen3", "gemma3"):
        per_layer.update({"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)})
    if arch == "gemma3":
        per_layer.update({"post_attention_norm.weight": (s.hidden,), "post_ffw_norm.weight": (s.hidden,)})
    if arch == "phi3":  # HF's fused qkv_proj and gate_up_proj, as llama.cpp's converter keeps them
        for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"):
            del per_layer[name]
        per_layer = {"attn_norm.weight": (s.hidden,),
                     "attn_qkv.weight": ((s.heads + 2 * s.kv_heads) * head_dim, s.hidden),
                     **per_layer, "ffn_up.weight": (2 * s.ffn, s.hidden)}
    for i in range(s.layers):
        plan += [(f"blk.{i}.{name}", name, dims) for name, dims in per_layer.items()]
    plan.append(("output_norm.weight", "", (s.hidden,)))
    if not s.tied:
        plan.append(("output.weight", "", (s.vocab, s.hidden)))
    return plan


def write_random_gguf(path: str | Path, shape: Shape, layout: str = "q4_k_m", seed: int = 0,
                      progress: bool = True, arch: str = "llama", merges: list[str] | None = None,
                      metadata: dict[str, Any] | None = None) -> dict[str, str]:
    """Write the file; returns {GGUF tensor name: GGML type}. ``merges``: the llama3/qwen2
    vocabulary's BPE merges (default: train_merges up to the shape's vocabulary size).
    ``metadata``: keys to set (a str, bool, int or float) or, with None, to leave out: the odd
    files the converter must refuse."""
    import gguf

    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}: one of {', '.join(ARCHS)}")
    rng = np.random.default_rng(seed)
    s = shape
    head_dim = s.dim
    w = gguf.GGUFWriter(str(path), arch if arch in ("qwen2", "qwen3", "phi3", "gemma3") else "llama")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_dimension_count(s.rotary_dim or head_dim)
    if arch == "phi3":  # LongRoPE as convert_hf_to_gguf.py writes Phi-4-mini's
        w.add_rope_scaling_orig_ctx_len(s.original_context)
        scale = s.context / s.original_context
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(s.original_context)))
        w.add_sliding_window(0)
    if s.head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if s.sliding_window is not None:
        w.add_sliding_window(s.sliding_window)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.vocab)
    _add_tokenizer(w, arch, s.vocab, merges, seed)

    plan = _plan(s, arch)

    types: dict[str, str] = {}
    for full, short, dims in plan:
        layer = int(full.split(".")[1]) if full.startswith("blk.") else None
        kind = "F32" if full.startswith("rope_") else tensor_type(layout, short or full, layer, s.layers,
                                                                      s.tied, dims[-1])
        types[full] = kind
        if kind == "F32":
            w.add_tensor_info(full, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = dims[1] // block_size * type_size  # gguf takes a block tensor's byte shape
            w.add_tensor_info(full, (dims[0], row_bytes), np.dtype(np.uint8), dims[0] * row_bytes,
                              raw_dtype=qtype)
    _edit_metadata(w, metadata or {})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for n, (full, _, dims) in enumerate(plan):
        data = _tensor_data(full, types[full], dims, s, rng)
        w.write_tensor_data(data)
        if progress:
            print(f"\r{n + 1}/{len(plan)} tensors", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    w.close()
    return types


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--layout", choices=LAYOUTS, default="q4_k_m")
    p.add_argument("--arch", choices=ARCHS, default="llama",
                   help="what the file is: its architecture, tokenizer and rope scaling (module docstring)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    types = write_random_gguf(args.out, SHAPES[args.shape], args.layout, args.seed, arch=args.arch)
    counts: dict[str, int] = {}
    for kind in types.values():
        counts[kind] = counts.get(kind, 0) + 1
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB, tensors by type "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
