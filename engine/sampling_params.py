"""Sampling parameters of one request, with vLLM's names, defaults and meaning.

Stop strings (stop, include_stop_str_in_output) are text: the frontends apply them while they
detokenize (server/output_text.py, for the HTTP server and the offline LLM alike) and abort the
engine request when one appears; the engine core sees token ids only."""
from __future__ import annotations

from dataclasses import dataclass, field

# Below this temperature a request is sampled greedily (as vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16      # None: up to max_model_len
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None      # top-N logprobs per sampled token (plus the sampled one)
    prompt_logprobs: int | None = None   # top-N per prompt token (plus the prompt's own)
    stop: list[str] | str | None = None  # a str is one stop string
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be -1 (disable), 0 (disable) or a positive integer, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad(f"stop must be a list of non-empty strings, got {self.stop!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_extras(self) -> bool:
        """Anything beyond plain sampling: penalties, min_tokens or logprobs."""
        return self.has_penalties or self.min_tokens > 0 or self.logprobs is not None

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
