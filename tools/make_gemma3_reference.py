"""Make tests/data/gemma3_tiny/: what transformers computes for a tiny random Gemma 3 (text).

Run it once, offline, with a Python that has torch, transformers, safetensors, tokenizers and
numpy (ringserve never imports torch), and the default model in ringserve's cache (its
tokenizer files are the tiny model's):

    /tmp/refvenv/bin/python tools/make_gemma3_reference.py ~/.cache/ringserve/models/v2/<model>

1. writes config.json with transformers' own Gemma3TextConfig: 7 layers, every 6th full (the
   pattern llama.cpp assumes, so the GGUF round trip holds: sliding 0-4 and 6, full 5), a
   sliding window of 24, RoPE bases 1e6 (full, linear scaling x2) and 1e4 (sliding),
   query_pre_attn_scalar 48 where head_dim is 32, GQA 4/2, a tied lm_head (as Gemma);
2. builds the folder with tools/tiny_gemma3.py (random weights from numpy, the same bytes the
   tests make) and loads it with Gemma3ForCausalLM in float32, eager attention;
3. for each prompt, greedy-decodes NEW_TOKENS tokens, then runs the whole sequence once and
   stores the argmax at every position (over the whole vocabulary) and the logits at every
   position for every COLUMN_STRIDE-th vocabulary id (to keep the file tens of KB). The second
   prompt and its continuation are longer than the window.
"""
from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "gemma3_tiny"
COLUMN_STRIDE = 256
NEW_TOKENS = 8
PROMPTS = ["The capital of France is",
           "<start_of_turn>user\nWrite one sentence about the sea, then count from one to ten in words."
           "<end_of_turn>\n<start_of_turn>model\n"]


def _import_checkout() -> None:
    """``import ringserve.tools...`` from this checkout (tools/make_reference_logits.py's way)."""
    package = types.ModuleType("ringserve")
    package.__path__ = [str(REPO)]
    sys.modules["ringserve"] = package


def main(tokenizer_dir: str) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    _import_checkout()
    from ringserve.tools.tiny_gemma3 import make_tiny_gemma3

    config = Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        query_pre_attn_scalar=48, sliding_window=24, sliding_window_pattern=6,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    config.architectures = ["Gemma3ForCausalLM"]
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    OUT.mkdir(parents=True, exist_ok=True)
    config.to_json_file(OUT / "config.json")
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_gemma3(Path(tmp) / "gemma3", config=OUT / "config.json",
                                  tokenizer_dir=tokenizer_dir)
        model = Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        prompt_ids, sequences, argmax, columns = [], [], [], []
        with torch.no_grad():
            for text in PROMPTS:
                ids = tokenizer.encode(text, add_special_tokens=False).ids
                seq = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
                logits = model(torch.tensor([seq])).logits[0]
                assert logits[len(ids) - 1:-1].argmax(-1).tolist() == seq[len(ids):]
                prompt_ids.append(ids)
                sequences.append(seq)
                argmax.append(logits.argmax(-1).numpy())
                columns.append(logits[:, ::COLUMN_STRIDE].numpy())
                print(f"{len(ids)} prompt tokens -> {seq[len(ids):]}", file=sys.stderr)
    np.savez_compressed(
        OUT / "reference.npz",
        prompt_lens=np.array([len(i) for i in prompt_ids], np.int32),
        sequence_ids=np.concatenate([np.array(s, np.int32) for s in sequences]),
        sequence_lens=np.array([len(s) for s in sequences], np.int32),
        argmax=np.concatenate(argmax).astype(np.int32),
        logits_columns=np.concatenate(columns).astype(np.float32),
        column_stride=np.array(COLUMN_STRIDE, np.int32),
        versions=np.array([f"torch {torch.__version__}",
                           f"transformers {__import__('transformers').__version__}"]),
    )
    print(f"wrote {OUT} ({(OUT / 'reference.npz').stat().st_size / 1e3:.0f} kB)", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
