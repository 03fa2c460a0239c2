"""What the HTTP frontend costs, measured against the engine client in one run, same engine.

    .venv/bin/python -m ringserve.tools.bench_http [--concurrency 16] [--max-tokens 32] [--model M]
                                                  [--json FILE]

Starts the launcher's engine and Gunicorn (1 worker by default), then runs the same requests
(the same prompt token ids, greedy, ignore_eos) twice, one phase after the other:
  engine client  this process submits straight to the engine's rings;
  HTTP + SSE     httpx streams /v1/completions through a Gunicorn worker.
It prints TTFT and inter-token latency (p50 / p90) of each path, and the CPU time the Gunicorn
workers spent per streamed token (parse, tokenize, detokenize, SSE) next to the CPU time this
process spent per token as a bare engine client, with the ratio HTTP / engine client of each.
Prompts are random ids below the model's vocabulary size.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import time
from pathlib import Path

import httpx
import numpy as np

from ringserve.ipc.sampling_params import SamplingParams
from ringserve.server.engine_client import EngineClient
from ringserve.server.launch import Launcher, add_serve_arguments
from ringserve.tools.bench_report import BenchRun, Column, add_json_argument, table


def _cpu_seconds(pid: int) -> float:
    """CPU time of the process's live threads in ns resolution (schedstat's run time; the
    clock-tick utime + stime of /proc/PID/stat is too coarse for a few thousand tokens)."""
    return sum(int((task / "schedstat").read_text().split()[0])
               for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _via_engine(client: EngineClient, prompts: list[list[int]], max_tokens: int):
    async def one(i: int, ids: list[int]):
        start = time.perf_counter()
        times = []
        stream = await client.submit(f"bench-{i}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                       ignore_eos=True))
        async for out in stream:
            if out.new_token_ids:
                times.append(time.perf_counter())
        return start, times
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def _via_http(url: str, prompts: list[list[int]], max_tokens: int):
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=len(prompts) + 8)) as c:
        async def one(ids: list[int]):
            start = time.perf_counter()
            times = []
            async with c.stream("POST", "/v1/completions", json={
                    "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        times.append(time.perf_counter())
            return start, times
        return await asyncio.gather(*(one(p) for p in prompts))


def _summary(results, cpu_s: float, tokens: int) -> tuple[dict[str, float], int]:
    """TTFT and ITL percentiles (ms), CPU microseconds per generated token, and how many
    stream events carried them (a token that ends inside a UTF-8 character waits for the next)."""
    ttft, itl, events = [], [], 0
    for start, times in results:
        ttft.append(times[0] - start)
        itl += list(np.diff(times))
        events += len(times)

    def ms(a, q):
        return float(np.percentile(a, q)) * 1e3
    return {"TTFT p50 ms": ms(ttft, 50), "TTFT p90 ms": ms(ttft, 90), "ITL p50 ms": ms(itl, 50),
            "ITL p90 ms": ms(itl, 90), "CPU us/token": cpu_s / tokens * 1e6}, events


COLUMNS = [Column("metric", "metric", align="<"), Column("engine_client", "engine client", ".2f"),
           Column("http", "HTTP + SSE", ".2f"), Column("ratio", "HTTP / engine client", ".2f")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--idle-s", type=float, default=1.0,
                   help="seconds the idle workers' CPU is sampled before the HTTP phase")
    add_serve_arguments(p)
    add_json_argument(p)
    args = p.parse_args(argv)
    logging.getLogger("ringserve.client").setLevel(logging.ERROR)  # "client closed" at the end
    if "--workers" not in (argv or []):
        args.workers = 1
    args.port = _free_port()
    args.log_level = "warning"
    run = BenchRun.start("bench_http", args)

    from ringserve.gpu.loader.config import ModelConfig
    from ringserve.gpu.loader.model_store import resolve_model
    model_dir = Path(resolve_model(args.model))
    config = ModelConfig.from_dir(model_dir)
    max_len = args.max_model_len or config.max_position_embeddings
    launcher = Launcher(args, model_dir, max_len)
    try:
        launcher.start()
        gunicorn = launcher.gunicorn
        if gunicorn is None:
            raise RuntimeError("the server stopped while it started")
        url = f"http://127.0.0.1:{args.port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if gunicorn.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy")
            time.sleep(0.3)
        # Fresh prompts per phase (same length): no phase may profit from the other's prefix cache.
        rng = np.random.default_rng(0)
        low, high = min(100, config.vocab_size // 4), config.vocab_size
        warm, prompts, prompts_http = (
            [rng.integers(low, high, args.prompt_tokens).tolist() for _ in range(args.concurrency)]
            for _ in range(3))
        workers = _children(gunicorn.pid)

        async def engine_phase():
            client = EngineClient(launcher.control_paths)
            await client.start()
            await client.wait_ready()
            await _via_engine(client, warm, 4)  # warm-up: the same batch shapes once
            cpu0 = time.process_time()
            res = await _via_engine(client, prompts, args.max_tokens)
            cpu = time.process_time() - cpu0
            await client.close()
            return res, cpu

        engine_res, engine_cpu = asyncio.run(engine_phase())
        asyncio.run(_via_http(url, [q[::-1] for q in warm], 4))  # warm-up of the HTTP path
        # What the idle workers burn (event loop, heartbeats), to tell it from per-token work.
        w0, t0 = sum(_cpu_seconds(w) for w in workers), time.perf_counter()
        time.sleep(args.idle_s)
        w1, t1 = sum(_cpu_seconds(w) for w in workers), time.perf_counter()
        idle_us_per_s = (w1 - w0) / (t1 - t0) * 1e6
        http_res = asyncio.run(_via_http(url, prompts_http, args.max_tokens))
        worker_cpu = sum(_cpu_seconds(w) for w in workers) - w1
        http_s = time.perf_counter() - t1
    finally:
        launcher.shutdown()
    run.finish()

    tokens = args.concurrency * args.max_tokens  # ignore_eos: every stream runs to max_tokens
    (engine, engine_events), (http, http_events) = (_summary(engine_res, engine_cpu, tokens),
                                                    _summary(http_res, worker_cpu, tokens))
    rows = [{"metric": k, "engine_client": engine[k], "http": http[k],
             "ratio": http[k] / engine[k] if engine[k] else None} for k in engine]
    print(run.header())
    print(f"{args.concurrency} concurrent streams x {args.max_tokens} tokens, {args.prompt_tokens}-token "
          f"prompts, model {model_dir.name}, {args.workers} worker(s), device {launcher.device}; "
          f"stream events: engine client {engine_events}, HTTP {http_events}")
    print(table(rows, COLUMNS))
    print("CPU us/token: engine client = this process; HTTP = all Gunicorn workers (tokenize, "
          "detokenize, JSON, SSE, HTTP) per streamed token")
    print(f"idle workers: {idle_us_per_s:.0f} us of CPU per second, "
          f"{idle_us_per_s * http_s / tokens:.1f} us/token of the HTTP figure over its {http_s:.2f} s")
    run.write(args.json, rows, model=str(model_dir), device=launcher.device, tokens=tokens,
              stream_events={"engine_client": engine_events, "http": http_events},
              idle_worker_cpu_us_per_s=idle_us_per_s, http_phase_s=http_s)


if __name__ == "__main__":
    main()
