"""What a load generator sends: an endless, seeded stream of RequestSpec.

- random:  prompts of exactly ``input_len`` token ids drawn uniformly from the vocabulary's
           ordinary (non-special) tokens, so that no prompt ends early or changes the template.
- prefix:  ``num_prefixes`` random prefixes of ``prefix_len`` tokens shared by the requests in
           turn, each followed by ``input_len`` random tokens (exercises the prefix cache).
- jsonl:   one JSON object a line: ``{"prompt": "text" | [ids], "output_len": n}`` (``max_tokens``
           is read too; without either, ``output_len`` applies); the file is cycled.
Every request asks for ``output_len`` tokens with ignore_eos, so outputs are as long as asked.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np


@dataclass
class RequestSpec:
    prompt: list[int] | str
    output_len: int

    @property
    def prompt_ids(self) -> list[int] | None:
        return self.prompt if isinstance(self.prompt, list) else None


def ordinary_token_ids(model_dir: str | Path) -> np.ndarray:
    """The vocabulary's ids minus its added/special tokens (from the folder's tokenizer.json)."""
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    ids = np.arange(tok.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    return np.setdiff1d(ids, np.fromiter(tok.get_added_tokens_decoder(), dtype=np.int64))


def random_requests(pool: np.ndarray, input_len: int, output_len: int,
                    rng: np.random.Generator) -> Iterator[RequestSpec]:
    while True:
        yield RequestSpec(rng.choice(pool, input_len).tolist(), output_len)


def prefix_requests(pool: np.ndarray, prefix_len: int, num_prefixes: int, input_len: int,
                    output_len: int, rng: np.random.Generator) -> Iterator[RequestSpec]:
    prefixes = [rng.choice(pool, prefix_len).tolist() for _ in range(num_prefixes)]
    for i in itertools.count():
        yield RequestSpec(prefixes[i % num_prefixes] + rng.choice(pool, input_len).tolist(),
                          output_len)


def read_jsonl(path: str | Path, output_len: int) -> list[RequestSpec]:
    specs = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt = obj["prompt"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{n}: expected a JSON object with a \"prompt\"") from None
        ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise ValueError(f"{path}:{n}: \"prompt\" must be a non-empty string or list of token ids")
        specs.append(RequestSpec(prompt, int(obj.get("output_len", obj.get("max_tokens", output_len)))))
    if not specs:
        raise ValueError(f"{path} holds no prompts")
    return specs


def jsonl_requests(specs: list[RequestSpec], rng: np.random.Generator) -> Iterator[RequestSpec]:
    """The file's prompts in a seeded order, reshuffled at each pass."""
    while True:
        for i in rng.permutation(len(specs)):
            yield specs[i]
