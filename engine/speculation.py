"""Speculative decoding in the engine (vLLM V1's design; docs/speculative.md).

- propose: one Proposer interface, two proposers. engine/ngram_proposer.py finds a decoding
  request's K drafts in its own prompt and output when the scheduler asks; engine/
  draft_proposer.py reserves K and fills them in before the step's forward, from K batched
  forwards of a draft model (with the distribution q each draft was drawn from).
- schedule (engine/scheduler.py): a decoding request computes 1 + k tokens in the step.
- execute (engine/inputs.py): logits at each of the 1 + k positions; each row is *sampled* from
  the target distribution as if its drafts before it were accepted (penalties, min_tokens bans
  and the grammar mask per position: engine/sampling_metadata.py, engine/structured_outputs.py).
- update (EngineCore.update): accept while the sampled token equals the draft; the first one
  that differs (or the token after the last draft) is emitted too. A draft model's rows were
  sampled by rejection sampling against its q (gpu/sampling/sampler.py accept_or_resample):
  the row's token is the draft when accepted, so the same compare takes it.

Why sampling every row is exact: an n-gram draft is a deterministic proposal (q one-hot at the
draft d), for which the rejection sampler accepts d with probability p(d) and otherwise draws
from normalize(max(p - q, 0)), p with d removed. Drawing x ~ p and accepting when x = d does
exactly that: P(accept) = p(d), and a rejected x is p conditioned on x != d. Greedy is the same
with argmax: accept while the target's argmax equals the draft. So the output follows the
target distribution, and greedy output is the one without speculation, token for token. A
seeded request draws one number per verified row, so its tokens are reproducible with the same
--speculative-config, not the same as without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ringserve.engine.ngram_proposer import NgramProposer
from ringserve.engine.request import Request
from ringserve.engine.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from ringserve.engine.scheduler import SchedulerOutput


class Proposer(Protocol):
    """Where draft tokens come from (n-gram lookup, a draft model)."""

    def propose(self, req: Request, k: int) -> list[int]:
        """At schedule time: at most k drafts for a decoding request, or k placeholders that
        prepare() fills in (the scheduler counts them in the budget and gives them KV slots)."""

    def prepare(self, sched: SchedulerOutput) -> list[np.ndarray | None] | None:
        """Before the step's forward: fill the scheduled drafts in (a proposer may drop some
        from the end); return each scheduled request's q [k][V] (the distributions its
        drafts were drawn from; None: greedy), or None for point-mass drafts (n-gram)."""

    def accepted(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """After the step: num_accepted of req's num_drafts drafts were taken."""


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters, summed since start (/metrics: vllm:spec_decode_*)."""
    num_drafts: int = 0                # requests that verified drafts, per step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None   # [K]: drafts accepted at each position
    num_off_steps: int = 0             # steps that did not speculate: too many running requests


class Speculation:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None):
        """proposer: the draft model's (engine/draft_proposer.py); None: n-gram lookup."""
        self.config = config
        self.proposer: Proposer = NgramProposer(config) if proposer is None else proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def enabled_for(self, num_running: int) -> bool:
        """Does a step with this many running requests speculate (vLLM's disable_by_batch_size)?"""
        if num_running <= self.config.disable_by_batch_size:
            return True
        self.stats.num_off_steps += 1
        return False

    def propose(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request: never more than max_tokens or max_model_len can
        take after the token the step samples anyway, nor more than the step's budget."""
        room = min(budget, req.max_tokens - len(req.output_token_ids) - 1,
                   self.max_model_len - len(req.all_token_ids) - 1)
        return self.proposer.propose(req, room) if room > 0 else []

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        self.proposer.accepted(req, num_drafts, num_accepted)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.accepted_per_pos
        assert per_pos is not None
        for i in range(num_accepted):
            per_pos[i] += 1
