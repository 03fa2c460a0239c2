"""Speculative decoding in the engine (vLLM V1's design, n-gram drafts; docs/speculative.md).

- schedule (engine/scheduler.py): a decoding request gets up to K draft tokens from its own
  prompt and output (engine/ngram_proposer.py) and computes 1 + k tokens in the step.
- execute (engine/inputs.py): logits at each of the 1 + k positions; each row is *sampled* from
  the target distribution as if its drafts before it were accepted (penalties, min_tokens bans
  and the grammar mask per position: engine/sampling_metadata.py, engine/structured_outputs.py).
- update (EngineCore.update): accept while the sampled token equals the draft; the first one
  that differs (or the token after the last draft) is emitted too.

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

from ringserve.engine.ngram_proposer import NgramProposer
from ringserve.engine.request import Request
from ringserve.engine.speculative import SpeculativeConfig


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters, summed since start (/metrics: vllm:spec_decode_*)."""
    num_drafts: int = 0                # requests that verified drafts, per step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None   # [K]: drafts accepted at each position
    num_off_steps: int = 0             # steps that did not speculate: too many running requests


class Speculation:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.proposer = NgramProposer(config)
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
        take after the token the step samples anyway, nor more than the step's budget; cut
        where its grammar would refuse one (the rows after it could not be masked)."""
        room = min(budget, req.max_tokens - len(req.output_token_ids) - 1,
                   self.max_model_len - len(req.all_token_ids) - 1)
        if room <= 0:
            return []
        drafts = self.proposer.propose(req, room)
        if drafts and req.matcher is not None:
            drafts = drafts[:req.matcher.validate_tokens(drafts)]
        return drafts

    def record(self, num_drafts: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.accepted_per_pos
        assert per_pos is not None
        for i in range(num_accepted):
            per_pos[i] += 1
