"""Sampling parameters of one request, with vLLM's names, defaults and meaning.

Stop strings (stop, include_stop_str_in_output) are text: the frontends apply them while they
detokenize (server/output_processor.py, for the HTTP server and the offline LLM alike) and abort the
engine request when one appears; the engine core sees token ids only."""
from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.ipc import limits
from ringserve.ipc.structured import StructuredOutputsParams, to_grammar

# Below this temperature a request is sampled greedily (as vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5
# The sampling row carries top_k as a float32 (exact up to 2**24); no vocabulary comes near it,
# so a top_k this large is "off", as any top_k at or above the vocabulary size is.
TOP_K_OFF_FROM = 2**24


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0: off (-1 is taken and made 0; ipc/limits.py OFF VALUES)
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
    # Structured outputs: an llguidance grammar (what the frontend sends), or a
    # StructuredOutputsParams (json, regex, choice, grammar, json_object), made into one here.
    structured_outputs: str | StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if isinstance(self.structured_outputs, StructuredOutputsParams):
            self.structured_outputs = to_grammar(self.structured_outputs)  # GrammarError: a ValueError
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, str):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or an llguidance "
                             f"grammar string, got {type(self.structured_outputs).__name__}.")
        self._validate()
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.top_k == -1 or self.top_k >= TOP_K_OFF_FROM:
            self.top_k = 0
        if self.seed is not None:  # any int64 seed (vLLM's range); numpy wants a non-negative one
            self.seed = limits.generator_seed(self.seed)

    def _validate(self) -> None:
        """The ranges of ipc/limits.py (what the engine's dtypes can hold), then the relations
        between fields. The engine checks again what the frontend checked: a record from a ring
        is not trusted."""
        for name in (*limits.FLOATS, *limits.INTS):
            why = limits.why_not(name, getattr(self, name))
            if why is not None:
                raise ValueError(why + ".")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                limits.TOKEN_ID.why_not(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids in [0, {limits.INT32_MAX}].")
        if not all(isinstance(s, str) and s for s in self.stop or ()):  # a list by now
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_extras(self) -> bool:
        """Anything beyond plain sampling: penalties, min_tokens, logprobs or a structured output."""
        return (self.has_penalties or self.min_tokens > 0 or self.logprobs is not None
                or self.structured_outputs is not None)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
