"""What a sampling parameter may be, judged by what the engine does with it (server/engine contract).

The engine carries temperature, top_p, min_p and the penalties as float32, top_k in a float32
sampling row then int32, token ids as int32, and seeds a numpy Generator with the seed. A value
that is fine as a Python number can still break there: top_p 1e-46 rounds to 0 in float32 (the
sampler then keeps no token), 1e308 becomes inf. These rules are written once, here, and applied
once, by ipc/sampling_params.py `SamplingParams.validate`: the frontend answers its refusal with
a 400 naming the field, and the engine refuses a ring record that breaks them (it trusts none).

OFF VALUES, one convention from the protocol to the kernels: a parameter that is off has the
value that makes its filter do nothing (top_k 0, top_p 1.0, min_p 0.0, presence/frequency
penalty 0.0, repetition_penalty 1.0, min_tokens 0), and an optional output that is not asked
for is None (logprobs, prompt_logprobs, seed, max_tokens: up to max_model_len). top_k alone has
a second spelling: OpenAI/vLLM clients send -1 or 0 for off (vLLM's old default was -1), and
SamplingParams makes -1 and any top_k of 2**24 or more 0 when it is built (the one place): the
wire, the engine and both samplers see 0.
"""
from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass
from typing import NamedTuple, cast

# The most bytes one logprob entry takes in an output as ipc/messages.py encodes it: a 3-array
# (1) of an int32 id (5), a float64 (9) and a rank (5), plus its position's list header (3). The
# frontend bounds an answer's entries (--max-response-logprobs) so that its outputs always fit
# one ring message.
MAX_LOGPROB_ENTRY_BYTES = 23
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38   # the largest finite float32
FLOAT32_TINY = 2.0**-126               # the smallest normal float32: below it, 0 or a subnormal
# (a GPU kernel may flush subnormals to zero, so they are refused like an underflow)
_F32 = struct.Struct("f")  # packing rounds to the nearest float32, and refuses what becomes inf


def show(value: object) -> str:
    """A value as an error message quotes it: cut when long (it may be anything a client sent)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:20] + f"... ({len(text)} characters)"


@dataclass(frozen=True)
class FloatRange:
    lo: float
    hi: float
    lo_open: bool = False   # lo itself is not allowed

    def why_not(self, value: object) -> str | None:
        """Why `value` cannot be used (None: it can)."""
        t = type(value)  # PERF: the exact types first; the ABC check only for others (numpy's)
        if t is not float and t is not int and (t is bool or not isinstance(value, numbers.Real)):
            return f"must be a number, got {show(value)}"
        real = cast(float, value)  # a number: checked just above (PERF: by its exact type)
        v = real if t is int else float(real)
        try:  # the value as the engine's float32 will hold it (rounded to nearest)
            x = v if abs(v) > FLOAT32_MAX * 2 else _F32.unpack(_F32.pack(v))[0]
        except OverflowError:  # rounds to inf
            x = math.inf
        if abs(x) > FLOAT32_MAX or math.isnan(x):  # (a huge int is not converted to float)
            return f"must be a finite float32 (at most {FLOAT32_MAX:.8g} in magnitude), got {show(value)}"
        if x == 0.0 and value != 0 or 0.0 < abs(x) < FLOAT32_TINY:
            return (f"underflows float32 (a nonzero value must be at least {FLOAT32_TINY:.8g} in "
                    f"magnitude), got {show(value)}")
        if x < self.lo or x > self.hi or (self.lo_open and x == self.lo):
            return f"must be in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}], got {show(value)}"
        return None


@dataclass(frozen=True)
class IntRange:
    lo: int
    hi: int

    def why_not(self, value: object) -> str | None:
        t = type(value)
        if t is not int and (t is bool or not isinstance(value, numbers.Integral)):
            return f"must be an integer, got {show(value)}"
        if not self.lo <= cast(int, value) <= self.hi:
            return f"must be in [{self.lo}, {self.hi}], got {show(value)}"
        return None


# Sampling parameters by their SamplingParams names. None is allowed wherever the field is optional.
FLOATS: dict[str, FloatRange] = {
    "temperature": FloatRange(0.0, FLOAT32_MAX),
    "top_p": FloatRange(0.0, 1.0, lo_open=True),
    "min_p": FloatRange(0.0, 1.0),
    "presence_penalty": FloatRange(-2.0, 2.0),
    "frequency_penalty": FloatRange(-2.0, 2.0),
    "repetition_penalty": FloatRange(0.0, FLOAT32_MAX, lo_open=True),
}
INTS: dict[str, IntRange] = {
    "n": IntRange(1, 1024),                    # sequences one request adds (the frontend sends 1)
    "top_k": IntRange(-1, INT32_MAX),          # 0: off (-1 accepted as off, see OFF VALUES)
    "seed": IntRange(INT64_MIN, INT64_MAX),    # vLLM's range; see generator_seed
    "max_tokens": IntRange(1, INT32_MAX),
    "min_tokens": IntRange(0, INT32_MAX),
    "logprobs": IntRange(0, INT32_MAX),
    "prompt_logprobs": IntRange(0, INT32_MAX),
}
RANGES: dict[str, FloatRange | IntRange] = {**FLOATS, **INTS}
TOKEN_ID = IntRange(0, INT32_MAX)             # and below the vocabulary size, which each side knows


def why_not(name: str, value: object) -> str | None:
    """Why sampling parameter `name` cannot be `value` (None: it can; None is always allowed,
    for the optional fields)."""
    if value is None:
        return None
    return RANGES[name].why_not(value)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a seeded request (seed + index, as vLLM), wrapped to stay
    in int64 so that it travels and is accepted like any seed."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


def generator_seed(seed: int) -> int:
    """The non-negative number a numpy Generator is seeded with for an int64 seed (its two's
    complement bits): seeds 0..2^63-1 seed as themselves, and -1 is a valid seed too."""
    return seed % 2**64


class ContextFit(NamedTuple):
    max_tokens: int             # resolved: None asked means up to the end of the context
    error: str | None           # why the request does not fit the context, or None
    field: str | None           # what is too long: "prompt" or "max_tokens"


def fit_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> ContextFit:
    """Does a prompt and its max_tokens fit max_model_len? The one context rule: the frontend
    answers 400 with the error, and the engine refuses a record that breaks it the same way.
    At least one token must be generated."""
    if num_prompt_tokens >= max_model_len:
        return ContextFit(0, f"This model's maximum context length is {max_model_len} tokens. "
                             f"However, your request has {num_prompt_tokens} input tokens. Please "
                             f"reduce the length of the input.", "prompt")
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return ContextFit(room, None, None)
    if max_tokens > room:
        return ContextFit(0, f"This model's maximum context length is {max_model_len} tokens. "
                             f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                             f"({num_prompt_tokens} in the input, {max_tokens} in the completion). "
                             f"Please reduce the length of the input or completion.", "max_tokens")
    return ContextFit(max_tokens, None, None)
