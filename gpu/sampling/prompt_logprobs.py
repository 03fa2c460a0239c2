"""Logprobs at extra rows of the super-sequence: what prompt_logprobs needs from the runner.

A step normally yields logits only at each request's last scheduled token (Batch.logits_indices).
A PromptLogprobsSpec asks the runner for more rows: at row r (a token at position p of some
request) the logprob of token_ids[r] — the token at p + 1 — with its rank and the row's top-N.
The runner knows nothing of prompts; the engine picks the rows (engine/core.py).

Logits of many rows are [rows, vocab] floats (8192 rows of a 128k vocabulary: 4 GiB), so they
are made and reduced SLICE_ROWS rows at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ringserve.gpu.sampling.sampler import Logprobs, SamplerOutput, gather_logprobs

SLICE_ROWS = 256


@dataclass
class PromptLogprobsSpec:
    rows: np.ndarray        # int64 [P] rows of the super-sequence (indices into batch.input_ids)
    token_ids: np.ndarray   # int32 [P] the token to score at each row
    num_top: int            # the top-N tokens per row as well (0: only token_ids')

    def __len__(self) -> int:
        return len(self.rows)


def host_prompt_logprobs(logits_of: Callable[[np.ndarray], np.ndarray],
                         spec: PromptLogprobsSpec) -> Logprobs:
    """logits_of(rows) -> float32 logits [len(rows), V]; gpu/sampling/sampler.py's gather_logprobs per
    slice."""
    parts = [gather_logprobs(logits_of(spec.rows[s:s + SLICE_ROWS]),
                             spec.token_ids[s:s + SLICE_ROWS], spec.num_top)
             for s in range(0, len(spec), SLICE_ROWS)]
    return Logprobs(np.concatenate([p.token_ids for p in parts]),
                    np.concatenate([p.logprobs for p in parts]),
                    np.concatenate([p.sampled_rank for p in parts]))


class WithPromptLogprobs:
    """A step handle (result() -> SamplerOutput) whose output also carries the prompt logprobs,
    fetched by `fetch` once the step's tokens are taken (on CUDA: after the same stream)."""

    def __init__(self, step, fetch: Callable[[], Logprobs]):
        self._step = step
        self._fetch: Callable[[], Logprobs] | None = fetch

    def result(self) -> SamplerOutput:
        out = self._step.result()
        if self._fetch is not None:
            out.prompt_logprobs = self._fetch()
            self._fetch = None
        return out
