"""Make tests/data/phi3_tiny/: what transformers computes for a tiny random Phi-3.

Run it once, offline, with a Python that has torch, transformers, safetensors, tokenizers and
numpy (ringserve never imports torch), and the default model in ringserve's cache (its
tokenizer files are the tiny model's):

    /tmp/refvenv/bin/python tools/make_phi3_reference.py ~/.cache/ringserve/models/v2/<model>

1. writes config.json with transformers' own Phi3Config: Phi-4-mini's partial_rotary_factor 0.75
   (head_dim 32, 24 rotary dims), GQA 4/2, LongRoPE with its own short and long factors and a
   small original_max_position_embeddings (16 of 64) so that a prompt crosses it, a sliding_window
   as long as max_position_embeddings (Phi-3.5's "no window"), an untied lm_head;
2. builds the folder with tools/tiny_phi3.py (random weights from numpy, the same bytes the
   tests make) and loads it with Phi3ForCausalLM in float32;
3. for each prompt, greedy-decodes NEW_TOKENS tokens, then runs the whole sequence once and
   stores the argmax at every position (over the whole vocabulary) and the logits at every
   position for every COLUMN_STRIDE-th vocabulary id (to keep the file tens of KB).

transformers picks LongRoPE's factors by the sequence's length: short while it stays within
original_max_position_embeddings, long for every position once it is longer. ringserve picks
them once per server by max_model_len (gpu/rope.py): the first prompt and its tokens stay within
16 (short; the tests serve it with max_model_len 16), the second starts past it (long from its
first forward on, in transformers as in a server with max_model_len 64): `max_model_len` in the
file says which.
"""
from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "phi3_tiny"
COLUMN_STRIDE = 256
NEW_TOKENS = 8
ORIGINAL_CONTEXT, MAX_POSITIONS = 16, 64
# (prompt, the max_model_len that serves it as transformers computes it)
PROMPTS = [("The capital of France is", ORIGINAL_CONTEXT),
           ("<|im_start|>user\nName three rivers of Europe and say which is the longest.<|im_end|>\n"
            "<|im_start|>assistant\n", MAX_POSITIONS)]


def _import_checkout() -> None:
    """``import ringserve.tools...`` from this checkout (tools/make_reference_logits.py's way)."""
    package = types.ModuleType("ringserve")
    package.__path__ = [str(REPO)]
    sys.modules["ringserve"] = package


def main(tokenizer_dir: str) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import Phi3Config, Phi3ForCausalLM

    _import_checkout()
    from ringserve.tools.tiny_phi3 import make_tiny_phi3

    rotary_half = 12  # head_dim 32 * 0.75 / 2
    steps = np.arange(rotary_half) / (rotary_half - 1)
    config = Phi3Config(
        vocab_size=49152, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=MAX_POSITIONS, original_max_position_embeddings=ORIGINAL_CONTEXT,
        sliding_window=MAX_POSITIONS,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [round(1.0 + 0.5 * s, 4) for s in steps],
                         "long_factor": [round(1.0 + 15.0 * s * s, 4) for s in steps]})
    config.architectures = ["Phi3ForCausalLM"]
    OUT.mkdir(parents=True, exist_ok=True)
    config.to_json_file(OUT / "config.json")
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_phi3(Path(tmp) / "phi3", config=OUT / "config.json", tokenizer_dir=tokenizer_dir)
        model = Phi3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        prompt_ids, sequences, argmax, columns = [], [], [], []
        with torch.no_grad():
            for text, max_model_len in PROMPTS:
                ids = tokenizer.encode(text, add_special_tokens=False).ids
                assert (len(ids) + NEW_TOKENS <= ORIGINAL_CONTEXT) == (max_model_len == ORIGINAL_CONTEXT)
                assert len(ids) > ORIGINAL_CONTEXT or max_model_len == ORIGINAL_CONTEXT
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
        max_model_lens=np.array([m for _, m in PROMPTS], np.int32),
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
