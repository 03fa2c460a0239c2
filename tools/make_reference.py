"""Make tests/data/<name>_tiny/: what transformers computes for a tiny random model of a family.

Run it once, offline, with a Python that has torch, transformers, safetensors, tokenizers and
numpy (ringserve never imports torch), and the default model in ringserve's cache (its
tokenizer files are the tiny model's):

    /tmp/refvenv/bin/python tools/make_reference.py NAME ~/.cache/ringserve/models/v2/<model> [--out DIR]

NAME is one of REFERENCES (or "all"); --out writes <DIR>/<name>_tiny/ instead of tests/data/
(to check that a rerun gives the committed arrays). For each:

1. writes config.json with transformers' own config class and the arguments below;
2. builds the folder with tools/tiny_models.py (random weights from numpy, the same bytes the
   tests make) and loads it with the family's ...ForCausalLM in float32;
3. for each prompt, greedy-decodes its new tokens, then runs the whole sequence once and stores
   the argmax at every position (over the whole vocabulary) and the logits at every position for
   every column_stride-th vocabulary id (to keep the file tens of KB).

The models:
- qwen3: head_dim 32 where hidden / heads is 16, GQA 4/2, an untied lm_head (a tied one echoes
  the input token here), rope_theta 1e6 as Qwen3 ships.
- mistral / ministral: sliding_window 24 (not a multiple of the 16-token KV block) on every layer
  (Mistral) or interleaved with full attention (layer_types, as Ministral-8B), GQA 4/2, an untied
  lm_head, rope_theta 1e6; each sequence is over 3 windows long.
- phi3: Phi-4-mini's partial_rotary_factor 0.75 (head_dim 32, 24 rotary dims), GQA 4/2, LongRoPE
  with its own short and long factors and a small original_max_position_embeddings (16 of 64) so
  that a prompt crosses it, a sliding_window as long as max_position_embeddings (Phi-3.5's "no
  window"), an untied lm_head. transformers picks LongRoPE's factors by the sequence's length:
  short while it stays within original_max_position_embeddings, long for every position once it
  is longer. ringserve picks them once per server by max_model_len (gpu/rope.py): the first
  prompt and its tokens stay within 16 (short; the tests serve it with max_model_len 16), the
  second starts past it (long from its first forward on, in transformers as in a server with
  max_model_len 64): `max_model_lens` in the file says which.
- gemma3: 7 layers, every 6th full (the pattern llama.cpp assumes, so the GGUF round trip holds:
  sliding 0-4 and 6, full 5), a sliding window of 24, RoPE bases 1e6 (full, linear scaling x2)
  and 1e4 (sliding), query_pre_attn_scalar 48 where head_dim is 32, GQA 4/2, a tied lm_head (as
  Gemma), eager attention; the second prompt and its continuation are longer than the window.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"


@dataclass(frozen=True)
class Prompt:
    text: str
    new_tokens: int = 8
    max_model_len: int | None = None  # stored as max_model_lens where the tests serve it with one


@dataclass(frozen=True)
class Reference:
    family: str                      # tools/tiny_models.py's
    config_class: str                # transformers' names
    model_class: str
    config: dict[str, Any]
    prompts: tuple[Prompt, ...]
    column_stride: int = 256
    load: dict[str, Any] = field(default_factory=dict)  # from_pretrained's other arguments
    check_config: Callable[[Any], bool] = lambda config: True
    check_prompt: Callable[[Prompt, list[int], list[int]], bool] = lambda prompt, ids, seq: True


FRANCE = "The capital of France is"
WINDOW = 24  # Mistral's, Ministral's and Gemma's sliding window
MISTRAL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
               max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, sliding_window=WINDOW, rope_parameters={"rope_type": "default",
                                                                       "rope_theta": 1000000.0})
# (a short prompt whose continuation runs past 3 windows, and a prompt over 3 windows long by itself)
MISTRAL_PROMPTS = (
    Prompt(FRANCE, 72),
    Prompt("A sliding window keeps the last few thousand tokens of every request in the cache; "
           "a query reads only those keys, so a long conversation costs the same per token as a "
           "short one, and the blocks before the window go back to the pool at once.", 40))
PHI3_ORIGINAL_CONTEXT, PHI3_MAX_POSITIONS = 16, 64
_PHI3_STEPS = np.arange(12) / 11  # 12 = rotary half: head_dim 32 * 0.75 / 2


def _over_three_windows(prompt: Prompt, ids: list[int], seq: list[int]) -> bool:
    return len(seq) > 3 * WINDOW


def _phi3_rope_side(prompt: Prompt, ids: list[int], seq: list[int]) -> bool:
    """The prompt served with max_model_len 16 stays within it; the other starts past it."""
    short = prompt.max_model_len == PHI3_ORIGINAL_CONTEXT
    return ((len(ids) + prompt.new_tokens <= PHI3_ORIGINAL_CONTEXT) == short
            and (len(ids) > PHI3_ORIGINAL_CONTEXT or short))


REFERENCES = {
    "qwen3": Reference(
        "qwen3", "Qwen3Config", "Qwen3ForCausalLM",
        dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
             rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2),
        (Prompt(FRANCE),
         Prompt("<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n<think>\n"))),
    "mistral": Reference("mistral", "MistralConfig", "MistralForCausalLM", MISTRAL, MISTRAL_PROMPTS,
                         column_stride=1024, check_prompt=_over_three_windows),
    "ministral": Reference("mistral", "MinistralConfig", "MinistralForCausalLM",
                           {**MISTRAL, "layer_types": ["sliding_attention", "full_attention"]},
                           MISTRAL_PROMPTS, column_stride=1024, check_prompt=_over_three_windows),
    "phi3": Reference(
        "phi3", "Phi3Config", "Phi3ForCausalLM",
        dict(vocab_size=49152, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
             max_position_embeddings=PHI3_MAX_POSITIONS,
             original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT, sliding_window=PHI3_MAX_POSITIONS,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                              "short_factor": [round(1.0 + 0.5 * s, 4) for s in _PHI3_STEPS],
                              "long_factor": [round(1.0 + 15.0 * s * s, 4) for s in _PHI3_STEPS]}),
        (Prompt(FRANCE, max_model_len=PHI3_ORIGINAL_CONTEXT),
         Prompt("<|im_start|>user\nName three rivers of Europe and say which is the longest.<|im_end|>\n"
                "<|im_start|>assistant\n", max_model_len=PHI3_MAX_POSITIONS)),
        check_prompt=_phi3_rope_side),
    "gemma3": Reference(
        "gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
             query_pre_attn_scalar=48, sliding_window=WINDOW, sliding_window_pattern=6,
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
             max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
             pad_token_id=0),
        (Prompt(FRANCE),
         Prompt("<start_of_turn>user\nWrite one sentence about the sea, then count from one to ten in words."
                "<end_of_turn>\n<start_of_turn>model\n")),
        load={"attn_implementation": "eager"},
        check_config=lambda config: config.layer_types == ["sliding_attention"] * 5 + ["full_attention",
                                                                                      "sliding_attention"]),
}


def _import_checkout() -> None:
    """``import ringserve.tools...`` from this checkout (tools/make_reference_logits.py's way)."""
    package = types.ModuleType("ringserve")
    package.__path__ = [str(REPO)]
    sys.modules["ringserve"] = package


def make(ref: Reference, out: Path, tokenizer_dir: str) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer

    from ringserve.tools.tiny_models import make_tiny_model

    config = getattr(transformers, ref.config_class)(**ref.config)
    config.architectures = [ref.model_class]
    assert ref.check_config(config)
    out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(out / "config.json")
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_model(ref.family, Path(tmp) / "m", config=out / "config.json",
                                 tokenizer_dir=tokenizer_dir)
        model = getattr(transformers, ref.model_class).from_pretrained(folder, dtype=torch.float32,
                                                                        **ref.load).eval()
        prompt_ids, sequences, argmax, columns = [], [], [], []
        with torch.no_grad():
            for prompt in ref.prompts:
                ids = tokenizer.encode(prompt.text, add_special_tokens=False).ids
                seq = model.generate(torch.tensor([ids]), max_new_tokens=prompt.new_tokens,
                                     min_new_tokens=prompt.new_tokens, do_sample=False)[0].tolist()
                assert ref.check_prompt(prompt, ids, seq)
                logits = model(torch.tensor([seq])).logits[0]
                assert logits[len(ids) - 1:-1].argmax(-1).tolist() == seq[len(ids):]
                prompt_ids.append(ids)
                sequences.append(seq)
                argmax.append(logits.argmax(-1).numpy())
                columns.append(logits[:, ::ref.column_stride].numpy())
                print(f"{len(ids)} prompt tokens -> {seq[len(ids):]}", file=sys.stderr)
    arrays: dict[str, Any] = {"prompt_lens": np.array([len(i) for i in prompt_ids], np.int32)}
    if max_model_lens := [p.max_model_len for p in ref.prompts if p.max_model_len is not None]:
        arrays["max_model_lens"] = np.array(max_model_lens, np.int32)
    np.savez_compressed(
        out / "reference.npz",
        **arrays,
        sequence_ids=np.concatenate([np.array(s, np.int32) for s in sequences]),
        sequence_lens=np.array([len(s) for s in sequences], np.int32),
        argmax=np.concatenate(argmax).astype(np.int32),
        logits_columns=np.concatenate(columns).astype(np.float32),
        column_stride=np.array(ref.column_stride, np.int32),
        versions=np.array([f"torch {torch.__version__}", f"transformers {transformers.__version__}"]),
    )
    print(f"wrote {out} ({(out / 'reference.npz').stat().st_size / 1e3:.0f} kB)", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=[*REFERENCES, "all"])
    parser.add_argument("tokenizer_dir")
    parser.add_argument("--out", type=Path, default=DATA, help="the folder that gets <name>_tiny/")
    args = parser.parse_args()
    _import_checkout()
    for name in REFERENCES if args.name == "all" else [args.name]:
        make(REFERENCES[name], args.out / f"{name}_tiny", args.tokenizer_dir)


if __name__ == "__main__":
    main()
