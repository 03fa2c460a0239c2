"""Make tests/data/qwen3_tiny/: what transformers computes for a tiny random Qwen3 (dense).

Run it once, offline, with a Python that has torch, transformers, safetensors, tokenizers and
numpy (ringserve never imports torch), and the default model in ringserve's cache (its
tokenizer files are the tiny model's):

    /tmp/refvenv/bin/python tools/make_qwen3_reference.py ~/.cache/ringserve/models/v2/<model>

1. writes config.json with transformers' own Qwen3Config (head_dim 32 where hidden / heads is
   16, GQA 4/2, an untied lm_head (a tied one echoes the input token here), rope_theta 1e6 as Qwen3 ships);
2. builds the folder with tools/tiny_qwen3.py (random weights from numpy, the same bytes the
   tests make) and loads it with Qwen3ForCausalLM in float32;
3. for each prompt, greedy-decodes NEW_TOKENS tokens, then runs the whole sequence once and
   stores the argmax at every position (over the whole vocabulary) and the logits at every
   position for every COLUMN_STRIDE-th vocabulary id (to keep the file tens of KB).
"""
from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "qwen3_tiny"
COLUMN_STRIDE = 256
NEW_TOKENS = 8
PROMPTS = ["The capital of France is",
           "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n<think>\n"]


def _import_checkout() -> None:
    """``import ringserve.tools...`` from this checkout (tools/make_reference_logits.py's way)."""
    package = types.ModuleType("ringserve")
    package.__path__ = [str(REPO)]
    sys.modules["ringserve"] = package


def main(tokenizer_dir: str) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    _import_checkout()
    from ringserve.tools.tiny_qwen3 import make_tiny_qwen3

    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    config.architectures = ["Qwen3ForCausalLM"]
    OUT.mkdir(parents=True, exist_ok=True)
    config.to_json_file(OUT / "config.json")
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_qwen3(Path(tmp) / "qwen3", config=OUT / "config.json", tokenizer_dir=tokenizer_dir)
        model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
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
