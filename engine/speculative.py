"""--speculative-config: vLLM's JSON object for speculative decoding, checked in one line.

Only the n-gram (prompt lookup) method is served: {"method": "ngram", "num_speculative_tokens":
K, "prompt_lookup_max": N, "prompt_lookup_min": M} (vLLM's keys and defaults: one bound given
sets the other; neither: 5 and 1), plus vLLM's "disable_by_batch_size". A draft model
({"model": PATH}) is refused for now (docs/speculative.md).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# The most draft tokens per step: each one is a row of logits (vocab floats) and a KV slot; vLLM
# bounds nothing, but more than this never pays for an n-gram proposer (docs/speculative.md).
MAX_SPECULATIVE_TOKENS = 32
# The longest n-gram looked up (vLLM has no bound; a long one only costs compares).
MAX_PROMPT_LOOKUP = 64
# Speculate only in steps with at most this many running requests: a bigger batch already keeps
# the CPU's matmuls busy, and a verify row costs as much as a decoded one (measured:
# docs/speculative.md). vLLM's disable_by_batch_size.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8

_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str                       # "ngram"
    num_speculative_tokens: int       # K: the most draft tokens per request per step
    prompt_lookup_max: int            # the longest suffix n-gram matched
    prompt_lookup_min: int            # the shortest
    disable_by_batch_size: int        # no speculation in a step with more running requests


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """--speculative-config's JSON (or a dict, or a config); ValueError with one line naming
    the field that is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(_KEYS)})")
    if "model" in value:
        raise ValueError("--speculative-config: a draft model (\"model\") is not supported yet; "
                         "use {\"method\": \"ngram\", ...}")
    method = value.get("method")
    if method != "ngram":
        raise ValueError(f"--speculative-config: method must be \"ngram\", got {method!r}")
    k = _int(value, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    assert k is not None  # not optional: _int raised
    # vLLM's defaults: one bound given sets the other; neither: 5 and 1.
    lo = _int(value, "prompt_lookup_min", None, 1, MAX_PROMPT_LOOKUP, optional=True)
    hi = _int(value, "prompt_lookup_max", None, 1, MAX_PROMPT_LOOKUP, optional=True)
    if lo is None and hi is None:
        lo, hi = 1, 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    assert lo is not None and hi is not None
    if hi < lo:
        raise ValueError(f"--speculative-config: prompt_lookup_max ({hi}) must be at least "
                         f"prompt_lookup_min ({lo})")
    batch = _int(value, "disable_by_batch_size", None, 1, 1 << 20, optional=True)
    return SpeculativeConfig("ngram", k, hi, lo,
                             DEFAULT_DISABLE_BY_BATCH_SIZE if batch is None else batch)


def _int(value: dict[str, Any], key: str, default: int | None, lo: int, hi: int,
         optional: bool = False) -> int | None:
    v = value.get(key, default)
    if v is None:
        if optional:
            return None
        raise ValueError(f"--speculative-config: {key} is required")
    if isinstance(v, bool) or not isinstance(v, int):
        shown = "NaN" if isinstance(v, float) and math.isnan(v) else repr(v)
        raise ValueError(f"--speculative-config: {key} must be an integer, got {shown}")
    if not lo <= v <= hi:
        raise ValueError(f"--speculative-config: {key} must be in [{lo}, {hi}], got {v}")
    return v
