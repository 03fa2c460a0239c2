"""What the request handlers of one worker share: tokenizer, engine client, model facts, metrics."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from ringserve.server.config import RequestLimits, StructuredOutputsConfig
from ringserve.server.errors import bad_request
from ringserve.server.generate import Engine
from ringserve.server.grammar_compiler import GrammarCompiler
from ringserve.server.metrics import RequestMetrics

# Work on more than this many bytes of client text (tokenizing, rendering) runs in a thread:
# ~10 ms at most on the loop, and no thread hop for the usual small request.
OFF_LOOP_BYTES = 1 << 14
T = TypeVar("T")


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the event loop for a small input, in a thread for a large one: a large
    prompt's tokenizing (1-3 s for 1 MB, without the GIL: tokenizer.py) must not stall the
    worker's other streams and /health."""
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


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
    # --generation-config: sampling fields a request inherits when it leaves them out
    default_sampling: dict[str, Any] = field(default_factory=dict)
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

    async def encode_prompt(self, text: str, add_special_tokens: bool, *, param: str) -> list[int]:
        """A prompt's token ids, a long one tokenized off the loop; a prompt whose UTF-8 length
        alone proves it longer than the context is a 400 before any tokenizing (a 1 MB prompt
        costs 1-3 s to tokenize)."""
        least = self.tokenizer.min_tokens(text)
        if least >= self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. "
                              f"However, your request has at least {least} input tokens (one "
                              f"token is at most {self.tokenizer.token_bytes.most} bytes of "
                              f"text). Please reduce the length of the input.", param=param,
                              code="context_length_exceeded")
        return await off_loop(len(text), self.tokenizer.encode, text, add_special_tokens)
