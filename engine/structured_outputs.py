"""Structured outputs in the engine: one llguidance matcher per constrained sequence, one
bitmask per step (as vLLM V1's StructuredOutputManager with its guidance backend).

- add_request: each sample of a request with `SamplingParams.structured_outputs` (an llguidance
  grammar, ipc/structured.py) gets its own matcher (n > 1: copies of the first one's compiled
  grammar). A grammar that does not compile refuses the request ("error").
- execute: `bitmask` fills, for the step's sampled rows, one int32 word per 32 tokens: the
  allowed next tokens given the matcher's state (all ones for an unconstrained row). The
  sampler applies it to the logits before anything else (gpu/sampling/sampler.py).
- update: `advance` feeds the sampled token to the matcher; the sequence ends with "stop" once
  the grammar is complete (the matcher has stopped: it consumed EOS, or nothing may follow).

The matcher's state is the sequence's output so far and nothing else, so it survives
preemption (the output is recomputed, not resampled), chunked prefill (a partial chunk samples
no row, so it needs no mask) and ends with the sequence (abort, finish).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ringserve.engine.request import Request
from ringserve.ipc.messages import FinishReason
from ringserve.ipc.structured import compile_grammar, make_ll_tokenizer, tokenizer_json


class StructuredOutputs:
    """The engine's llguidance tokenizer (made on the first constrained request, ~0.2 s) and the
    step's bitmask."""

    def __init__(self, model_dir: Path | None, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._model_dir = model_dir
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: Any = None
        self._executor: Any = None
        self.words = (vocab_size + 31) // 32   # int32 words per bitmask row

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self._model_dir is None:
                raise ValueError("structured outputs need the model's tokenizer.json, and this "
                                 "engine was built without a model folder")
            self._tokenizer = make_ll_tokenizer(tokenizer_json(self._model_dir), self.vocab_size,
                                                self._eos)
        return self._tokenizer

    def matchers(self, grammar: str, n: int) -> list[Any]:
        """n matchers for `grammar` (one per sample). Raises ValueError when it does not compile
        (a ring record is not trusted: the frontend checked it too)."""
        # NOTE: compiled in the engine loop, like the rest of add_request; the frontend already
        # compiled it once, so a grammar that gets here is known to build (ms for usual schemas).
        first = compile_grammar(grammar, self._ll_tokenizer(), "structured_outputs grammar")
        return [first] + [first.deep_copy() for _ in range(n - 1)]

    def bitmask(self, reqs: list[Request]) -> np.ndarray | None:
        """int32 [len(reqs), words]: the allowed tokens of each constrained row (-1: all, for the
        rest); None when no row is constrained."""
        todo = [(r.matcher, i) for i, r in enumerate(reqs) if r.matcher is not None]
        if not todo:
            return None
        import llguidance.numpy as lln
        from llguidance import LLExecutor

        if self._executor is None:
            self._executor = LLExecutor()
        mask = np.full((len(reqs), self.words), -1, np.int32)
        # PERF: one call for every constrained row (llguidance spreads them over its threads)
        lln.fill_next_token_bitmask_par(self._executor, todo, mask)
        return mask


    def verify_bitmask(self, reqs: list[Request], drafts: list[list[int] | None]) -> np.ndarray | None:
        """Speculative decoding (engine/speculation.py): int32 [sum(1 + k), words], 1 + k rows
        per request, row j the allowed tokens after its first j drafts (the matcher walks its
        drafts and is rolled back; the scheduler kept only drafts the grammar accepts)."""
        sizes = [1 + len(d) if d else 1 for d in drafts]
        if not any(r.matcher is not None for r in reqs):
            return None
        import llguidance.numpy as lln

        mask = np.full((sum(sizes), self.words), -1, np.int32)
        row = 0
        for r, d, size in zip(reqs, drafts, sizes, strict=True):
            m = r.matcher
            if m is not None:
                lln.fill_next_token_bitmask(m, mask, row)
                taken = 0
                for token in d or ():
                    if not m.consume_token(token):  # validated when proposed: not expected
                        m.rollback(taken)
                        raise ValueError(f"draft token {token} breaks the grammar: {m.get_error()}")
                    taken += 1
                    if m.is_stopped():  # the grammar ends at this draft: no row after it is used
                        break
                    lln.fill_next_token_bitmask(m, mask, row + taken)
                if taken:
                    m.rollback(taken)
            row += size
        return mask

    def bitmask_after(self, reqs: list[Request], ahead: list[list[int]]
                      ) -> tuple[np.ndarray | None, list[bool]]:
        """A draft model's step (engine/draft_proposer.py): int32 [len(reqs), words], each
        constrained row's allowed tokens after its tokens `ahead` (its drafts so far, which
        the grammar accepted: they were drawn under it; the matcher walks them and is rolled
        back), and whether its grammar is complete after them (no draft may follow)."""
        stopped = [False] * len(reqs)
        if not any(r.matcher is not None for r in reqs):
            return None, stopped
        import llguidance.numpy as lln

        mask = np.full((len(reqs), self.words), -1, np.int32)
        for i, (r, a) in enumerate(zip(reqs, ahead, strict=True)):
            m = r.matcher
            if m is None:
                continue
            taken = 0
            for token in a:
                if not m.consume_token(token):
                    m.rollback(taken)
                    raise ValueError(f"draft token {token} breaks the grammar: {m.get_error()}")
                taken += 1
            stopped[i] = m.is_stopped()
            if not stopped[i]:
                lln.fill_next_token_bitmask(m, mask, i)
            if taken:
                m.rollback(taken)
        return mask, stopped


def advance(req: Request, token: int) -> FinishReason | None:
    """Feed the sampled token to req's matcher; STOP once the grammar is complete. Raises when
    the token breaks the grammar (only when the mask was not applied: a bug, or min_tokens
    banning the EOS that was the only way on)."""
    m = req.matcher
    if not m.consume_token(token):
        raise ValueError(f"token {token} does not follow the request's grammar: {m.get_error()}")
    return FinishReason.STOP if m.is_stopped() else None
