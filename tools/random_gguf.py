"""Random-weight llama GGUFs of real shapes, written without a hub, for memory and speed runs.

    python -m ringserve.tools.random_gguf --shape llama-3.2-1b --layout q4_k_m out.gguf

Any bytes are a valid block of a GGML type once its float16 scale fields are finite, so the
blocks are random bytes with their scales set to small random values (weights of about the size
a trained model has, so that activations stay finite through the layers). The layouts are
llama.cpp's: Q4_K_M (llama_tensor_get_type: Q4_K, with Q6_K for the output (the embedding when
it is tied) and for attn_v and ffn_down in the "more bits" layers), Q8_0, or any one type for
every matrix. Tensors are made and written one at a time, so an 8B file needs no more memory
than its largest tensor. The vocabulary is byte-level BPE padded with filler tokens to the real
size; the text it gives is meaningless, the shapes and bytes are real.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ringserve.tools.tiny_gguf import CHATML_TEMPLATE, MERGES, SPECIAL_TOKENS, byte_level_alphabet


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


SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "llama-3.2-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    "llama-3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False),
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49152,
                          rope_theta=100000.0),
}

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
    if name.endswith("norm.weight"):
        return "F32"
    kind = layout.upper()
    if layout == "q4_k_m":
        kind = "Q4_K"
        if name == "output.weight" or (tied and name == "token_embd.weight"):  # the lm_head
            kind = "Q6_K"
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


def write_random_gguf(path: str | Path, shape: Shape, layout: str = "q4_k_m", seed: int = 0,
                      progress: bool = True) -> dict[str, str]:
    """Write the file; returns {GGUF tensor name: GGML type}."""
    import gguf

    rng = np.random.default_rng(seed)
    s = shape
    head_dim = s.hidden // s.heads
    tokens = _vocabulary(s.vocab)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)

    plan: list[tuple[str, str, tuple[int, ...]]] = [("token_embd.weight", "", (s.vocab, s.hidden))]
    per_layer = {"attn_norm.weight": (s.hidden,), "attn_q.weight": (s.heads * head_dim, s.hidden),
                 "attn_k.weight": (s.kv_heads * head_dim, s.hidden),
                 "attn_v.weight": (s.kv_heads * head_dim, s.hidden),
                 "attn_output.weight": (s.hidden, s.heads * head_dim), "ffn_norm.weight": (s.hidden,),
                 "ffn_gate.weight": (s.ffn, s.hidden), "ffn_up.weight": (s.ffn, s.hidden),
                 "ffn_down.weight": (s.hidden, s.ffn)}
    for i in range(s.layers):
        plan += [(f"blk.{i}.{name}", name, dims) for name, dims in per_layer.items()]
    plan.append(("output_norm.weight", "", (s.hidden,)))
    if not s.tied:
        plan.append(("output.weight", "", (s.vocab, s.hidden)))

    types: dict[str, str] = {}
    for full, short, dims in plan:
        layer = int(full.split(".")[1]) if full.startswith("blk.") else None
        kind = tensor_type(layout, short or full, layer, s.layers, s.tied, dims[-1])
        types[full] = kind
        if kind == "F32":
            w.add_tensor_info(full, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = dims[1] // block_size * type_size  # gguf takes a block tensor's byte shape
            w.add_tensor_info(full, (dims[0], row_bytes), np.dtype(np.uint8), dims[0] * row_bytes,
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for n, (full, _, dims) in enumerate(plan):
        kind = types[full]
        if kind == "F32":
            data = (1.0 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
        else:
            data = random_blocks(kind, dims[0], dims[1], rng)
        w.write_tensor_data(data)
        if progress:
            print(f"\r{n + 1}/{len(plan)} tensors", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    w.close()
    return types


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--layout", choices=LAYOUTS, default="q4_k_m")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    types = write_random_gguf(args.out, SHAPES[args.shape], args.layout, args.seed)
    counts: dict[str, int] = {}
    for kind in types.values():
        counts[kind] = counts.get(kind, 0) + 1
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB, tensors by type "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
