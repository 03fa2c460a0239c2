"""The scheduler: which requests run this step, and how many tokens each (docs/design.md §1.3-4).

One rule covers prefill, chunked prefill, decode and recompute after preemption: a request
needs num_tokens - num_computed_tokens more tokens in the cache, and each step schedules as
many of them as the budgets allow. Running requests go first, in admission order; waiting
requests are admitted first-come-first-served while both budgets (max_num_batched_tokens,
max_num_seqs) and the pool allow. When a running request needs a block and the pool is empty,
the newest running request is preempted: its blocks are freed and it goes back to the head of
`waiting`, to be recomputed (prompt and generated tokens) when there is room again.

With speculative decoding (engine/speculation.py), a decoding request also computes its draft
tokens: 1 + k tokens in the step, counted in the token budget, with KV slots for all of them;
the engine rolls num_computed_tokens back past the rejected ones after the step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec

from ringserve.engine.config import SchedulerConfig
from ringserve.engine.kv_cache import KVCacheManager
from ringserve.engine.request import Request, RequestStatus
from ringserve.engine.speculation import Speculation
from ringserve.ipc.messages import FinishReason


class ScheduledRequest(msgspec.Struct, gc=False):
    """One per scheduled request per step. A Struct without GC tracking: these are the most
    numerous objects a step makes, and tracked ones trigger collections that walk the heap."""
    request: Request
    num_computed_tokens: int     # tokens already in the cache before this step
    num_new_tokens: int          # tokens computed this step
    # This step computes the request's last token, so its logits give a new token: every
    # decode row, and the chunk that ends a prefill (a partial prefill chunk samples nothing).
    samples_token: bool
    # speculative decoding: the draft tokens computed after the last token (the last
    # len(draft_token_ids) of num_new_tokens); None: no drafts this step
    draft_token_ids: list[int] | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_draft_tokens: int = 0    # speculative decoding: draft tokens verified this step

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig):
        """config: its max_num_batched_tokens resolved (EngineConfig does it by device)."""
        self.kv = kv
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.token_budget
        self.long_prefill_token_threshold = config.long_prefill_token_threshold  # 0: no cap
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []     # admission order: the last one is the newest
        self.speculation: Speculation | None = None   # set by EngineCore with --speculative-config

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running requests, oldest first: a decode token each (and its drafts), or the next
        # prefill chunk.
        spec = self.speculation
        if spec is not None and not spec.enabled_for(len(self.running)):
            spec = None
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(len(req.all_token_ids) - req.num_computed_tokens, budget)
            drafts: list[int] = []
            if spec is not None and n == 1 and req.num_computed_tokens == len(req.all_token_ids) - 1:
                drafts = spec.propose(req, budget - 1)
            while not self.kv.allocate_slots(req, n, num_lookahead_tokens=len(drafts)):
                victim = self.running.pop()       # the newest; never one already scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break                             # it preempted itself: nothing after it remains
            self._add_scheduled(out, req, n, drafts)
            budget -= n + len(drafts)
            i += 1

        # 2. Waiting requests, first come first served, unless this step had to preempt.
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            n = self._chunk(req.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break                             # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            req.num_computed_tokens = num_hit_tokens
            if req.num_output_tokens == 0:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_scheduled(out, req, n)
            budget -= n
        return out

    def _chunk(self, needed: int, budget: int) -> int:
        """The tokens a request computes this step: what it needs, within the step's budget
        and, for a prompt chunk, long_prefill_token_threshold (vLLM's rule: a decode's one
        token is never capped)."""
        cap = self.long_prefill_token_threshold
        return min(needed, budget, cap) if 0 < cap < needed else min(needed, budget)

    def _add_scheduled(self, out: SchedulerOutput, req: Request, n: int,
                       drafts: list[int] | None = None) -> None:
        computed = req.num_computed_tokens
        done = computed + n == len(req.all_token_ids)
        if drafts:
            out.scheduled.append(ScheduledRequest(req, computed, n + len(drafts), done, drafts))
            out.num_draft_tokens += len(drafts)
        else:
            out.scheduled.append(ScheduledRequest(req, computed, n, done))
        # A decode step: one token, the last one, of a request already past its prompt.
        if n == 1 and done and computed >= len(req.prompt_token_ids):
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += n

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step ran: the scheduled tokens are now in the cache. A request's drafts are not
        counted yet: EngineCore.update counts those it accepts (the rest are rewritten later)."""
        for s in out.scheduled:
            n = s.num_new_tokens if s.draft_token_ids is None else s.num_new_tokens - len(s.draft_token_ids)
            s.request.num_computed_tokens = s.num_computed_tokens + n

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request (stop, length, abort): its blocks are free for the very next step."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
