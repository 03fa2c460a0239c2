"""`loadgen --long-prompt N`: what one long prompt costs the streams already decoding.

N short streams (--concurrency, each a closed loop of --input-len / --output-len requests) run
for a baseline while nothing else arrives; then one prompt of --long-prompt tokens is sent. A
chunked prefill should keep the streams moving: their inter-token gaps that end while the long
prompt is prefilled (from its send to its first token) are set against the gaps of the
baseline, p50 / p99 / max. The long request's own TTFT and inter-token latency (the decode after
a long prefill) are reported beside the streams' baseline ITL.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Iterator

import numpy as np

from ringserve.tools.loadgen.backends import Backend
from ringserve.tools.loadgen.stats import RequestResult
from ringserve.tools.loadgen.workload import RequestSpec


def event_times(r: RequestResult) -> np.ndarray:
    """perf_counter() times of a request's output events (the first token, then each gap)."""
    return r.sent_at + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])


def gaps_ending_in(results: list[RequestResult], start: float, end: float) -> list[float]:
    """Every inter-token gap (seconds) of the results whose later event falls in [start, end)."""
    out: list[float] = []
    for r in results:
        if r.success and r.itl:
            ends = event_times(r)[1:]
            out += [g for g, t in zip(r.itl, ends, strict=True) if start <= t < end]
    return out


def _ms(gaps: list[float]) -> dict[str, Any]:
    if not gaps:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    ms = np.asarray(gaps) * 1e3
    return {"count": len(gaps), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "max": float(ms.max())}


async def measure(backend: Backend, streams: int, short: Iterator[RequestSpec], long: RequestSpec,
                  baseline_s: float) -> dict[str, Any]:
    """Run the streams, the baseline, the long prompt; stop the streams once it has finished."""
    results: list[RequestResult] = []
    done = asyncio.Event()

    async def stream() -> None:
        while not done.is_set():
            results.append(await backend.send(next(short)))

    tasks = [asyncio.create_task(stream()) for _ in range(streams)]
    try:
        await asyncio.sleep(baseline_s / 2)  # the streams past their first prefills
        baseline_start = time.perf_counter()
        await asyncio.sleep(baseline_s)
        lone = await backend.send(long)
    finally:
        done.set()
    await asyncio.gather(*tasks)
    if not lone.success:
        raise RuntimeError(f"the long prompt failed: {lone.error}")
    prefill_end = lone.sent_at + lone.ttft
    return {"streams": streams, "long_prompt_len": lone.prompt_len, "long_ttft_ms": lone.ttft * 1e3,
            "long_itl_ms": _ms(lone.itl),
            "streams_itl_baseline_ms": _ms(gaps_ending_in(results, baseline_start, lone.sent_at)),
            "streams_itl_during_prefill_ms": _ms(gaps_ending_in(results, lone.sent_at, prefill_end)),
            "streams_itl_after_prefill_ms": _ms(gaps_ending_in(results, prefill_end,
                                                               lone.sent_at + lone.latency))}


def format_result(m: dict[str, Any]) -> str:
    def row(name: str, d: dict[str, Any]) -> str:
        cells = ["-" if d[k] is None else f"{d[k]:.1f}" for k in ("p50", "p99", "max")]
        return f"| {name} | {d['count']} | " + " | ".join(cells) + " |"
    return "\n".join([
        f"one {m['long_prompt_len']}-token prompt among {m['streams']} decoding streams: "
        f"its TTFT {m['long_ttft_ms']:.0f} ms",
        "| inter-token gaps (ms) | count | p50 | p99 | max |", "|---|---:|---:|---:|---:|",
        row("streams, before it", m["streams_itl_baseline_ms"]),
        row("streams, during its prefill", m["streams_itl_during_prefill_ms"]),
        row("streams, during its decode", m["streams_itl_after_prefill_ms"]),
        row("the long request's decode", m["long_itl_ms"])])
