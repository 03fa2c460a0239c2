"""The engine's state for one sequence: its tokens, how many are in the KV cache, its status."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ringserve.ipc.messages import FinishReason, PositionLogprobs
from ringserve.ipc.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"     # back in `waiting`, to be recomputed from scratch
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence. A request with n > 1 samples is n of these (same request_id, index 0..n-1)."""

    request_id: str
    prompt_token_ids: np.ndarray                  # int32; a list is converted
    params: SamplingParams                        # max_tokens resolved (engine/request_checks.py)
    index: int = 0                                # which of the n samples
    eos_token_ids: tuple[int, ...] = ()
    generator: np.random.Generator | None = None  # seeded requests own one
    cache_salt: object = None                     # scopes prefix-cache sharing (n > 1, caching off)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0                  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of its full blocks (kv_cache)
    num_preemptions: int = 0
    num_cached_tokens: int = 0                    # prompt tokens found in the prefix cache
    # prompt_logprobs so far: entry p scores prompt token p + 1 (the first token has none).
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    # structured outputs: this sequence's llguidance matcher (engine/structured_outputs.py)
    matcher: Any = None

    def __post_init__(self) -> None:
        # An int32 array as it comes off the rings is kept as it is (no per-token Python object).
        self.prompt_token_ids = np.asarray(self.prompt_token_ids, np.int32)
        # prompt + output in one list: the scheduler works on token counts, not on phases.
        self.all_token_ids: list[int] = self.prompt_token_ids.tolist() + self.output_token_ids
        # Unique within the engine (the n samples of a request share its request_id).
        self.key: str = self.request_id if self.index == 0 else f"{self.request_id}#{self.index}"
        # Whether the request needs more of SamplingMetadata than its four plain columns: read
        # once here rather than every step (the params do not change).
        self.has_sampling_extras: bool = self.params.has_extras

    @property
    def max_tokens(self) -> int:
        """The most tokens to generate (params.max_tokens, never None in the engine)."""
        return cast(int, self.params.max_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt_logprobs (sample 0 scores the prompt for all n) and not all scored
        yet. Such a request does not read the prefix cache: a cached token is never computed,
        so its logits never exist (as vLLM)."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
