"""One step's SamplingMetadata (gpu/sampling/sampler.py) from the requests it samples, in row order."""
from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np

from ringserve.engine.request import Request
from ringserve.gpu.sampling.sampler import SamplingMetadata


def build_sampling_metadata(reqs: list[Request],
                            bitmask: Callable[[list[Request]], np.ndarray | None] | None = None
                            ) -> SamplingMetadata:
    """Per row: temperature, top_k (0: off), top_p, min_p and the generator; penalties,
    banned ids (min_tokens), the top-N logprobs and the structured-output token bitmask (made
    by `bitmask`, engine/structured_outputs.py) only when some request asks."""
    ps = [r.params for r in reqs]  # read as they are: one column per parameter
    meta = SamplingMetadata(temperature=np.array([p.temperature for p in ps], np.float32),
                            top_k=np.array([p.top_k for p in ps], np.int32),
                            top_p=np.array([p.top_p for p in ps], np.float32),
                            min_p=np.array([p.min_p for p in ps], np.float32),
                            generators=[r.generator for r in reqs])
    special = [r for r in reqs if r.has_sampling_extras]
    if not special:                                   # the common case: nothing more to do
        return meta
    if any(r.params.has_penalties for r in special):
        meta.presence_penalty = np.array([p.presence_penalty for p in ps], np.float32)
        meta.frequency_penalty = np.array([p.frequency_penalty for p in ps], np.float32)
        meta.repetition_penalty = np.array([p.repetition_penalty for p in ps], np.float32)
        meta.prompt_token_ids = [r.prompt_token_ids for r in reqs]
        meta.output_token_ids = [r.output_token_ids for r in reqs]
    if any(r.num_output_tokens < r.params.min_tokens for r in special):
        meta.banned_token_ids = [
            list(r.eos_token_ids) + r.params.stop_token_ids
            if r.num_output_tokens < r.params.min_tokens else () for r in reqs]
    wanted = [r.params.logprobs for r in special if r.params.logprobs is not None]
    meta.max_num_logprobs = max(wanted) if wanted else None
    if bitmask is not None and any(r.matcher is not None for r in special):
        # computed by the sampler when it samples: on CUDA, while the forward runs
        meta.allowed_token_bitmask = partial(bitmask, reqs)
    return meta


def build_verify_metadata(reqs: list[Request], drafts: list[list[int] | None],
                          bitmask: Callable[[list[Request], list[list[int] | None]], np.ndarray | None],
                          draft_probs: list[np.ndarray | None] | None = None) -> SamplingMetadata:
    """Speculative decoding: 1 + k rows per request (k = len of its drafts), row j sampled as
    the request's next token after its first j drafts: the columns repeated, and what depends
    on the output so far (penalties, min_tokens bans, the grammar's mask) taken j drafts on.
    A seeded request's generator draws once per row, in order (engine/speculation.py).
    draft_probs: a draft model's q per request ([k, V] float64; None: greedy or n-gram), so
    that row j < k verifies draft j by rejection sampling (gpu/sampling/sampler.py)."""
    sizes = [1 + len(d) if d else 1 for d in drafts]
    rows = [r for r, size in zip(reqs, sizes, strict=True) for _ in range(size)]
    # the draft prefix each row assumes accepted
    ahead = [d[:j] if d else [] for d, size in zip(drafts, sizes, strict=True) for j in range(size)]
    meta = build_ahead_metadata(rows, ahead)
    if any(r.matcher is not None for r in reqs):
        meta.allowed_token_bitmask = partial(bitmask, reqs, drafts)
    if draft_probs is not None and any(q is not None for q in draft_probs):
        meta.draft_token_ids = [t for d in drafts for t in (*(d or ()), -1)]
        meta.draft_probs = [None if q is None or j == len(q) else q[j]
                            for q, size in zip(draft_probs, sizes, strict=True) for j in range(size)]
    return meta


def build_ahead_metadata(rows: list[Request], ahead: list[list[int]],
                         bitmask: Callable[[], np.ndarray | None] | None = None) -> SamplingMetadata:
    """Rows sampled as their request's next token after the tokens `ahead` (drafts taken as
    accepted): penalties see them in the output, min_tokens bans count them. bitmask: the
    rows' grammar masks after them (engine/structured_outputs.py), when a row is constrained."""
    meta = build_sampling_metadata(rows)
    if meta.output_token_ids is not None:
        meta.output_token_ids = [r.output_token_ids + a if a else r.output_token_ids
                                 for r, a in zip(rows, ahead, strict=True)]
    if meta.banned_token_ids is not None:
        meta.banned_token_ids = [
            list(r.eos_token_ids) + r.params.stop_token_ids
            if r.num_output_tokens + len(a) < r.params.min_tokens else ()
            for r, a in zip(rows, ahead, strict=True)]
    if bitmask is not None and any(r.matcher is not None for r in rows):
        meta.allowed_token_bitmask = bitmask
    return meta
