"""Perplexity of a model over a real text, by llama.cpp's `llama-perplexity` method, through the
offline API (server/llm.py `LLM` with `prompt_logprobs`): what a weight type or
`--cpu-activation-dtype` costs in quality.

    python -m ringserve.tools.perplexity --model M.gguf --cpu-activation-dtype auto float32
    ringserve perplexity --model M.gguf --ctx 512 --chunks 40

The method is llama-perplexity's default (tools/perplexity/perplexity.cpp `perplexity`), so that
its numbers are comparable on the same text and file: the whole text is tokenized once (with the
BOS the model's tokenizer adds, if any), cut into `len // ctx` windows of `ctx` tokens that do
not overlap; where the tokenizer adds a BOS, each window's first token is replaced by it; each
window runs alone from position 0, and only the second half of each window is scored: the
logits at positions ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1 (ctx - ctx/2 - 1 tokens a
window). Perplexity is exp of the mean negative log-likelihood, the ± its standard error, as
llama-perplexity prints them; the ratio against float32 has the ± of the per-token
differences. `--stride S` is its `--ppl-stride` mode instead: windows start every S tokens and
score their last S predictions (its decode gets the text's own tokens, no BOS).

The logprobs are `prompt_logprobs`: float32 log-softmax of each prompt row's float32 logits,
the prompt's own token read out (exact: tests/test_engine_core.py checks them against a dense
reference whatever the chunking). The engine also scores the first half of each window, which
the perplexity drops (about 10 % more work than needed).

The default text is the Python standard library's own documentation: every topic of
`pydoc_data.topics` (what `help("if")` prints), joined in name order; it ships with every
CPython, so it exists wherever ringserve installs (it changes between Python minor versions:
the table names the version). `--write-text FILE` saves it for `llama-perplexity -f FILE`.
"""
from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ringserve.gpu.settings import CPU_ACTIVATION_DTYPES


@dataclass(frozen=True)
class Window:
    """One forward of the evaluation: its prompt, and from which position its predictions count
    (the logits at position p predict token p + 1)."""
    token_ids: list[int]
    first: int

    @property
    def num_scored(self) -> int:
        return len(self.token_ids) - 1 - self.first


@dataclass
class Result:
    model: str
    activation_dtype: str
    logprobs: np.ndarray         # float64, of every scored token, window by window

    @property
    def num_scored(self) -> int:
        return len(self.logprobs)

    @property
    def perplexity(self) -> float:
        return math.exp(-float(np.mean(self.logprobs)))

    @property
    def stderr(self) -> float:
        """llama-perplexity's ±: the standard error of the mean NLL, times the perplexity."""
        nll = -self.logprobs
        return float(np.std(nll) / math.sqrt(max(len(nll) - 1, 1))) * self.perplexity


def default_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def text_name(path: str | None) -> str:
    return path or f"pydoc_data.topics (Python {platform.python_version()})"


def windows(token_ids: list[int], ctx: int, bos: int | None, stride: int | None = None,
            max_windows: int | None = None) -> list[Window]:
    """llama-perplexity's windows over the tokenized text (the module docstring); bos: the id
    to put first in each window, where the tokenizer adds one (not in stride mode)."""
    if ctx < 4:
        raise ValueError(f"--ctx must be at least 4, got {ctx}")
    if stride is not None and not 0 < stride < ctx:
        raise ValueError(f"--stride must be between 1 and ctx - 1 ({ctx - 1}), got {stride}")
    if len(token_ids) < 2 * ctx:
        raise ValueError(f"the text has {len(token_ids)} tokens; a context of {ctx} needs at least "
                         f"{2 * ctx} (llama-perplexity's rule)")
    if stride is None:
        starts = range(0, len(token_ids) // ctx * ctx, ctx)
        first = ctx // 2
    else:
        starts = range(0, len(token_ids) - ctx + 1, stride)
        first = ctx - stride - 1
    out = []
    for start in list(starts)[:max_windows]:
        ids = token_ids[start:start + ctx]
        if bos is not None and stride is None:
            ids = [bos, *ids[1:]]
        out.append(Window(ids, first))
    return out


def score(llm, wins: list[Window]) -> np.ndarray:
    """The logprob of every scored token of every window, in order: one request per window,
    all in one call (the engine batches them)."""
    from ringserve.server.llm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([w.token_ids for w in wins], params)
    scored: list[float] = []
    for w, out in zip(wins, outs, strict=True):
        entries = out.prompt_logprobs or []     # [None, then one per prompt token from the second]
        targets = w.token_ids[w.first + 1:]
        scored.extend(entries[w.first + 1 + i][t].logprob for i, t in enumerate(targets))
    return np.array(scored, dtype=np.float64)


def bos_to_add(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before a text (llama_vocab_get_add_bos), or None."""
    probe = "a"
    adds = len(tokenizer.encode(probe)) > len(tokenizer.encode(probe, add_special_tokens=False))
    return tokenizer.bos_token_id if adds else None


def evaluate(model: str | None, activation_dtype: str, text: str, ctx: int, stride: int | None = None,
             max_windows: int | None = None, **engine_args) -> Result:
    """One model at one activation dtype over `text` (engine_args: LLM's, e.g. cpu_threads)."""
    from ringserve.server.llm import LLM
    llm = LLM(model, cpu_activation_dtype=activation_dtype, **engine_args)
    ids = llm.tokenizer.encode(text)
    wins = windows(ids, ctx, bos_to_add(llm.tokenizer), stride, max_windows)
    return Result(Path(model or llm.config.model or "").name, activation_dtype, score(llm, wins))


def ratio(result: Result, base: Result) -> tuple[float, float]:
    """result's perplexity over base's on the same tokens, and its standard error from the
    per-token differences (paired: much tighter than either perplexity's own ±)."""
    if result.num_scored != base.num_scored:
        raise ValueError("the two results scored different tokens")
    diff = base.logprobs - result.logprobs       # per-token NLL difference
    value = math.exp(float(diff.mean()))
    return value, value * float(diff.std()) / math.sqrt(max(len(diff) - 1, 1))


def table(results: list[Result], text: str) -> str:
    """A Markdown table; `vs float32`: the perplexity over the same model's float32 one."""
    lines = [f"text: {text}", "",
             "| model | activations | tokens scored | perplexity | vs float32 |",
             "|---|---|---|---|---|"]
    for r in results:
        base = next((b for b in results if b.model == r.model and b.activation_dtype == "float32"), None)
        vs = "-" if base is None else "{:.4f} ± {:.4f}".format(*ratio(r, base))
        lines.append(f"| {r.model} | {r.activation_dtype} | {r.num_scored} | "
                     f"{r.perplexity:.4f} ± {r.stderr:.4f} | {vs} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=None,
                   help="a known name, an HF folder or a .gguf (repeat it for several; default: "
                        "the default model)")
    p.add_argument("--cpu-activation-dtype", nargs="+", default=["auto", "float32"],
                   choices=CPU_ACTIVATION_DTYPES, help="one row each (default: auto float32)")
    p.add_argument("--text", default=None,
                   help="a UTF-8 text file (default: the standard library's pydoc topics)")
    p.add_argument("--write-text", default=None, metavar="FILE",
                   help="also write the text to FILE (for llama-perplexity -f FILE)")
    p.add_argument("--ctx", type=int, default=512, help="tokens a window (llama-perplexity -c)")
    p.add_argument("--stride", type=int, default=None,
                   help="overlapping windows every STRIDE tokens (llama-perplexity --ppl-stride)")
    p.add_argument("--chunks", type=int, default=None,
                   help="score only the first CHUNKS windows (llama-perplexity --chunks)")
    p.add_argument("--cpu-threads", type=int, default=None, help="as `ringserve serve`'s")


def command(args: argparse.Namespace) -> int:
    text = Path(args.text).read_text(encoding="utf-8") if args.text else default_text()
    if args.write_text:
        Path(args.write_text).write_text(text, encoding="utf-8")
    results = []
    try:
        for model in args.model or [None]:
            for dtype in args.cpu_activation_dtype:
                start = time.perf_counter()
                r = evaluate(model, dtype, text, args.ctx, args.stride, args.chunks, device="cpu",
                             cpu_threads=args.cpu_threads)
                print(f"{r.model} {dtype}: perplexity {r.perplexity:.4f} over {r.num_scored} tokens "
                      f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
                results.append(r)
    except ValueError as e:                      # a bad argument, text or model setting: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(results, text_name(args.text)))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringserve.tools.perplexity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
