"""When requests are sent: a fixed number in flight (``concurrency``: each finished request is
replaced at once) or Poisson arrivals at ``request_rate`` per second (``inf``: all at once),
optionally capped by ``max_concurrency``. A run stops issuing after ``num_prompts`` requests or
``duration`` seconds, whichever comes first, and ends when the requests in flight have finished.
"""
from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np
from tqdm import tqdm

from ringserve.tools.loadgen.backends import Backend
from ringserve.tools.loadgen.stats import RequestResult, Summary, summarize
from ringserve.tools.loadgen.workload import RequestSpec


@dataclass
class Load:
    concurrency: int | None = None       # exactly one of these two
    request_rate: float | None = None
    max_concurrency: int | None = None   # with request_rate only

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        cap = f", at most {self.max_concurrency} in flight" if self.max_concurrency else ""
        return f"rate {self.request_rate:g}/s{cap}"


class _Run:
    def __init__(self, backend: Backend, requests: Iterator[RequestSpec], num_prompts: int | None,
                 duration: float | None, bar: tqdm):
        self.backend, self.requests, self.bar = backend, requests, bar
        self.num_prompts = num_prompts
        self.deadline = None if duration is None else time.perf_counter() + duration
        self.issued = 0
        self.in_flight = self.max_in_flight = 0
        self.results: list[RequestResult] = []

    def next_request(self) -> RequestSpec | None:
        if self.num_prompts is not None and self.issued >= self.num_prompts:
            return None
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return None
        self.issued += 1
        return next(self.requests)

    async def send(self, spec: RequestSpec) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self.results.append(await self.backend.send(spec))
        finally:
            self.in_flight -= 1
            self.bar.update(1)


async def _closed_loop(run: _Run, concurrency: int) -> None:
    async def user() -> None:
        while (spec := run.next_request()) is not None:
            await run.send(spec)
    await asyncio.gather(*(user() for _ in range(concurrency)))


async def _open_loop(run: _Run, rate: float, cap: int | None, rng: np.random.Generator) -> None:
    gate = asyncio.Semaphore(cap) if cap else None

    async def one(spec: RequestSpec) -> None:
        if gate is None:
            return await run.send(spec)
        async with gate:
            await run.send(spec)

    tasks = []
    start, at = time.perf_counter(), 0.0
    while True:
        if math.isfinite(rate):
            at += rng.exponential(1.0 / rate)
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        spec = run.next_request()
        if spec is None:
            break
        tasks.append(asyncio.create_task(one(spec)))
    await asyncio.gather(*tasks)


async def run_load(backend: Backend, requests: Iterator[RequestSpec], load: Load, *,
                   num_prompts: int | None, duration: float | None, rng: np.random.Generator,
                   slos: Mapping[str, float] | None = None,
                   progress: bool = True) -> tuple[Summary, list[RequestResult]]:
    """Run one load point to the end; its summary and every request's result."""
    if num_prompts is None and duration is None:
        raise ValueError("a run needs --num-prompts or --duration")
    with tqdm(total=num_prompts, desc=load.label, unit="req", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        run = _Run(backend, requests, num_prompts, duration, bar)
        start = time.perf_counter()
        if load.concurrency is not None:
            await _closed_loop(run, load.concurrency)
        elif load.request_rate is not None:
            await _open_loop(run, load.request_rate, load.max_concurrency, rng)
        else:
            raise ValueError("a load needs a concurrency or a request rate")
        elapsed = time.perf_counter() - start
    return summarize(run.results, elapsed, slos, run.max_in_flight), run.results
