"""Make tests/data/mistral_tiny/ and tests/data/ministral_tiny/: what transformers computes for a
tiny random Mistral with a sliding window on every layer, and a Ministral whose layers
interleave sliding and full attention (layer_types, as Ministral-8B).

Run it once, offline, with a Python that has torch, transformers, safetensors, tokenizers and
numpy (ringserve never imports torch), and the default model in ringserve's cache (its
tokenizer files are the tiny model's):

    /tmp/refvenv/bin/python tools/make_mistral_reference.py ~/.cache/ringserve/models/v2/<model>

1. writes config.json with transformers' own MistralConfig / MinistralConfig: sliding_window 24
   (not a multiple of the 16-token KV block), GQA 4/2, an untied lm_head, rope_theta 1e6;
2. builds the folder with tools/tiny_mistral.py (random weights from numpy, the same bytes the
   tests make) and loads it with MistralForCausalLM / MinistralForCausalLM in float32;
3. for each prompt, greedy-decodes its NEW_TOKENS, then runs the whole sequence (over 3 windows
   long) once and stores the argmax at every position (over the whole vocabulary) and the
   logits at every position for every COLUMN_STRIDE-th vocabulary id (tens of KB).
"""
from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
COLUMN_STRIDE = 1024
WINDOW = 24
# (prompt, new tokens): a short prompt whose continuation runs past 3 windows, and a prompt
# over 3 windows long by itself
PROMPTS = [("The capital of France is", 72),
           ("A sliding window keeps the last few thousand tokens of every request in the cache; "
            "a query reads only those keys, so a long conversation costs the same per token as a "
            "short one, and the blocks before the window go back to the pool at once.", 40)]
SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2, sliding_window=WINDOW, rope_parameters={"rope_type": "default",
                                                                     "rope_theta": 1000000.0})


def _import_checkout() -> None:
    """``import ringserve.tools...`` from this checkout (tools/make_reference_logits.py's way)."""
    package = types.ModuleType("ringserve")
    package.__path__ = [str(REPO)]
    sys.modules["ringserve"] = package


def make(out: Path, config, model_class, tokenizer_dir: str) -> None:
    import torch
    from tokenizers import Tokenizer

    from ringserve.tools.tiny_mistral import make_tiny_mistral

    out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(out / "config.json")
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_mistral(Path(tmp) / "m", config=out / "config.json", tokenizer_dir=tokenizer_dir)
        model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
        prompt_ids, sequences, argmax, columns = [], [], [], []
        with torch.no_grad():
            for text, new_tokens in PROMPTS:
                ids = tokenizer.encode(text, add_special_tokens=False).ids
                seq = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False)[0].tolist()
                assert len(seq) > 3 * WINDOW
                logits = model(torch.tensor([seq])).logits[0]
                assert logits[len(ids) - 1:-1].argmax(-1).tolist() == seq[len(ids):]
                prompt_ids.append(ids)
                sequences.append(seq)
                argmax.append(logits.argmax(-1).numpy())
                columns.append(logits[:, ::COLUMN_STRIDE].numpy())
                print(f"{len(ids)} prompt tokens -> {seq[len(ids):]}", file=sys.stderr)
    np.savez_compressed(
        out / "reference.npz",
        prompt_lens=np.array([len(i) for i in prompt_ids], np.int32),
        sequence_ids=np.concatenate([np.array(s, np.int32) for s in sequences]),
        sequence_lens=np.array([len(s) for s in sequences], np.int32),
        argmax=np.concatenate(argmax).astype(np.int32),
        logits_columns=np.concatenate(columns).astype(np.float32),
        column_stride=np.array(COLUMN_STRIDE, np.int32),
        versions=np.array([f"torch {torch.__version__}",
                           f"transformers {__import__('transformers').__version__}"]),
    )
    print(f"wrote {out} ({(out / 'reference.npz').stat().st_size / 1e3:.0f} kB)", file=sys.stderr)


def main(tokenizer_dir: str) -> None:
    from transformers import MinistralConfig, MinistralForCausalLM, MistralConfig, MistralForCausalLM

    _import_checkout()
    mistral = MistralConfig(**SHAPE)
    mistral.architectures = ["MistralForCausalLM"]
    make(DATA / "mistral_tiny", mistral, MistralForCausalLM, tokenizer_dir)
    ministral = MinistralConfig(**SHAPE, layer_types=["sliding_attention", "full_attention"])
    ministral.architectures = ["MinistralForCausalLM"]
    make(DATA / "ministral_tiny", ministral, MinistralForCausalLM, tokenizer_dir)


if __name__ == "__main__":
    main(sys.argv[1])
