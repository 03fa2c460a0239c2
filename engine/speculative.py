"""--speculative-config: vLLM's JSON object for speculative decoding, checked in one line.

Two methods, as vLLM spells them: n-gram (prompt lookup), {"method": "ngram",
"num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M} (vLLM's defaults:
one bound given sets the other; neither: 5 and 1), and a draft model, {"model": PATH_OR_ID,
"num_speculative_tokens": K} ("method": "draft_model" optional; the model as the target's model
argument takes it). Both take vLLM's "disable_by_batch_size" (docs/speculative.md).
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

METHODS = ("ngram", "draft_model")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str                       # "ngram" or "draft_model"
    num_speculative_tokens: int       # K: the most draft tokens per request per step
    prompt_lookup_max: int            # the longest suffix n-gram matched
    prompt_lookup_min: int            # the shortest
    disable_by_batch_size: int        # no speculation in a step with more running requests
    model: str | None = None          # draft_model: the draft (a folder, a GGUF or a hub id)


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
    # vLLM: a "model" without a method is a draft model
    method = value.get("method", "draft_model" if "model" in value else None)
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method must be one of "
                         f"{', '.join(map(repr, METHODS))}, got {method!r}")
    k = _int(value, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    assert k is not None  # not optional: _int raised
    batch = _int(value, "disable_by_batch_size", None, 1, 1 << 20, optional=True)
    batch = DEFAULT_DISABLE_BY_BATCH_SIZE if batch is None else batch
    if method == "draft_model":
        return _draft_model(value, k, batch)
    return _ngram(value, k, batch)


def _ngram(value: dict[str, Any], k: int, batch: int) -> SpeculativeConfig:
    if "model" in value:
        raise ValueError("--speculative-config: \"model\" is a draft model's; method \"ngram\" "
                         "takes none")
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
    return SpeculativeConfig("ngram", k, hi, lo, batch)


def _draft_model(value: dict[str, Any], k: int, batch: int) -> SpeculativeConfig:
    model = value.get("model")
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"--speculative-config: model must be the draft model's path or id "
                         f"(a non-empty string), got {model!r}")
    lookup = sorted(key for key in value if key.startswith("prompt_lookup"))
    if lookup:
        raise ValueError(f"--speculative-config: {', '.join(lookup)} is the ngram method's; "
                         f"a draft model takes none")
    return SpeculativeConfig("draft_model", k, 0, 0, batch, model)


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
