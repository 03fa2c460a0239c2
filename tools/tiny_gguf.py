"""A tiny llama GGUF, written at test time with the gguf package's GGUFWriter, the way
llama.cpp's convert_hf_to_gguf.py writes one: q/k rows permuted for llama.cpp's RoPE, tensors
quantized with gguf.quants.quantize, a byte-level BPE vocabulary with merges and CONTROL tokens.

    original = make_tiny_gguf("tiny.gguf")     # the HF-layout float32 weights it was made from

The types of the tensors are chosen so that one file exercises every type the converter reads.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ringserve.server.tokenizer import byte_level_alphabet

# GGUF tensor (after "blk.N.") -> (HF name, GGML type name). Quantized rows are 32-multiples.
LAYER_TENSORS = {
    "attn_norm.weight": ("input_layernorm.weight", "F32"),
    "attn_q.weight": ("self_attn.q_proj.weight", "F16"),     # exact, so the un-permute is checked exactly
    "attn_k.weight": ("self_attn.k_proj.weight", "Q4_1"),
    "attn_v.weight": ("self_attn.v_proj.weight", "Q4_0"),
    "attn_output.weight": ("self_attn.o_proj.weight", "Q8_0"),
    "ffn_norm.weight": ("post_attention_layernorm.weight", "F32"),
    "ffn_gate.weight": ("mlp.gate_proj.weight", "Q4_0"),
    "ffn_up.weight": ("mlp.up_proj.weight", "Q4_1"),
    "ffn_down.weight": ("mlp.down_proj.weight", "F16"),
}
_NUMPY_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}  # written as they are
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # CONTROL, ids 0 1 2
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ Ġ"]
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' "
                   "+ message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of HF q/k rows (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny_gguf(path: str | Path, *, arch: str = "llama", seed: int = 0, num_layers: int = 2,
                   hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 96,
                   tied: bool = False, type_overrides: dict[str, str] | None = None,
                   extra_tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write the GGUF and return the float32 HF-layout weights it was made from.

    ``type_overrides`` maps a GGUF tensor name suffix ("attn_v.weight", "token_embd.weight") to
    another GGML type name; ``extra_tensors`` are written as they are (to make invalid files)."""
    import gguf
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    tokens = SPECIAL_TOKENS + byte_level_alphabet() + ["".join(m.split(" ")) for m in MERGES]
    token_types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    vocab, head_dim = len(tokens), hidden // heads
    types = {"token_embd.weight": "Q8_0", "output_norm.weight": "F32", "output.weight": "F32",
             **{k: t for k, (_, t) in LAYER_TENSORS.items()}, **(type_overrides or {})}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(num_layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)

    original: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], permute_heads: int | None = None) -> None:
        x = (rng.standard_normal(shape) * (1.0 if len(shape) == 1 else 0.1)).astype(np.float32)
        original[hf_name] = x
        stored = permute_qk(x, permute_heads) if permute_heads else x
        kind = types[gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name]
        qtype = GGMLQuantizationType[kind]
        if kind in _NUMPY_TYPES:
            w.add_tensor(gguf_name, stored.astype(_NUMPY_TYPES[kind]))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    for i in range(num_layers):
        shapes = {"attn_norm.weight": (hidden,), "attn_q.weight": (heads * head_dim, hidden),
                  "attn_k.weight": (kv_heads * head_dim, hidden),
                  "attn_v.weight": (kv_heads * head_dim, hidden),
                  "attn_output.weight": (hidden, heads * head_dim), "ffn_norm.weight": (hidden,),
                  "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden),
                  "ffn_down.weight": (hidden, ffn)}
        for name, (hf, _) in LAYER_TENSORS.items():
            permute = heads if name == "attn_q.weight" else kv_heads if name == "attn_k.weight" else None
            add(f"blk.{i}.{name}", f"model.layers.{i}.{hf}", shapes[name], permute)
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, hidden))
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return original
