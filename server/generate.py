"""All the engine requests behind one HTTP request, turned into per-choice text deltas.

A completion with P prompts and `n` samples is P·n engine requests of n=1 each (as vLLM's
parallel sampling: sample j gets seed + j), so that a stop string found in one choice aborts
exactly that choice in the engine. Stop strings and detokenization happen here, in the worker,
never in the engine: each choice is a SampleState of the one output processor
(server/output_processor.py, which the offline LLM uses too); this module adds the streams,
the fan-out over choices, and the request's metrics.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol, cast

import msgspec

from ringserve.ipc.limits import sample_seed
from ringserve.ipc.messages import EngineOutput, FinishReason
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.server.errors import APIError, engine_error
from ringserve.server.metrics import RequestMetrics
from ringserve.server.output_processor import Detokenizer, SampleParams, SampleState, TokenLogprob
from ringserve.server.protocol import UsageInfo
from ringserve.server.trace import FrontendTrace

log = logging.getLogger("ringserve.server")


class EngineError(Exception):
    """The engine failed a request (or died while it ran)."""


def stream_error(exc: Exception, request_id: str) -> APIError:
    """The error that ends a stream already under way (its 200 is sent): the engine's failure
    as its 500, or a bug of ours (logged with its traceback) as an internal error."""
    if isinstance(exc, EngineError):
        return engine_error(exc)
    log.error("stream of request %s failed", request_id, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")


class OutputStream(Protocol):
    """One engine request's outputs (server/engine_client.py RequestStream)."""
    consumer_blocked: Callable[[], bool] | None   # is our client not taking what was sent
    on_backlog_full: Callable[[], None] | None    # called when too much waits unsent

    def __aiter__(self) -> AsyncIterator[EngineOutput]: ...


class Engine(Protocol):
    """The worker's engine client (ringserve.server.engine_client.EngineClient)."""
    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, trace: bool = False) -> OutputStream: ...
    def abort(self, request_id: str) -> None: ...


class Choice(SampleState):
    """One choice of the response: its sample (server/output_processor.py) and its engine stream."""

    def __init__(self, index: int, request_id: str, tokenizer: Detokenizer,
                 prompt_token_ids: list[int], params: SampleParams):
        super().__init__(tokenizer, prompt_token_ids, params)
        self.index = index
        self.request_id = request_id
        self.outputs: OutputStream | None = None   # the engine's stream, once submitted
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None


@dataclass
class Delta:
    choice: Choice
    text: str
    logprobs: list[TokenLogprob]
    finished: bool


class Generation:
    def __init__(self, engine: Engine, tokenizer: Detokenizer, metrics: RequestMetrics,
                 request_id: str, prompts: list[list[int]], params: SamplingParams, n: int,
                 skip_special_tokens: bool = True, discard_output: bool = False):
        """params: each engine request's (n=1: the n choices are n engine requests)."""
        self._engine = engine
        self._metrics = metrics
        self._params = params
        self.arrival = time.monotonic()
        sample = SampleParams(cast(list[str], params.stop), params.min_tokens,
                              params.include_stop_str_in_output, skip_special_tokens, discard_output)
        self.choices = [Choice(idx, f"{request_id}-{idx}", tokenizer, prompt, sample)
                        for idx, prompt in enumerate(p for p in prompts for _ in range(n))]
        self._n = n
        # Set by the HTTP layer: is the client not taking what was sent, and cut its connection
        # (called when a choice's stream backlog is full; the engine requests are aborted first).
        self.client_blocked: Callable[[], bool] | None = None
        self.close_connection: Callable[[], None] | None = None
        self.trace: FrontendTrace | None = None  # when the request asked to be traced
        self.tools: Any = None  # chat: its tool plan (server/tool_calls.py ToolPlan)
        self.reasoning: Any = None  # chat: its ReasoningFormat (server/reasoning.py), or None

    async def start(self) -> None:
        """Submit every choice to the engines (raises EngineUnavailable when none is up)."""
        for c in self.choices:
            params = self._params
            if params.seed is not None and self._n > 1:
                params = msgspec.structs.replace(params, seed=sample_seed(params.seed, c.index % self._n))
            try:
                c.outputs = await self._engine.submit(c.request_id, c.prompt_token_ids, params,
                                                      trace=self.trace is not None)
            except BaseException:
                self.abort()
                raise
            c.outputs.consumer_blocked = self.client_blocked
            c.outputs.on_backlog_full = self._client_not_reading

    def _client_not_reading(self) -> None:
        """One choice's outputs piled up unsent: end them all and cut the connection."""
        self.abort()
        if self.close_connection is not None:
            self.close_connection()

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def deltas(self) -> AsyncIterator[Delta]:
        """Per-choice deltas as the engine produces tokens, until every choice has finished."""
        return self._one_choice() if len(self.choices) == 1 else self._many_choices()

    async def _one_choice(self) -> AsyncIterator[Delta]:
        choice = self.choices[0]
        assert choice.outputs is not None, "start() first"
        async for out in choice.outputs:
            if choice.finish_reason is not None:
                return  # aborted meanwhile (client gone)
            delta = self._apply(choice, out)
            if delta is not None:
                yield delta
            if choice.finish_reason is not None:
                return

    async def _many_choices(self) -> AsyncIterator[Delta]:
        # Bounded: while the consumer is stuck (a client not reading), outputs stay in each
        # choice's stream, whose backlog limit then ends the request.
        queue: asyncio.Queue[tuple[Choice, EngineOutput | BaseException]] = asyncio.Queue(
            maxsize=len(self.choices))
        tasks = [asyncio.create_task(_pump(c, queue)) for c in self.choices]
        try:
            while not self.finished:
                choice, out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if choice.finish_reason is not None:
                    continue  # already ended by a stop string; late outputs are dropped
                delta = self._apply(choice, out)
                if delta is not None:
                    yield delta
        finally:
            for t in tasks:
                t.cancel()

    def abort(self) -> None:
        """Abort every engine request still running (client gone, or an error)."""
        for c in self.choices:
            if c.finish_reason is None:
                c.abort()
                if c.outputs is not None:
                    self._engine.abort(c.request_id)
                    self._observe(c)

    def _apply(self, choice: Choice, out: EngineOutput) -> Delta | None:
        if out.new_token_ids:
            now = time.monotonic()
            last = choice.last_token_at
            if last is None:
                choice.first_token_at = now
                self._metrics.ttft.observe(now - self.arrival)
            else:
                self._metrics.itl.observe(now - last)
            choice.last_token_at = now
        delta = choice.process(out)
        if delta is None:
            return None
        if choice.finish_reason is FinishReason.ERROR:
            raise EngineError(choice.error)
        if delta.abort_engine:
            self._engine.abort(choice.request_id)
        if delta.finished:
            self._observe(choice)
        return Delta(choice, delta.text, delta.logprobs, delta.finished)

    @property
    def n(self) -> int:
        return self._n

    def usage(self) -> UsageInfo:
        """Tokens so far: each prompt once (its n choices share it), every choice's output."""
        prompt = sum(len(c.prompt_token_ids) for c in self.choices[::self._n])
        completion = sum(len(c.token_ids) for c in self.choices)
        return UsageInfo(prompt, completion, prompt + completion)

    def _observe(self, c: Choice) -> None:
        """The choice has ended (its finish_reason is set): into the request metrics."""
        c.finished_at = time.monotonic()
        self._metrics.finished(str(c.finish_reason), len(c.prompt_token_ids), len(c.token_ids),
                               time.monotonic() - self.arrival)


async def _pump(choice: Choice, queue: asyncio.Queue) -> None:
    """One choice's engine outputs into the request's queue (an error as its item)."""
    assert choice.outputs is not None, "start() first"
    try:
        async for out in choice.outputs:
            await queue.put((choice, out))
            if out.finish_reason is not None:
                return
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - handed to the consumer
        await queue.put((choice, exc))
