"""Logprob plumbing between the runner's arrays and the requests (gpu/sampling/sampler.py `Logprobs`
-> ipc/messages.py `PositionLogprobs`, the form the outputs carry).

prompt_logprobs: the runner scores the prompt tokens of the rows each prefill chunk computes
(vLLM V1 semantics; such a request does not read the prefix cache); each request collects
them as its chunks run, and they go out once, on its first output, from position 1 on."""
from __future__ import annotations

import numpy as np

from ringserve.engine.request import Request
from ringserve.engine.scheduler import SchedulerOutput
from ringserve.gpu.batch import Batch
from ringserve.gpu.sampling.prompt_logprobs import PromptLogprobsSpec
from ringserve.gpu.sampling.sampler import Logprobs
from ringserve.ipc.messages import PositionLogprobs

# (request, how many of the step's prompt-logprob rows are its own), in spec order
PromptLogprobsOwners = list[tuple[Request, int]]


def position_logprobs(lps: Logprobs | None, row: int, num_top: int) -> PositionLogprobs:
    """The sampled token's (id, logprob, rank), then the request's own top-N not already listed
    (lps: the step's, present whenever a request of the step asked for logprobs)."""
    assert lps is not None, "a request asked for logprobs the step did not compute"
    ids, vals = lps.token_ids[row].tolist(), lps.logprobs[row].tolist()
    sampled = ids[0]
    out: PositionLogprobs = [(sampled, vals[0], int(lps.sampled_rank[row]))]
    out += [(ids[rank], vals[rank], rank) for rank in range(1, num_top + 1) if ids[rank] != sampled]
    return out


def prompt_logprobs_spec(sched: SchedulerOutput, batch: Batch,
                         ) -> tuple[PromptLogprobsSpec | None, PromptLogprobsOwners]:
    """The rows of this step's batch whose logits score a prompt token: for a request that
    asked for prompt_logprobs, each computed position p < num_prompt - 1 not yet scored (p's
    logits predict prompt token p + 1). Also which request owns how many of them, in order."""
    rows, targets, owners = [], [], []
    for i, s in enumerate(sched.scheduled):
        req = s.request
        if req.params.prompt_logprobs is None or not req.needs_prompt_logprobs:
            continue
        # Positions before len(req.prompt_logprobs) were scored in an earlier step (or before
        # a preemption); the prefix cache is not read, so nothing between is skipped.
        first = max(s.num_computed_tokens, len(req.prompt_logprobs))
        end = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
        if first >= end:
            continue
        assert first == len(req.prompt_logprobs), "prompt positions computed but never scored"
        start = int(batch.query_start_loc[i]) - s.num_computed_tokens
        rows.append(np.arange(start + first, start + end, dtype=np.int64))
        targets.append(req.prompt_token_ids[first + 1:end + 1])
        owners.append((req, end - first))
    if not owners:
        return None, []
    num_top = max(req.params.prompt_logprobs or 0 for req, _ in owners)  # each asked: not None
    return PromptLogprobsSpec(np.concatenate(rows), np.concatenate(targets).astype(np.int32),
                              num_top), owners


def take_prompt_logprobs(owners: PromptLogprobsOwners, lps: Logprobs | None) -> None:
    """Hand each request its rows of the step's prompt logprobs (spec order)."""
    at = 0
    for req, count in owners:
        num_top = req.params.prompt_logprobs or 0  # an owner asked for them: not None
        req.prompt_logprobs.extend(position_logprobs(lps, j, num_top) for j in range(at, at + count))
        at += count
