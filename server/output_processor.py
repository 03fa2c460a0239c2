"""Engine outputs -> what one sample says: the one output processor, for the HTTP server
(server/generate.py) and the offline LLM (server/llm.py) alike, as vLLM's OutputProcessor
serves both LLM and AsyncLLM.

One `SampleState` per sample (an engine request and sample index). `process` takes each
EngineOutput of it in order and returns the delta to show: the text that may be sent now
(incremental detokenization, stop strings held back and cut: server/output_text.py), the
tokens and logprobs that go with it, and whether the sample ended. A stop string ends a sample
here, in the frontend, while the engine still runs it: the delta says so (`abort_engine`), and
the caller aborts that engine request. Tokens after the stop string are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ringserve.ipc.messages import EngineOutput, FinishReason, PositionLogprobs
from ringserve.server.output_text import OutputText


class Detokenizer(Protocol):
    def decode_stream(self, skip_special_tokens: bool = True): ...


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None                        # None: the first prompt token (nothing precedes it)
    rank: int | None = None                      # 1 = the most likely token
    # Every candidate the engine sent for this position, (token id, logprob, rank), best first:
    # the top-N and the token itself.
    top: list[tuple[int, float, int]] | None = None


@dataclass(slots=True)
class SampleDelta:
    text: str                                    # newly sendable text
    logprobs: list[TokenLogprob]                 # one per token behind that text
    finished: bool
    abort_engine: bool = False                   # a stop string ended it; the engine still runs it


@dataclass
class SampleParams:
    """What the output processor needs of a request's sampling parameters."""
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # echo with max_tokens 0: the engine's one sampled token is dropped and the sample ends
    # with "length" and no output (its prompt logprobs are kept)
    discard_output: bool = False


class SampleState:
    """One sample as it is produced: text, tokens, logprobs, how it ended."""

    def __init__(self, tokenizer: Detokenizer, prompt_token_ids: list[int], params: SampleParams):
        self.prompt_token_ids = prompt_token_ids
        self.discard_output = params.discard_output
        self.text = OutputText(tokenizer.decode_stream(params.skip_special_tokens), params.stop,
                               min_tokens=params.min_tokens,
                               include_stop=params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        # With prompt_logprobs: one entry per prompt token from the second on, once they came.
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None   # the stop token id or stop string that ended it
        self.error: str | None = None                # finish_reason ERROR: why
        self.num_cached_tokens = 0
        self.engine_trace: bytes | None = None       # traced requests: the engine's journey (JSON)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, out: EngineOutput) -> SampleDelta | None:
        """Apply one engine output; the delta to show, or None when there is nothing new.
        Outputs that come after the sample ended (a stop string, an abort) are ignored."""
        if self.finish_reason is not None:
            return None
        if out.finish_reason is FinishReason.ERROR:
            self.finish_reason = FinishReason.ERROR
            self.error = out.error or "the engine failed this request"
            return SampleDelta("", [], True)
        if out.trace is not None:
            self.engine_trace = out.trace
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = token_logprobs(self.prompt_token_ids[1:], out.prompt_logprobs)
        self.num_cached_tokens = out.num_cached_tokens
        if self.discard_output:
            if out.finish_reason is None:
                return None
            self.finish_reason = FinishReason.LENGTH
            return SampleDelta("", [], True, abort_engine=False)
        before = self.text.num_tokens
        text = self.text.push(out.new_token_ids)
        kept = out.new_token_ids[:self.text.num_tokens - before]  # none after a stop string
        self.token_ids += kept
        logprobs = token_logprobs(kept, out.logprobs) if out.logprobs is not None else []
        self.logprobs += logprobs
        abort_engine = False
        if self.text.stop_string is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP, self.text.stop_string
            abort_engine = out.finish_reason is None
        elif out.finish_reason is not None:
            text += self.text.flush()
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        elif not text and not logprobs:
            return None
        return SampleDelta(text, logprobs, self.finish_reason is not None, abort_engine)

    def abort(self) -> None:
        """The sample is given up (client gone, a sibling failed): it ends with ABORT."""
        if self.finish_reason is None:
            self.finish_reason = FinishReason.ABORT


def token_logprobs(token_ids: list[int], positions: list[PositionLogprobs]) -> list[TokenLogprob]:
    """Per token: its logprob and rank (the position's first entry) and every candidate, best first."""
    result = []
    for tid, entries in zip(token_ids, positions, strict=False):  # a stop string may cut the ids
        _, logprob, rank = entries[0]
        result.append(TokenLogprob(tid, logprob, rank, sorted(entries, key=lambda e: -e[1])))
    return result
