"""Sampling parameters of one request: one msgspec Struct from the frontend to the sampler, with
vLLM's names, defaults and meaning.

The HTTP layer builds it from the request body (server/protocol.py `sampling_params`), the
offline `LLM` takes it from its caller, and `AddRequest` carries it as it is (ipc/messages.py:
a msgpack map of the fields that are not at their default). Building one, by hand or by
decoding a ring record, runs `__post_init__`: the shorthand spellings become the one canonical
form (a str stop is a list, a StructuredOutputsParams an llguidance grammar, top_k's "off"
spellings 0), then `validate` checks every value, the only range check there is: the frontend
turns its SamplingParamsError into a 400 naming the request's field, and the engine answers a
ring record that fails it (it trusts none) with an "error" output for that request alone.

Stop strings (stop, include_stop_str_in_output) are text: the frontends apply them while they
detokenize (server/output_processor.py, for the HTTP server and the offline LLM alike) and abort
the engine request when one appears; the engine core sees token ids only. Whether a request is
greedy is the sampler's rule (gpu/sampling/sampler.py GREEDY_EPS), not a parameter.
"""
from __future__ import annotations

import msgspec

from ringserve.ipc import limits
from ringserve.ipc.structured import StructuredOutputsParams, to_grammar

# No vocabulary comes near 2**24, so a top_k this large is "off", as any top_k at or above the
# vocabulary size is: made 0, the one "off" the samplers see.
TOP_K_OFF_FROM = 2**24


class SamplingParamsError(ValueError):
    """A value SamplingParams cannot take: `field` is its name, `reason` what is wrong with it."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field} {reason}.")
        self.field = field
        self.reason = reason


# Structs hold no reference cycles: the garbage collector need not track them (cheaper).
class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True,
                     gc=False):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0: off (-1 is taken and made 0; ipc/limits.py OFF VALUES)
    min_p: float = 0.0
    seed: int | None = None          # any int64 (vLLM's range); sample i of n draws with seed + i
    max_tokens: int | None = 16      # None: up to max_model_len (the engine resolves it)
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None      # top-N logprobs per sampled token (plus the sampled one)
    prompt_logprobs: int | None = None   # top-N per prompt token (plus the prompt's own)
    stop: list[str] | str | None = []   # a str is one stop string, None none: a list once built
    include_stop_str_in_output: bool = False
    # Structured outputs: an llguidance grammar (what travels), or a StructuredOutputsParams
    # (json, regex, choice, grammar, json_object), made into one when built.
    structured_outputs: str | StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # The shorthands an offline caller may use (vLLM's), made the one form everyone reads.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif type(self.stop) is not list:  # a tuple or another sequence of strings
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.structured_outputs, StructuredOutputsParams):
            self.structured_outputs = to_grammar(self.structured_outputs)  # GrammarError: a ValueError
        self.validate()
        if self.stop_token_ids:  # numpy ints from an offline caller: plain ints travel and compare
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.top_k == -1 or self.top_k >= TOP_K_OFF_FROM:  # the one "off": 0
            self.top_k = 0

    def validate(self) -> None:
        """The one check of the values: the ranges of ipc/limits.py (what the engine's dtypes
        can hold), then the relations between fields. Raises SamplingParamsError."""
        for name, default in _RANGED_DEFAULTS:
            value = getattr(self, name)
            if value.__class__ is default.__class__ and value == default:
                continue  # PERF: a default is valid, and most fields are at theirs (~6x faster)
            why = limits.why_not(name, value)
            if why is not None:
                raise SamplingParamsError(name, why)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"must be at most max_tokens ({self.max_tokens}), "
                                                    f"got {self.min_tokens}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                limits.TOKEN_ID.why_not(t) for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids",
                                      f"must be a list of token ids in [0, {limits.INT32_MAX}]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError("stop", "must be a list of non-empty strings, got "
                                              f"{limits.show(self.stop)}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, str):
            raise SamplingParamsError("structured_outputs", "must be a StructuredOutputsParams or "
                                      f"an llguidance grammar string, got {type(so).__name__}")

    @property
    def has_extras(self) -> bool:
        """Anything beyond plain sampling: penalties, min_tokens, logprobs or a structured output."""
        return (self.has_penalties or self.min_tokens > 0 or self.logprobs is not None
                or self.structured_outputs is not None)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


# (name, default) of each field with a range in ipc/limits.py
_RANGED_DEFAULTS = tuple((f.name, f.default) for f in msgspec.structs.fields(SamplingParams)
                         if f.name in limits.RANGES)
