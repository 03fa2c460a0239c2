"""What the HTTP frontend costs, measured against the engine client in one run, same engine.

    .venv/bin/python -m ringserve.tools.bench_http [--concurrency 16] [--max-tokens 32] [--model M]

Starts the launcher's engine and Gunicorn (1 worker by default), then runs the same requests
(the same prompt token ids, greedy, ignore_eos) twice, one phase after the other:
  engine client  this process submits straight to the engine's rings;
  HTTP + SSE     httpx streams /v1/completions through a Gunicorn worker.
It prints TTFT and inter-token latency (p50 / p90) of each path, and the CPU time the Gunicorn
workers spent per streamed token (parse, tokenize, detokenize, SSE) next to the CPU time this
process spent per token as a bare engine client.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import time
from pathlib import Path

import httpx
import numpy as np

from ringserve.server.engine_client import EngineClient
from ringserve.server.launch import Launcher, add_serve_arguments

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


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
        stream = await client.submit(f"bench-{i}", ids, dict(temperature=0.0, max_tokens=max_tokens,
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


def _latencies(results) -> tuple[np.ndarray, np.ndarray, int]:
    ttft, itl, events = [], [], 0
    for start, times in results:
        ttft.append(times[0] - start)
        itl += list(np.diff(times))
        events += len(times)
    return np.array(ttft), np.array(itl), events


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    add_serve_arguments(p)
    args = p.parse_args(argv)
    logging.getLogger("ringserve.client").setLevel(logging.ERROR)  # "client closed" at the end
    if "--workers" not in (argv or []):
        args.workers = 1
    args.port = _free_port()
    args.log_level = "warning"

    from ringserve.gpu.config import ModelConfig
    from ringserve.gpu.model_store import resolve_model
    model_dir = Path(resolve_model(args.model))
    max_len = args.max_model_len or ModelConfig.from_dir(model_dir).max_position_embeddings
    launcher = Launcher(args, model_dir, max_len)
    try:
        launcher.start()
        url = f"http://127.0.0.1:{args.port}"
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        # Fresh prompts per phase (same length): no phase may profit from the other's prefix cache.
        rng = np.random.default_rng(0)
        warm, prompts, prompts_http = (
            [rng.integers(100, 40000, args.prompt_tokens).tolist() for _ in range(args.concurrency)]
            for _ in range(3))
        workers = _children(launcher.gunicorn.pid)

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
        w0 = sum(_cpu_seconds(w) for w in workers)
        http_res = asyncio.run(_via_http(url, prompts_http, args.max_tokens))
        worker_cpu = sum(_cpu_seconds(w) for w in workers) - w0
    finally:
        launcher.shutdown()

    print(f"{args.concurrency} concurrent streams x {args.max_tokens} tokens, "
          f"{args.prompt_tokens}-token prompts, {args.workers} worker(s), device {launcher.device}")
    print(f"{'path':<16}{'TTFT p50':>11}{'TTFT p90':>11}{'ITL p50':>11}{'ITL p90':>11}"
          f"{'CPU/token':>12}")
    for name, res, cpu in (("engine client", engine_res, engine_cpu),
                           ("HTTP + SSE", http_res, worker_cpu)):
        ttft, itl, events = _latencies(res)
        print(f"{name:<16}{np.median(ttft)*1e3:>9.1f}ms{np.percentile(ttft, 90)*1e3:>9.1f}ms"
              f"{np.median(itl)*1e3:>9.1f}ms{np.percentile(itl, 90)*1e3:>9.1f}ms"
              f"{cpu / events * 1e6:>10.0f}us")
    print("CPU/token: engine client = this process; HTTP = all Gunicorn workers (tokenize, "
          "detokenize, JSON, SSE, HTTP) per streamed token")


if __name__ == "__main__":
    main()
