"""What the request handlers of one worker share: tokenizer, engine client, model facts, metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringserve.server.errors import bad_request
from ringserve.server.generate import Engine
from ringserve.server.metrics import RequestMetrics
from ringserve.server.protocol import RequestLimits


@dataclass
class ServerContext:
    tokenizer: Any                  # ringserve.server.tokenizer.Tokenizer
    engine: Engine                  # the worker's engine client
    served_model_names: list[str]
    max_model_len: int
    metrics: RequestMetrics
    limits: RequestLimits = field(default_factory=RequestLimits)
    model_vocab_size: int | None = None  # the model's (config.json); None: the tokenizer's
    tool_call_parser: str | None = None  # --tool-call-parser: "auto" tool choice (tool_calls.py)
    reasoning_parser: str | None = None  # --reasoning-parser (reasoning.py)

    @property
    def vocab_size(self) -> int:
        """Token ids below this are valid for both the tokenizer and the model."""
        tok = self.tokenizer.vocab_size
        return tok if self.model_vocab_size is None else min(tok, self.model_vocab_size)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (for logprobs)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def encode_prompt(self, text: str, add_special_tokens: bool, *, param: str) -> list[int]:
        """A prompt's token ids; a prompt whose UTF-8 length alone proves it longer than the
        context is a 400 before any tokenizing (a 1 MB prompt costs 1-3 s to tokenize)."""
        least = self.tokenizer.min_tokens(text)
        if least >= self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. "
                              f"However, your request has at least {least} input tokens (one "
                              f"token is at most {self.tokenizer.token_bytes.most} bytes of "
                              f"text). Please reduce the length of the input.", param=param,
                              code="context_length_exceeded")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
