"""What the request handlers of one worker share: tokenizer, engine client, model facts, metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringserve.server.config import StructuredOutputsConfig
from ringserve.server.generate import Engine
from ringserve.server.grammar_compiler import GrammarCompiler
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
    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # Compiles constraints in processes of this worker's own; made from the tokenizer (its
    # processes start on the first constrained request).
    grammars: GrammarCompiler = field(init=False)

    def __post_init__(self) -> None:
        eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        self.grammars = GrammarCompiler(self.tokenizer.to_json(), self.model_vocab_size, eos,
                                        self.structured)

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
