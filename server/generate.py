"""All the engine requests behind one HTTP request, turned into per-choice text deltas.

A completion with P prompts and `n` samples is P·n engine requests of n=1 each (as vLLM's
parallel sampling: sample j gets seed + j), so that a stop string found in one choice aborts
exactly that choice in the engine. Stop strings and detokenization live here, in the worker,
never in the engine.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from ringserve.ipc.limits import sample_seed
from ringserve.ipc.messages import Output
from ringserve.server.metrics import RequestMetrics
from ringserve.server.output_text import OutputText
from ringserve.server.protocol import UsageInfo


class EngineError(Exception):
    """The engine failed a request (or died while it ran)."""


class Engine(Protocol):
    """The worker's engine client (ringserve.server.engine_client.EngineClient)."""
    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     params: dict, trace: bool = False) -> AsyncIterator[Output]: ...
    def abort(self, request_id: str) -> None: ...


class Detokenizer(Protocol):
    def decode_stream(self, skip_special_tokens: bool = True): ...


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None                 # None: the first prompt token (nothing precedes it)
    top: list[tuple[int, float]] | None


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_token_ids: list[int]
    text: OutputText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With params["prompt_logprobs"]: per prompt token from the second on, once the first output came.
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    outputs: AsyncIterator[Output] | None = None  # the engine's stream, once submitted
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    engine_trace: bytes | None = None             # traced requests: the engine's journey (JSON)


@dataclass
class Delta:
    choice: Choice
    text: str
    logprobs: list[TokenLogprob]
    finished: bool


class Generation:
    def __init__(self, engine: Engine, tokenizer: Detokenizer, metrics: RequestMetrics,
                 request_id: str, prompts: list[list[int]], params: dict, n: int,
                 stop: list[str], include_stop: bool = False, skip_special_tokens: bool = True):
        self._engine = engine
        self._metrics = metrics
        self._params = params
        self.arrival = time.monotonic()
        self.choices: list[Choice] = []
        for p, prompt in enumerate(prompts):
            for j in range(n):
                idx = p * n + j
                text = OutputText(tokenizer.decode_stream(skip_special_tokens), stop,
                                  min_tokens=params.get("min_tokens", 0), include_stop=include_stop)
                self.choices.append(Choice(idx, f"{request_id}-{idx}", prompt, text))
        self._n = n
        # Set by the HTTP layer: is the client not taking what was sent, and cut its connection
        # (called when a choice's stream backlog is full; the engine requests are aborted first).
        self.client_blocked: Callable[[], bool] | None = None
        self.close_connection: Callable[[], None] | None = None
        self.trace = None  # a FrontendTrace (server/trace.py) when the request asked to be traced

    async def start(self) -> None:
        """Submit every choice to the engines (raises EngineUnavailable when none is up)."""
        for c in self.choices:
            params = self._params
            seed = params.get("seed")
            if seed is not None and self._n > 1:
                params = dict(params, seed=sample_seed(seed, c.index % self._n))
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

    async def deltas(self) -> AsyncIterator[Delta]:
        """Per-choice deltas as the engine produces tokens, until every choice has finished."""
        if len(self.choices) == 1:
            choice = self.choices[0]
            async for out in choice.outputs:
                if choice.finish_reason is not None:
                    return  # aborted meanwhile (client gone)
                delta = self._apply(choice, out)
                if delta is not None:
                    yield delta
                if choice.finish_reason is not None:
                    return
            return
        # Bounded: while the consumer is stuck (a client not reading), outputs stay in each
        # choice's stream, whose backlog limit then ends the request.
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(self.choices))

        async def pump(choice: Choice) -> None:
            try:
                async for out in choice.outputs:
                    await queue.put((choice, out))
                    if out.finish_reason is not None:
                        return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((choice, exc))

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
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
                c.finish_reason = "abort"
                if c.outputs is not None:
                    self._engine.abort(c.request_id)
                    self._observe(c)

    def _apply(self, choice: Choice, out: Output) -> Delta | None:
        if out.finish_reason == "error":
            raise EngineError(out.error or "the engine failed this request")
        if out.trace is not None:
            choice.engine_trace = out.trace
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = _token_logprobs(choice.prompt_token_ids[1:], out.prompt_logprobs)
        now = time.monotonic()
        if out.new_token_ids:
            if choice.first_token_at is None:
                choice.first_token_at = now
                self._metrics.ttft.observe(now - self.arrival)
            else:
                self._metrics.itl.observe(now - choice.last_token_at)
            choice.last_token_at = now
        before = choice.text.num_tokens
        text = choice.text.push(out.new_token_ids)
        kept = choice.text.num_tokens - before  # tokens after a stop string are dropped
        choice.token_ids.extend(out.new_token_ids[:kept])
        logprobs = (_token_logprobs(out.new_token_ids[:kept], out.logprobs)
                    if out.logprobs is not None else [])
        choice.logprobs.extend(logprobs)
        if choice.text.stop_string is not None:
            choice.finish_reason, choice.stop_reason = "stop", choice.text.stop_string
            if out.finish_reason is None:
                self._engine.abort(choice.request_id)
        elif out.finish_reason is not None:
            text += choice.text.flush()
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
        if choice.finish_reason is not None:
            self._observe(choice)
        elif not text and not logprobs:
            return None
        return Delta(choice, text, logprobs, choice.finish_reason is not None)

    @property
    def n(self) -> int:
        return self._n

    def usage(self) -> UsageInfo:
        """Tokens so far: each prompt once (its n choices share it), every choice's output."""
        prompt = sum(len(c.prompt_token_ids) for c in self.choices[::self._n])
        completion = sum(len(c.token_ids) for c in self.choices)
        return UsageInfo(prompt, completion, prompt + completion)

    def _observe(self, c: Choice) -> None:
        c.finished_at = time.monotonic()
        self._metrics.finished(c.finish_reason, len(c.prompt_token_ids), len(c.token_ids),
                               time.monotonic() - self.arrival)


def _token_logprobs(token_ids: list[int], positions: list[list[tuple[int, float, int]]],
                    ) -> list[TokenLogprob]:
    """Per token: its logprob (the position's first entry) and the alternatives, best first."""
    result = []
    for tid, entries in zip(token_ids, positions):
        top = sorted(((t, lp) for t, lp, _rank in entries), key=lambda e: -e[1])
        result.append(TokenLogprob(tid, entries[0][1], top))
    return result
