"""What the request handlers of one worker share: tokenizer, engine client, model facts, metrics."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringserve.server.generate import Engine
from ringserve.server.metrics import RequestMetrics


@dataclass
class ServerContext:
    tokenizer: Any                  # ringserve.server.tokenizer.Tokenizer
    engine: Engine                  # the worker's engine client
    served_model_names: list[str]
    max_model_len: int
    metrics: RequestMetrics

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (for logprobs)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
