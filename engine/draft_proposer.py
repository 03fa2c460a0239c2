"""Draft-model proposals: K autoregressive steps of a small model that shares the target's
vocabulary, batched over the speculating requests (docs/speculative.md).

The draft runs in the engine process on the target's backend (a second ModelRunner) with its
own KV cache, indexed by the target's block ids: the two caches mirror each other, so one
KVCacheManager (its block tables, prefix cache, preemption and frees) serves both and nothing
can drift apart. The rule that keeps them equal: every token whose K/V the target holds, the
draft holds at the same slot.

- catch-up forward, every step (speculating or not): the draft computes the same real tokens as
  the target (prefill chunks, each request's last token), so a block the prefix cache
  registers holds the draft's K/V too, and a preempted request is recomputed in both;
- draft steps j = 1..k-1: draft j-1's K/V written at its position. An accepted draft's K/V is
  then the draft's for that real token; a rejected one's is rewritten by the next catch-up
  (which starts at the first position the target rejected) before anything reads it;
- all k accepted: the last draft's K/V was never written (no forward took it as input), so
  the next catch-up starts one token earlier (`_lagging`; the entry stays until a catch-up
  finds the request past it, so a failed step run again starts as early again).

Each draft token is drawn from q, the draft's distribution under the request's own sampling
parameters as its verify row sees them (penalties over the output plus the drafts before it,
min_tokens bans, the grammar's mask after them); the target keeps or replaces it by rejection
sampling (gpu/sampling/sampler.py accept_or_resample), so the output follows the target.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ringserve.engine.inputs import batch_of
from ringserve.engine.kv_cache import KVCacheManager
from ringserve.engine.request import Request
from ringserve.engine.sampling_metadata import build_ahead_metadata
from ringserve.engine.speculative import SpeculativeConfig
from ringserve.engine.structured_outputs import StructuredOutputs
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.sampling.sampler import sample_draft
from ringserve.gpu.settings import StepLimits

if TYPE_CHECKING:
    from ringserve.engine.config import EngineConfig
    from ringserve.engine.scheduler import ScheduledRequest, SchedulerOutput


class DraftModelProposer:
    def __init__(self, runner, kv: KVCacheManager, k: int, structured: StructuredOutputs):
        """runner: the draft's ModelRunner, with as many blocks of the same size as the target's."""
        if runner.num_blocks != kv.num_blocks or runner.block_size != kv.block_size:
            raise ValueError("the draft model's KV cache must mirror the target's blocks")
        self.runner = runner
        self.kv = kv
        self.k = k
        self.structured = structured
        # request key -> (request, position): all its drafts were accepted, the last one's
        # draft K/V is not written yet
        self._lagging: dict[str, tuple[Request, int]] = {}

    def propose(self, req: Request, k: int) -> list[int]:
        return [0] * min(self.k, k)   # placeholders: prepare() runs the draft model

    def accepted(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        if num_drafts and num_accepted == num_drafts:
            self._lagging[req.key] = (req, req.num_computed_tokens - 1)

    def prepare(self, sched: SchedulerOutput) -> list[np.ndarray | None]:
        """The catch-up forward, then the draft steps; fills each scheduled request's drafts."""
        scheduled = sched.scheduled
        self._lagging = {key: v for key, v in self._lagging.items() if not v[0].is_finished}
        speculating = [i for i, s in enumerate(scheduled) if s.draft_token_ids]
        logits = self._catch_up(scheduled, speculating)
        probs: list[np.ndarray | None] = [None] * len(scheduled)
        ahead: dict[int, list[int]] = {i: [] for i in speculating}
        qs: dict[int, list] = {i: [] for i in speculating}
        active = speculating
        for j in range(self.k):
            if j:   # draft j - 1 in, its K/V written, draft j's logits out
                reqs = [scheduled[i].request for i in active]
                starts = np.fromiter((scheduled[i].num_computed_tokens + j for i in active), np.int32)
                ids = np.fromiter((ahead[i][-1] for i in active), np.int32)
                logits = self.runner.execute(batch_of(self.kv, reqs, starts, np.ones(len(active), np.int32),
                                                      ids))
            active = self._draw(sched, active, logits, ahead, qs)
            if not active:
                break
        for i in speculating:
            s = scheduled[i]
            s.draft_token_ids = ahead[i]
            if ahead[i] and qs[i][0] is not None:   # None: greedy, q is the argmax
                probs[i] = np.stack(qs[i])
        return probs

    def _catch_up(self, scheduled: list[ScheduledRequest], speculating: list[int]) -> np.ndarray:
        """The draft computes this step's real tokens (from a lagging one); logits at the last
        token of each speculating request."""
        reqs, starts, counts, ids = [], [], [], []
        for s in scheduled:
            req = s.request
            end = s.num_computed_tokens + s.num_new_tokens - len(s.draft_token_ids or ())
            start = s.num_computed_tokens
            # NOTE: kept, not popped, until a catch-up finds it stale: a step that fails after
            # this forward runs again (engine/core.py _recover) and must start as early again
            lag = self._lagging.get(req.key)
            if lag is not None and lag[1] == start - 1:
                start -= 1
            elif lag is not None:   # written by an earlier catch-up, or preempted since
                del self._lagging[req.key]
            reqs.append(req)
            starts.append(start)
            counts.append(end - start)
            ids.extend(req.all_token_ids[start:end])
        counts_a = np.asarray(counts, np.int32)
        batch = batch_of(self.kv, reqs, np.asarray(starts, np.int32), counts_a, np.asarray(ids, np.int32))
        # NOTE: one logits row at least (a step with nothing to draft only writes K/V)
        rows = batch.query_start_loc[1:][speculating or [0]] - 1
        return self.runner.execute(batch, rows)

    def _draw(self, sched: SchedulerOutput, active: list[int], logits: np.ndarray,
              ahead: dict[int, list[int]], qs: dict[int, list]) -> list[int]:
        """Draw the next draft of each active request from its logits row; the requests that
        draft again (not at their k, not after an eos or a complete grammar)."""
        scheduled = sched.scheduled
        reqs = [scheduled[i].request for i in active]
        after = [ahead[i] for i in active]
        mask, stopped = self.structured.bitmask_after(reqs, after)
        meta = build_ahead_metadata(reqs, after, None if mask is None else (lambda: mask))
        tokens, probs, failed = sample_draft(logits, meta)
        still = []
        for row, i in enumerate(active):
            s = scheduled[i]
            if stopped[row] or row in failed:   # no draft fits here: the drafts so far only
                _drop_drafts(sched, s, len(ahead[i]))
                continue
            token = int(tokens[row])
            ahead[i].append(token)
            qs[i].append(probs[row])
            k = len(s.draft_token_ids or ())
            if len(ahead[i]) < k and token in s.request.eos_token_ids:   # () with ignore_eos
                _drop_drafts(sched, s, len(ahead[i]))
            elif len(ahead[i]) < k:
                still.append(i)
        return still


def _drop_drafts(sched: SchedulerOutput, s: ScheduledRequest, keep: int) -> None:
    """Keep only the first `keep` of s's reserved drafts (their extra KV slots stay unused)."""
    drop = len(s.draft_token_ids or ()) - keep
    s.draft_token_ids = (s.draft_token_ids or [])[:keep]
    s.num_new_tokens -= drop
    sched.num_draft_tokens -= drop


def resolve_draft(spec: SpeculativeConfig, target: str | None, target_dir: Path | None,
                  target_config: ModelConfig) -> Path:
    """The draft model's folder (resolved as the target's model argument is), after the checks
    that it can draft for the target: its vocabulary, and a sliding window no wider than the
    target's; ValueError, one line naming both models, otherwise."""
    from ringserve.gpu.errors import ModelError
    from ringserve.gpu.loader.model_store import resolve_model

    assert spec.model is not None
    try:
        draft_dir = resolve_model(spec.model)
    except ModelError as e:
        raise ValueError(f"--speculative-config: the draft model: {e}") from None
    name = target or "the default model"
    draft_config = ModelConfig.from_dir(draft_dir)
    check_same_vocabulary(target_dir, draft_dir, target_config.vocab_size, draft_config.vocab_size, name,
                          spec.model)
    window = target_config.uniform_window
    if window and not 0 < draft_config.uniform_window <= window:   # 0: none, it reads the whole history
        raise ValueError(f"--speculative-config: the draft model {spec.model} reads keys before the "
                         f"target model {name}'s sliding window of {window}, whose blocks are freed "
                         f"(the two share block tables)")
    return draft_dir


def draft_limits(config: EngineConfig) -> StepLimits:
    """The draft runner's step limits: the target's, its "verify" steps of query length 2 (the
    catch-up: each request's last token, and the one before when its drafts were all accepted;
    on CUDA graphs of their own), its one-token draft steps decode steps."""
    return replace(config.step_limits, num_speculative_tokens=1)


def check_same_vocabulary(target_dir: Path | None, draft_dir: Path, target_vocab: int,
                          draft_vocab: int, target: str, draft: str) -> None:
    """Refuse, in one line naming both models, a draft whose tokens are not the target's."""
    why = None
    if target_vocab != draft_vocab:
        why = f"vocab_size {draft_vocab} against {target_vocab}"
    elif target_dir is not None:
        a, b = _vocabulary(target_dir), _vocabulary(draft_dir)
        if a is not None and b is not None and a != b:
            diff = sorted(set(a.items()) ^ set(b.items()))
            why = f"their tokenizers differ ({len(diff)} differing entries, e.g. {diff[0]!r})"
    if why is not None:
        raise ValueError(f"--speculative-config: the draft model {draft} does not share the target "
                         f"model {target}'s vocabulary: {why}")


def _vocabulary(model_dir: Path) -> dict[str, int] | None:
    """token -> id of a model folder's tokenizer.json (None: it has none)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab = dict(tok.get("model", {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens") or ()})
    return vocab
