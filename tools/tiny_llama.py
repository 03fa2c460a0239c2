"""A tiny random Llama, made at test time: a real HF-layout folder that every part of
ringserve loads exactly as it loads a real model (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json).

Deterministic from the seed. Weights are scaled so that activations stay O(1) and the logits
are spread (not uniform, not one-hot), so greedy outputs depend on the prompt. float32 by
default; dtype="bfloat16" writes every tensor as BF16 (rounded to nearest even), as a bfloat16
HF checkpoint is stored, and dtype="float16" as FP16.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = ["<|endoftext|>", BOS, EOS]  # ids 0, 1, 2 as in SmolLM2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The KV cache keeps the keys and values of every token a request has seen, so that a new
token needs one row of attention instead of the whole prompt again. A block of sixteen
tokens is the unit of the cache; a request's block table lists its blocks in order.
Continuous batching lets requests join and leave the running batch at every step.
The scheduler keeps running requests going first, then admits waiting ones as prefill.
Hello, world! How are you today? I am fine, thank you. What is 12 + 34? It is 46.
She sells sea shells by the sea shore; the shells she sells are surely sea shells.
In 1969, two people walked on the Moon and came home again, 384400 km away.
Café, naïve, jalapeño, 東京, Привет, and emoji 🙂 are text too.
The user asks, the assistant answers, and the system prompt sets the rules.
def add(a, b):
    return a + b
"""


def make_tiny_llama(path: str | Path, *, seed: int = 0, num_layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 128, vocab: int = 384,
                    tie_embeddings: bool = True, rope_theta: float = 10000.0,
                    max_position_embeddings: int = 2048, rms_norm_eps: float = 1e-5,
                    dtype: str = "float32") -> Path:
    """Write a tiny random Llama into ``path`` (created if needed) and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab)
    tokenizer.save(str(path / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)

    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_embeddings,
        "attention_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    _write_json(path / "tokenizer_config.json", {
        "bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": None,
        "add_bos_token": False, "chat_template": CHATML_TEMPLATE,
        "model_max_length": max_position_embeddings, "tokenizer_class": "GPT2Tokenizer",
    })

    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def proj(out_dim: int, in_dim: int) -> np.ndarray:
        return normal((out_dim, in_dim), in_dim ** -0.5)

    def norm() -> np.ndarray:
        return (1.0 + normal((hidden,), 0.1)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal((vocab_size, hidden), 0.3)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm()
        tensors[p + "self_attn.q_proj.weight"] = proj(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = proj(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = proj(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = proj(hidden, heads * head_dim)
        tensors[p + "post_attention_layernorm.weight"] = norm()
        tensors[p + "mlp.gate_proj.weight"] = proj(ffn, hidden)
        tensors[p + "mlp.up_proj.weight"] = proj(ffn, hidden)
        tensors[p + "mlp.down_proj.weight"] = proj(hidden, ffn)
    tensors["model.norm.weight"] = norm()
    if not tie_embeddings:
        tensors["lm_head.weight"] = normal((vocab_size, hidden), 0.3)
    if dtype == "bfloat16":
        save_bf16(tensors, path / "model.safetensors")
    elif dtype in ("float32", "float16"):
        save_file({k: v.astype(dtype) for k, v in tensors.items()}, str(path / "model.safetensors"),
                  metadata={"format": "np"})
    else:
        raise ValueError(f"dtype {dtype!r}: float32, float16 or bfloat16")
    return path


def save_bf16(tensors: dict[str, np.ndarray], path: Path) -> None:
    """float32 tensors written as a BF16 safetensors file (by hand: numpy has no bfloat16, so
    safetensors.numpy cannot write one), each rounded to nearest even as torch rounds."""
    header: dict[str, dict] = {}
    chunks, offset = [], 0
    for name, t in tensors.items():
        bits = np.ascontiguousarray(t, np.float32).view(np.uint32)
        bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")  # finite values only
        header[name] = {"dtype": "BF16", "shape": list(t.shape),
                        "data_offsets": [offset, offset + bf16.nbytes]}
        chunks.append(bf16.tobytes())
        offset += bf16.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(chunks))


def _train_tokenizer(vocab: int) -> Tokenizer:
    """A byte-level BPE like SmolLM2's: digits split one by one, then the GPT-2 regex."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    return tokenizer


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
