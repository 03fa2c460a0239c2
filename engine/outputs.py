"""What the engine core hands back after each step, per request and for the step as a whole."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int                        # 1 = the most likely token


# One sampled (or prompt) position: token id -> its logprob; the sampled token and the top-N.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one sample of a request in one step (index: which of its n samples)."""
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None        # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None          # the stop_token_id that ended it, if one did
    index: int = 0
    num_prompt_tokens: int = 0
    new_logprobs: list[PositionLogprobs] | None = None    # one per new token, when asked
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # once, first position None
    error: str | None = None                # the message when finish_reason == "error"
    num_cached_tokens: int = 0              # prompt tokens found in the prefix cache
    trace: bytes | None = None              # a traced request's journey (JSON), on its last output


@dataclass
class SchedulerStats:
    """One step, as /metrics wants it (counters are for this step; the reader sums them)."""
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0             # 0..1
    num_preemptions: int = 0
    prefix_cache_queries: int = 0           # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0              # of which found
    num_prefill_tokens: int = 0             # tokens scheduled as prompt (or recompute)
    num_decode_tokens: int = 0
    num_scheduled_reqs: int = 0
