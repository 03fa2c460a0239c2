"""Make tests/data/smollm2_reference.npz: what transformers computes for the default model.

Run it with a Python that has torch, transformers, accelerate (transformers needs it to load a
GGUF) and gguf, plus numpy, tokenizers and tqdm; ringserve itself never imports torch:

    /tmp/refvenv/bin/python tools/make_reference_logits.py      # about a minute on 2 cores

It imports ringserve straight from this checkout (no install needed: see _import_checkout) and

1. converts the default GGUF with our converter into a temporary folder;
2. loads transformers' LlamaForCausalLM (a) from the original GGUF and (b) from the converted
   folder, both float32, and asserts that every weight and every logit is identical (the
   conversion is exact);
3. stores, for three prompts (one rendered through the chat template by transformers), the token
   ids, the float32 logits at the last position, and the logits at every position for every 32nd
   vocabulary id (to keep the file small);
4. stores the token ids transformers' GGUF tokenizer gives for a battery of tokenizer strings,
   both as it is and fed llama.cpp's 'smollm' pre-split (every numeric character alone, see
   smollm_pieces): transformers builds this GGUF's tokenizer without that split, so the two
   differ where whitespace precedes a digit ("a  1": transformers 'Ġ','Ġ','1', llama.cpp and
   the original SmolLM2 tokenizer.json 'ĠĠ','1').
"""
from __future__ import annotations

import sys
import tempfile
import types
import unicodedata
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "smollm2_reference.npz"
COLUMN_STRIDE = 32  # every position's logits are kept for vocab ids 0, 32, 64, ...

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
]
CHAT = [{"role": "user", "content": "What is 12 times 7? Answer in one short sentence."}]

TOKENIZER_STRINGS = [
    "12345 and 3.14159",
    "1,000,000 people in 2024, x1y22z333",
    *("a" + " " * n + "b" for n in range(2, 9)),
    *(" " * n + "word" for n in (1, 2, 3, 5, 8)),
    *("word" + " " * n for n in (1, 2, 4)),
    *("a" + " " * n + "1" for n in (1, 2, 3, 6)),
    "x  42 and\n\n7\t 8",
    "\tindented\n\n\tline\r\nnext",
    "a\t\tb\n\n\n   c",
    " leading space",
    "Café naïve résumé Ñandú Ærø",
    "日本語のテキスト、中文和한국어",
    "emoji 👍🏽 family 👨‍👩‍👧 party 🎉!",
    "²³ ½ Ⅻ ٣٤ numerics",
    "Don't you're we'll I'M it's",
    "hello!!! ??? ... --- ***",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user",
    "text<|endoftext|>more <repo_name>",
]


def _import_checkout() -> None:
    """Make ``import ringserve.gpu...`` load this checkout. The repository's top level is the
    package (pyproject maps ringserve.gpu -> gpu/), so a bare sys.path entry cannot express it:
    a namespace module whose __path__ is the repository root does."""
    package = types.ModuleType("ringserve")
    package.__path__ = [str(REPO)]
    sys.modules["ringserve"] = package


def smollm_pieces(text: str) -> list[str]:
    """llama.cpp's first 'smollm' pre-tokenizer stage: every \\p{N} character is its own piece."""
    pieces, current = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [current, ch] if current else [ch]
            current = ""
        else:
            current += ch
    return pieces + ([current] if current else [])


def main() -> None:
    _import_checkout()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ringserve.gpu.loader.gguf_convert import convert_gguf
    from ringserve.gpu.loader.model_store import default_gguf_path

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = default_gguf_path()
        converted = convert_gguf(gguf, Path(tmp) / "model")
        kw = dict(dtype=torch.float32)
        from_gguf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **kw).eval()
        from_folder = AutoModelForCausalLM.from_pretrained(converted, **kw).eval()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

        a, b = from_gguf.state_dict(), from_folder.state_dict()
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
        for name in a:
            assert torch.equal(a[name], b[name]), f"weight {name} differs"
        for key in ("rope_parameters", "rms_norm_eps", "num_key_value_heads", "head_dim",
                    "tie_word_embeddings"):
            got = [getattr(m.config, key, None) for m in (from_gguf, from_folder)]
            print(f"config {key}: gguf {got[0]} converted {got[1]}", file=sys.stderr)

        chat_text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        texts = PROMPTS + [chat_text]
        prompt_ids = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
        last, every = [], []
        with torch.no_grad():
            for ids in prompt_ids:
                x = torch.tensor([ids])
                la, lb = from_gguf(x).logits[0], from_folder(x).logits[0]
                assert torch.equal(la, lb), f"logits differ by {(la - lb).abs().max().item()}"
                last.append(la[-1].numpy())
                every.append(la[:, ::COLUMN_STRIDE].numpy())
                following = tokenizer.decode([int(la[-1].argmax())])
                print(f"{len(ids)} tokens -> next {following!r}", file=sys.stderr)

        def ids(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        battery = [ids(s) for s in TOKENIZER_STRINGS]
        battery_smollm = [[i for piece in smollm_pieces(s) for i in ids(piece)] for s in TOKENIZER_STRINGS]

    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        OUT,
        prompt_texts=np.array(texts),
        chat_messages_user=np.array([CHAT[0]["content"]]),
        prompt_ids=np.concatenate([np.array(i, np.int32) for i in prompt_ids]),
        prompt_lens=np.array([len(i) for i in prompt_ids], np.int32),
        logits_last=np.stack(last).astype(np.float32),
        logits_every_position=np.concatenate(every).astype(np.float32),
        column_stride=np.array(COLUMN_STRIDE, np.int32),
        tokenizer_strings=np.array(TOKENIZER_STRINGS),
        tokenizer_ids=np.concatenate([np.array(i, np.int32) for i in battery]),
        tokenizer_lens=np.array([len(i) for i in battery], np.int32),
        tokenizer_ids_smollm=np.concatenate([np.array(i, np.int32) for i in battery_smollm]),
        tokenizer_lens_smollm=np.array([len(i) for i in battery_smollm], np.int32),
        versions=np.array([f"torch {torch.__version__}",
                           f"transformers {__import__('transformers').__version__}"]),
    )
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
