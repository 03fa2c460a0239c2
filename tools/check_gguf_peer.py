"""Our reading of Llama 3.x and Qwen2 GGUFs against llama.cpp's own, on the same random-weight files.

    python -m ringserve.tools.check_gguf_peer --llama-server /path/to/llama-server
    python -m ringserve.tools.check_gguf_peer --llama-server ... --record tests/data/gguf_peer_tokens.json

For each family (tools/random_gguf.py --arch llama3 / qwen2, a small Q4_K_M file with a trained
byte-level BPE vocabulary) it
1. tokenizes a few hundred varied strings (random_gguf.sample_texts plus EDGE_CASES: digits,
   CJK, emoji, whitespace runs, contractions, code, special tokens) with llama-server's
   /tokenize and with our converted tokenizer.json, and counts the strings whose ids differ;
2. completes a few prompts greedily on llama-server (/completion, temperature 0, n_probs) and
   on `ringserve serve` (/v1/completions, temperature 0, logprobs): random weights give
   near-ties, so it reports how many leading tokens agree and the largest difference of the
   first step's top logprobs rather than comparing long texts.
`--record` writes the vocabulary's merges, the first strings and llama-server's ids for them
in each family: the test data tests/test_gguf_families.py checks our tokenizers against
without llama-server.
Never part of `make test` (it needs the llama-server build, docs/bench_quant.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

from ringserve.tools.bench_llamacpp import free_port, start, stop
from ringserve.tools.random_gguf import (
    LAYOUTS,
    Shape,
    bpe_vocabulary,
    merges_for,
    sample_texts,
    write_random_gguf,
)

# Small shapes of each family (a file is a few MB); head_dim 64 puts three of llama3's rotary
# pairs between its low and high frequency bounds.
SHAPES = {
    "llama3": Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=2048, context=2048,
                    rope_theta=500000.0),
    "qwen2": Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=2048, context=2048,
                   rope_theta=1000000.0, tied=True),
    # --arch gemma3 (not yet run: no llama-server build here): 7 layers, so layer 5 is full and
    # the others slide over a window of 32, shorter than the longer prompts
    "gemma3": Shape(hidden=256, layers=7, heads=4, kv_heads=1, ffn=512, vocab=2048, context=2048,
                    rope_theta=1000000.0, head_dim=64, sliding_window=32),
}
EDGE_CASES = [
    "", " ", "  ", "\n", " \n", "\n\n\n", "\t", "\r\n", "a\r\nb", "   leading", "trailing   ",
    "1", "12", "123", "1234", "12345678901", "3.14159", "1,000,000", "x1y22z333",
    "I'm", "I'M", "you'LL", "he'S", "they've", "don't", "o'clock", "''", "'s", "'", "'ll'",
    "日本語", "中文分词测试", "한국어", "😀", "👍🏽", "🇫🇷", "👨‍👩‍👧", "a😀b", "café", "naïve", "ﬁ",
    "Привет, мир!", "مرحبا", "हिन्दी", "\u00a0", "\u3000", "a\u00a0b", "a\u3000b",
    "def f(x):\n    return x ** 2\n", "if (a && b) { c++; }", "    four spaces", "tab\tseparated",
    "<|im_start|>user\nHi<|im_end|>", "<|begin_of_text|>Hello<|eot_id|>", "  \n  \n", "!!!???", "--- ...",
    "it'Sx", "WE'LLAMA", "I'DEA", "'ReAL", "x'VEry", "'Tis",   # a contraction before more letters
]
# The last prompt is long (~600 tokens): llama3's rope scaling slows only the slow rotary pairs,
# whose angles differ visibly only far into a sequence.
PROMPTS = ["The quick brown fox", "def main():\n    print(", "日本語のテキスト", "1, 2, 3, 4,",
           " ".join(sample_texts(40, seed=2))]


def whole_token_cases(merges: list[str]) -> list[str]:
    """Texts of the plain tokens that merging by rank does not rebuild from their own bytes
    (random_gguf.UNMERGED_WORDS among them): llama3's ignore_merges takes such a piece whole."""
    from tokenizers import models

    from ringserve.tools.tiny_gguf import byte_level_alphabet

    tokens, plain = bpe_vocabulary("llama3", SHAPES["llama3"].vocab, merges)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens[:plain])},
                     merges=[(a, b) for a, b in (m.split(" ") for m in merges)])
    byte_of = {c: b for b, c in enumerate(byte_level_alphabet())}
    out = []
    for token in tokens[256:plain]:
        if len(bpe.tokenize(token)) > 1:
            try:
                out.append(bytes(byte_of[c] for c in token).decode("utf-8"))
            except UnicodeDecodeError:
                continue
    return [text for word in out for text in (word, word + "!")]


def strings(n: int, merges: list[str]) -> list[str]:
    cases = EDGE_CASES + whole_token_cases(merges)
    return cases + sample_texts(n - len(cases), seed=1)


def llama_tokenize(url: str, text: str) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"content": text, "add_special": False}, timeout=60)
    r.raise_for_status()
    return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]


def check_family(arch: str, merges: list[str], args: argparse.Namespace, work: Path) -> dict:
    from ringserve.gpu.loader.model_store import resolve_model
    from ringserve.server.tokenizer import Tokenizer

    shape = SHAPES[arch]
    path = work / f"{arch}.gguf"
    write_random_gguf(path, shape, args.layout, seed=3, progress=False, arch=arch, merges=merges)
    ours = Tokenizer.from_dir(resolve_model(str(path)))
    texts = strings(args.strings, merges)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    peer = start([args.llama_server, "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
                  "-t", "2", "-c", "2048", "-np", "1", *args.llama_args.split()], url,
                 work / f"llama-{arch}.log", 120)
    try:
        theirs_ids = [llama_tokenize(url, t) for t in texts]
        prompts = [ours.encode(p) for p in PROMPTS]   # with the BOS our tokenizer adds (llama3)
        theirs_completions = []
        for ids in prompts:
            r = httpx.post(url + "/completion", json={
                "prompt": ids, "n_predict": args.tokens, "temperature": 0, "n_probs": args.top,
                "cache_prompt": False}, timeout=300)
            if r.status_code != 200:
                raise RuntimeError(f"llama-server /completion: {r.status_code} {r.text[:500]}")
            theirs_completions.append(r.json()["completion_probabilities"])
    finally:
        stop(peer)
    ours_ids = [ours.encode(t, add_special_tokens=False) for t in texts]
    mismatches = [(t, a, b) for t, a, b in zip(texts, ours_ids, theirs_ids, strict=True) if a != b]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start([sys.executable, "-m", "ringserve.tools.cli", "serve", "--model", str(path),
                    "--port", str(port), "--max-model-len", "1024", "--workers", "1",
                    *args.ringserve_args.split()], url,
                   work / f"ringserve-{arch}.log", 600)
    try:
        ours_completions = []
        for ids in prompts:
            r = httpx.post(url + "/v1/completions", json={
                "model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "prompt": ids,
                "max_tokens": args.tokens, "temperature": 0, "logprobs": args.top, "ignore_eos": True},
                timeout=300)
            if r.status_code != 200:
                raise RuntimeError(f"ringserve /v1/completions: {r.status_code} {r.text[:500]}")
            ours_completions.append(r.json()["choices"][0]["logprobs"])
    finally:
        stop(server)

    completions = []
    for prompt, theirs, mine in zip(PROMPTS, theirs_completions, ours_completions, strict=True):
        their_tokens = [step["token"] for step in theirs]
        agree = 0
        for a, b in zip(mine["tokens"], their_tokens, strict=False):
            if a != b:
                break
            agree += 1
        # every step both took the same path to: their top logprobs, token by token
        diffs, shared, first_shared = [], 0, 0
        for step in range(min(agree + 1, len(theirs), len(mine["top_logprobs"]))):
            top_theirs = {t["token"]: t["logprob"] for t in theirs[step]["top_logprobs"]}
            top_mine = mine["top_logprobs"][step]
            both = set(top_theirs) & set(top_mine)
            first_shared = first_shared or len(both)
            shared += len(both)
            diffs += [abs(top_theirs[t] - top_mine[t]) for t in both]
        completions.append({
            "prompt": prompt, "prompt_tokens": len(ours.encode(prompt)), "ours": mine["tokens"],
            "llama_server": their_tokens, "agree": agree, "first_top_shared": first_shared,
            "top_shared": shared, "top_max_abs_diff": max(diffs, default=None)})
    return {"arch": arch, "texts": texts, "llama_server_ids": theirs_ids,
            "tokenize_mismatches": mismatches, "completions": completions}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="the llama-server binary")
    p.add_argument("--arch", default="llama3,qwen2")
    p.add_argument("--layout", choices=LAYOUTS, default="q4_k_m", help="tools/random_gguf.py --layout")
    p.add_argument("--strings", type=int, default=400, help="how many strings to tokenize")
    p.add_argument("--tokens", type=int, default=4, help="greedy tokens per prompt")
    p.add_argument("--top", type=int, default=5, help="top logprobs compared")
    p.add_argument("--llama-args", default="", help="more llama-server flags (e.g. --no-repack)")
    p.add_argument("--ringserve-args", default="", help="more `ringserve serve` flags")
    p.add_argument("--record", type=Path, default=None,
                   help="write merges, the first --record-strings strings and llama-server's ids here")
    p.add_argument("--record-strings", type=int, default=120)
    args = p.parse_args(argv)
    results = {}
    merges = merges_for(SHAPES["llama3"].vocab)   # one vocabulary for both families (same size)
    with tempfile.TemporaryDirectory(prefix="check-gguf-peer.") as tmp:
        for arch in args.arch.split(","):
            r = results[arch] = check_family(arch, merges, args, Path(tmp))
            same = len(r["texts"]) - len(r["tokenize_mismatches"])
            print(f"== {arch}: tokenization {same}/{len(r['texts'])} "
                  f"strings give llama-server's ids")
            for text, a, b in r["tokenize_mismatches"][:10]:
                print(f"   differs: {text!r}\n     ours  {a}\n     llama {b}")
            for c in r["completions"]:
                print(f"   greedy, {c['prompt_tokens']}-token prompt {c['prompt'][:30]!r}: {c['agree']}/"
                      f"{len(c['ours'])} leading tokens agree (ours {c['ours']}, llama-server "
                      f"{c['llama_server']}); top-{args.top} logprobs of the steps that agree: "
                      f"{c['first_top_shared']} shared at the first, {c['top_shared']} in all, "
                      f"max |difference| {c['top_max_abs_diff']:.4f}")
    if args.record is not None:
        n = args.record_strings
        args.record.write_text(json.dumps({
            "merges": merges, "texts": strings(args.strings, merges)[:n],
            "llama_server_ids": {arch: r["llama_server_ids"][:n] for arch, r in results.items()}},
            ensure_ascii=False, separators=(",", ":")) + "\n")
    bad = sum(len(r["tokenize_mismatches"]) for r in results.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
