"""N-gram (prompt lookup) proposals: the tokens that followed the latest n-gram's earlier occurrence.

For a sequence t (prompt + output so far), find the longest n in [min, max] such that the last n
tokens occurred earlier in t, and propose the (up to K) tokens that followed that occurrence,
the earliest one (as vLLM's NgramProposer; an occurrence in the prompt is the one a copy-heavy
output follows). The search is numpy over the candidates only: every position whose token is t's
last one, narrowed one token further back at a time, so a step costs one vectorized compare
over the sequence plus a few over the survivors, never a Python loop over the history.
"""
from __future__ import annotations

import numpy as np

from ringserve.engine.request import Request
from ringserve.engine.speculative import SpeculativeConfig


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens (int32) that followed the earliest earlier occurrence of the longest suffix
    n-gram of `tokens` with min_n <= n <= max_n; empty when there is none."""
    length = len(tokens)
    if length < min_n + 1 or k <= 0:
        return tokens[:0]
    # ends[i]: a position e < length - 1 whose n-gram ending at e equals the suffix (n so far)
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    best = ends if min_n <= 1 else None
    for n in range(2, max_n + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if len(ends) == 0:
            break
        if n >= min_n:
            best = ends
    if best is None or len(best) == 0:
        return tokens[:0]
    start = int(best[0]) + 1
    return tokens[start:start + k]


class NgramProposer:
    """Draft tokens for a running request from its own prompt and output (engine/scheduler.py)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, req: Request, room: int) -> list[int]:
        """At most min(K, room) draft tokens to follow req's last token; cut where its grammar
        would refuse one (the rows after it could not be masked)."""
        k = min(self.k, room)
        if k <= 0:
            return []
        out = req.output_token_ids
        tokens = (np.concatenate((req.prompt_token_ids, np.asarray(out, np.int32))) if out
                  else req.prompt_token_ids)
        drafts = propose_ngram(tokens, self.min_n, self.max_n, k).tolist()
        if drafts and req.matcher is not None:
            drafts = drafts[:req.matcher.validate_tokens(drafts)]
        return drafts

    def prepare(self, sched) -> None:
        """The drafts are known since schedule time; each is a point mass (q one-hot)."""
        return None

    def accepted(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        pass
