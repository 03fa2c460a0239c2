"""What one request measured, and the numbers a run reports (the definitions of vLLM's
`bench serve`, so that results can be read side by side with its output):

- TTFT: from sending the request to the first output chunk that carries tokens.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests of one output token have none.
- ITL: every gap between two consecutive output chunks, all requests pooled.
- E2E: from sending the request to its last output.
- Goodput: completed requests per second that met every given SLO (ms). A request with one
  output token counts as TPOT 0 there.
Percentiles are numpy's linear interpolation; means and percentiles of nothing are None.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0               # tokens generated (as counted by the server when it says)
    ttft: float = 0.0                 # seconds
    itl: list[float] = field(default_factory=list)  # seconds between consecutive output chunks
    latency: float = 0.0              # E2E seconds
    success: bool = False
    error: str = ""
    sent_at: float = 0.0              # time.perf_counter() when sent: places its events in time

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass
class Distribution:
    """Milliseconds."""
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    std: float | None = None

    @classmethod
    def of(cls, seconds: list[float]) -> Distribution:
        if not seconds:
            return cls(None, None, None, None, None)
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(float(ms.mean()), p50, p90, p99, float(ms.std()))


@dataclass
class Summary:
    duration: float                   # seconds, first send to last finish
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float         # completed / s
    output_throughput: float          # generated tokens / s
    total_token_throughput: float     # (input + generated) tokens / s
    goodput: float | None             # requests / s within every SLO; None when no SLO given
    max_concurrency: int              # most requests in flight at once
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    errors: list[str] = field(default_factory=list)  # the first few distinct messages


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = {"e2e": "e2el"}.get(name, name)
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of ttft, tpot, e2el; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be positive")
    return slos


def meets(r: RequestResult, slos: Mapping[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[k] * 1e3 <= limit for k, limit in slos.items())


def summarize(results: list[RequestResult], duration: float, slos: Mapping[str, float] | None = None,
              max_concurrency: int = 0) -> Summary:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    inputs = sum(r.prompt_len for r in ok)
    outputs = sum(r.output_len for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    goodput = per_s(sum(meets(r, slos) for r in ok)) if slos else None
    errors = list(dict.fromkeys(r.error for r in failed))[:5]
    return Summary(
        duration=duration, completed=len(ok), failed=len(failed),
        total_input_tokens=inputs, total_output_tokens=outputs,
        request_throughput=per_s(len(ok)), output_throughput=per_s(outputs),
        total_token_throughput=per_s(inputs + outputs), goodput=goodput,
        max_concurrency=max_concurrency,
        ttft=Distribution.of([r.ttft for r in ok]),
        tpot=Distribution.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Distribution.of([g for r in ok for g in r.itl]),
        e2el=Distribution.of([r.latency for r in ok]),
        errors=errors)
