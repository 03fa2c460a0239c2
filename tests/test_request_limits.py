"""Per-request limits against real servers: at each limit the request is served (200), one above
it is a 400 naming the field and the flag. Once with the default flags (the defaults a real client
never reaches), once with small flags (so that the limits on work are cheap to reach)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest

VOCAB = 384  # the tiny model's
BASE = ["--workers", "1", "--max-model-len", "256", "--device", "cpu", "--drain-timeout", "2"]
SMALL = {"--max-logprobs": 3, "--max-choices-per-request": 6, "--max-stop-strings": 2,
         "--max-stop-bytes": 8, "--max-stop-token-ids": 2, "--max-response-logprobs": 40}


@pytest.fixture(scope="module")
def default_server(serve, tiny_model_dir, no_segment_left_behind):
    server = serve(tiny_model_dir, *BASE)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
    server.stop()  # before no_segment_left_behind looks


@pytest.fixture(scope="module")
def small_server(serve, tiny_model_dir, no_segment_left_behind):
    server = serve(tiny_model_dir, *BASE, *[str(x) for kv in SMALL.items() for x in kv])
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
    server.stop()


def completions(c: httpx.Client, **body) -> httpx.Response:
    return c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **body})


def chat(c: httpx.Client, **body) -> httpx.Response:
    return c.post("/v1/chat/completions",
                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **body})


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def refused(r: httpx.Response, param: str, flag: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and flag in err["message"], err


# -- default flags ----------------------------------------------------------------------------

def test_response_logprobs_default_bounds_the_amplification(default_server):
    """n=48, logprobs=20, max_tokens=2000 once made a 51.5 MB answer from a 120-byte body (and a
    worker 360 MB larger for good): the default --max-response-logprobs (2^19) refuses such a
    request; here 128 x 196 x 21 = 526,848 entries."""
    refused(completions(default_server, n=128, max_tokens=196, logprobs=20), "logprobs",
            "--max-response-logprobs")


def test_a_huge_prompt_never_stalls_the_worker(default_server):
    """A 1 MB prompt of digits is a million tokens, 3 s of tokenizing on this machine: the
    completion is refused by the prompt's bytes alone (256 tokens of at most 13 bytes each cannot
    hold it), /tokenize tokenizes it in a thread; meanwhile the worker's only event loop keeps
    answering /health and streaming another completion."""
    digits = "1" * 1_000_000

    async def probe(c: httpx.AsyncClient, done: asyncio.Event) -> list[float]:
        waits = []
        while not done.is_set():
            started = time.monotonic()
            assert (await c.get("/health")).status_code == 200
            waits.append(time.monotonic() - started)
            await asyncio.sleep(0.02)
        return waits

    async def stream(c: httpx.AsyncClient) -> list[float]:
        gaps, last = [], time.monotonic()
        async with c.stream("POST", "/v1/completions", json={
                "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            async for _ in r.aiter_lines():
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
        return gaps

    async def timed(coro) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        return await coro, time.monotonic() - started

    async def main():
        async with httpx.AsyncClient(base_url=str(default_server.base_url), timeout=120) as c:
            done = asyncio.Event()
            health = asyncio.create_task(probe(c, done))
            await asyncio.sleep(0.1)
            refused_, _ = await timed(c.post("/v1/completions", json={"prompt": digits}))
            (tokenized, took), gaps = await asyncio.gather(
                timed(c.post("/tokenize", json={"prompt": digits})), stream(c))
            done.set()
            return refused_, tokenized, took, gaps, await health

    refused_, tokenized, took, gaps, waits = asyncio.run(main())
    assert refused_.status_code == 400 and "at least" in refused_.text, refused_.text
    assert refused_.json()["error"]["code"] == "context_length_exceeded"
    assert tokenized.json()["count"] == 1_000_000
    assert took > 0.5  # long enough that a stalled loop would show
    assert max(waits) < took / 4 and max(gaps) < took / 4, (took, max(waits), max(gaps))


def test_max_logprobs_default_is_vllms_20(default_server):
    c = default_server
    ok(completions(c, logprobs=20))
    refused(completions(c, logprobs=21), "logprobs", "--max-logprobs")
    ok(chat(c, logprobs=True, top_logprobs=20))
    refused(chat(c, logprobs=True, top_logprobs=21), "top_logprobs", "--max-logprobs")


def test_stop_strings_default_count_and_bytes(default_server):
    c = default_server
    ok(completions(c, stop=[f"zq{i}" for i in range(64)]))
    refused(completions(c, stop=[f"zq{i}" for i in range(65)]), "stop", "--max-stop-strings")
    ok(chat(c, stop=["x" * 64] * 64))                       # 4096 bytes
    refused(chat(c, stop=["x" * 64] * 63 + ["x" * 65]), "stop", "--max-stop-bytes")
    ok(completions(c, stop=["é" * 2048]))                   # bytes, not characters: 4096
    refused(completions(c, stop=["é" * 2048 + "a"]), "stop", "--max-stop-bytes")


def test_stop_token_ids_default_count(default_server):
    c = default_server
    ids = [i % VOCAB for i in range(1025)]
    ok(completions(c, stop_token_ids=ids[:1024], min_tokens=1, max_tokens=2))
    refused(completions(c, stop_token_ids=ids), "stop_token_ids", "--max-stop-token-ids")


def test_choices_default_1024(default_server):
    """A list of prompts x n: each is an engine request."""
    c = default_server
    body = ok(completions(c, prompt=["hi"] * 8, n=128))
    assert len(body["choices"]) == 1024
    refused(completions(c, prompt=["hi"] * 1025), "prompt", "--max-choices-per-request")
    refused(completions(c, prompt=[[1, 2]] * 9, n=128), "prompt", "--max-choices-per-request")


def test_a_bad_limit_flag_is_refused_at_start(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "serve", "--model",
                        str(tiny_model_dir), "--device", "cpu", "--max-stop-strings", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--max-stop-strings must be at least 1" in r.stderr, r.stderr


# -- small flags ------------------------------------------------------------------------------

def test_small_limits_at_and_above(small_server):
    c = small_server
    ok(completions(c, logprobs=3))
    refused(completions(c, logprobs=4), "logprobs", "--max-logprobs")
    ok(completions(c, prompt=["a", "b", "c"], n=2))
    refused(completions(c, prompt=["a", "b", "c", "d"], n=2), "prompt", "--max-choices-per-request")
    refused(chat(c, n=7), "n", "--max-choices-per-request")
    ok(chat(c, stop=["ab", "cd"]))
    refused(chat(c, stop=["ab", "cd", "ef"]), "stop", "--max-stop-strings")
    ok(completions(c, stop=["abcdefgh"]))
    refused(completions(c, stop=["abcdefghi"]), "stop", "--max-stop-bytes")
    ok(completions(c, stop_token_ids=[5, 6]))
    refused(completions(c, stop_token_ids=[5, 6, 7]), "stop_token_ids", "--max-stop-token-ids")


def test_response_logprobs_limit(small_server):
    """choices x tokens (echoed prompt included) x (1 + logprobs) <= --max-response-logprobs."""
    c = small_server
    body = ok(completions(c, n=2, max_tokens=5, logprobs=3, ignore_eos=True))  # 2*5*4 = 40
    entries = sum(len(t) for ch in body["choices"] for t in ch["logprobs"]["top_logprobs"])
    assert 0 < entries <= 40
    refused(completions(c, n=2, max_tokens=6, logprobs=3), "logprobs", "--max-response-logprobs")
    ok(chat(c, max_tokens=10, logprobs=True, top_logprobs=3))                 # 10*4 = 40
    refused(chat(c, max_tokens=11, logprobs=True, top_logprobs=3), "top_logprobs",
            "--max-response-logprobs")
    refused(chat(c, max_tokens=41, logprobs=True), "top_logprobs", "--max-response-logprobs")
    # echo: every choice repeats its prompt's logprobs
    n_prompt = c.post("/tokenize", json={"prompt": "hi there"}).json()["count"]
    at = 40 // 2 - n_prompt  # 1 + logprobs = 2 entries per position
    ok(completions(c, prompt="hi there", echo=True, logprobs=1, max_tokens=at))
    refused(completions(c, prompt="hi there", echo=True, logprobs=1, max_tokens=at + 1),
            "logprobs", "--max-response-logprobs")
