"""A traced request's journey (docs/design.md §1), assembled in the worker that served it.

A request asks with `"ringserve_trace": true` in its body or the header `X-Ringserve-Trace: 1`.
The worker notes arrival and tokenization, the engine client notes the engine it chose and every
engine's score, the engine records admission, blocks, slots, steps and the return of the blocks
(engine/trace.py), and the worker notes first token and finish. The journey goes out under the
`ringserve_trace` key: of the JSON body, or of one extra chunk just before `data: [DONE]`.
All times are milliseconds after the request arrived at the worker.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec

from ringserve.server.protocol import SYSTEM_FINGERPRINT
from ringserve.server.sse import DONE, event

TRACE_HEADER = "X-Ringserve-Trace"
TRACE_FIELD = "ringserve_trace"
_TIME_KEYS = {"at": "at_ms", "start": "start_ms", "end": "end_ms", "received": "received_ms"}


def wants_trace(body_flag: bool, header: str | None) -> bool:
    return body_flag or (header or "").strip().lower() in ("1", "true", "yes")


@dataclass
class FrontendTrace:
    request_id: str
    arrival: float            # time.monotonic() when the worker began reading the request
    arrival_unix: float
    tokenized: float          # when validation and tokenization were done

    def ms(self, t: float | None) -> float | None:
        return None if t is None else round((t - self.arrival) * 1e3, 3)

    def journey(self, gen) -> dict[str, Any]:
        """The whole journey of a finished Generation (server/generate.py)."""
        prompts = [c.prompt_token_ids for c in gen.choices[::gen.n]]
        return {
            "request_id": self.request_id,
            "arrival_unix": self.arrival_unix,
            "frontend": {"pid": os.getpid(), "arrival_ms": 0.0,
                         "tokenize_ms": self.ms(self.tokenized),
                         "prompt_token_ids": prompts[0] if len(prompts) == 1 else prompts,
                         "num_prompt_tokens": sum(map(len, prompts))},
            "choices": [self._choice(c) for c in gen.choices],
        }

    def _choice(self, c) -> dict[str, Any]:
        route = getattr(c.outputs, "route", None) or {}
        engine = msgspec.json.decode(c.engine_trace) if c.engine_trace is not None else None
        return {
            "index": c.index,
            "engine_request_id": c.request_id,
            "engine_client": {"engine": route.get("engine"), "scores": route.get("scores"),
                              "chosen_ms": self.ms(route.get("chosen_at")),
                              "written_ms": self.ms(route.get("written_at"))},
            # None when a stop string ended the choice: the worker aborted it in the engine,
            # and an aborted request's last output is not waited for.
            "engine": self._relative(engine) if engine is not None else None,
            "first_token_ms": self.ms(c.first_token_at),
            "last_token_ms": self.ms(c.last_token_at),
            "ttft_ms": self.ms(c.first_token_at),
            "e2e_ms": self.ms(c.finished_at),
            "finish_reason": c.finish_reason,
            "num_output_tokens": len(c.token_ids),
        }

    def _relative(self, obj):
        """The engine's monotonic seconds as milliseconds after arrival, recursively."""
        if isinstance(obj, dict):
            return {_TIME_KEYS.get(k, k): (self.ms(v) if k in _TIME_KEYS else self._relative(v))
                    for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._relative(v) for v in obj]
        return obj


def start_trace(request_id: str, arrival: float, arrival_unix: float) -> FrontendTrace:
    return FrontendTrace(request_id, arrival, arrival_unix, time.monotonic())


async def stream_with_trace(chunks: AsyncIterator[bytes], gen, trace: FrontendTrace,
                            obj: str, model: str) -> AsyncIterator[bytes]:
    """The SSE stream with one more chunk, carrying the journey, just before [DONE] (last, in a
    stream without one: the Responses API's)."""
    def journey() -> bytes:
        return event({"id": trace.request_id, "object": obj, "created": int(trace.arrival_unix),
                      "model": model, "choices": [], "system_fingerprint": SYSTEM_FINGERPRINT,
                      TRACE_FIELD: trace.journey(gen)})
    done = False
    async for chunk in chunks:
        if chunk == DONE:
            done = True
            yield journey()
        yield chunk
    if not done:
        yield journey()
