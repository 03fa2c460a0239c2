"""Request journeys (docs/trace.md): the engine's trace of a traced request, its trip over the wire,
and a real `ringserve serve --enable-debug-endpoints` on the tiny model answering traced
requests whose numbers agree with each other, with /metrics and with /debug/engines."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import httpx
import msgspec
import pytest

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.ipc.messages import (
    AddRequest,
    EngineOutput,
    decode_outputs,
    decode_request,
    encode_outputs,
    encode_request,
)
from ringserve.ipc.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 48


# -- the checks every journey must pass --------------------------------------------------------

def check_engine_journey(e: dict, time_key: str = "at") -> None:
    """Consistency of one engine journey (engine/trace.py), times in any one unit."""
    start, end = ("start", "end") if time_key == "at" else ("start_ms", "end_ms")
    received = e["received"] if time_key == "at" else e["received_ms"]
    fin = e["finish"]
    bs = fin["block_size"]
    # Every step it ran in, in time order, each after the engine received it.
    steps = e["steps"]
    assert steps and [s["step"] for s in steps] == sorted({s["step"] for s in steps})
    times = [t for s in steps for t in (s[start], s[end])]
    assert times == sorted(times) and times[0] >= received
    # The block table as it grew: each step's slots follow it. A preemption frees the table;
    # the request is admitted again and recomputed from what the prefix cache still holds.
    admissions = {a["step"]: a for a in e["admissions"]}
    allocations = {a["step"]: a for a in e["allocations"]}
    preemptions = sorted(p["step"] for p in e["preemptions"])
    table: list[int] = []
    position = 0
    for s in steps:
        while preemptions and preemptions[0] <= s["step"]:
            preemptions.pop(0)
            table, position = [], None
        if s["step"] in admissions:
            position = admissions[s["step"]]["num_cached_tokens"]
        if s["step"] in allocations:
            grown = allocations[s["step"]]["block_table"]
            assert grown[:len(table)] == table          # blocks are only ever appended
            table = grown
        assert s["first_position"] == position, (s, position)
        assert len(s["slots"]) == s["num_new_tokens"]
        for i, slot in enumerate(s["slots"]):
            pos = s["first_position"] + i
            assert slot == table[pos // bs] * bs + pos % bs, (s, table)
        position = s["first_position"] + s["num_new_tokens"]
        b = s["batch"]
        assert b["num_tokens"] == b["num_prefill_tokens"] + b["num_decode_tokens"]
        assert s["num_new_tokens"] <= b["num_tokens"] <= b["max_num_batched_tokens"]
        assert 1 <= b["num_reqs"] <= b["max_num_seqs"]
    # The end: its blocks are exactly ⌈tokens in the cache / block size⌉ and go back to the pool.
    assert fin["num_tokens_in_cache"] == fin["num_prompt_tokens"] + fin["num_output_tokens"] - 1
    assert len(fin["blocks_freed"]) == math.ceil(fin["num_tokens_in_cache"] / bs)
    assert fin["blocks_freed"] == table
    assert fin["step"] == steps[-1]["step"]
    assert e["admissions"][0]["step"] == steps[0]["step"]
    assert len(e["admissions"]) == len(e["preemptions"]) + 1


# -- the engine alone --------------------------------------------------------------------------

def test_engine_traces_only_traced_requests_through_preemption(tiny_model_dir):
    # A pool too small for both: the newer request is preempted and recomputed.
    core = EngineCore(EngineConfig.create(model=str(tiny_model_dir), block_size=BLOCK_SIZE,
                                          num_gpu_blocks_override=12, max_num_batched_tokens=16,
                                          enable_prefix_caching=False))
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    core.add_request("old", list(range(5, 25)), params, trace=True)
    core.add_request("new", list(range(30, 46)), params, trace=True)
    core.add_request("plain", list(range(50, 54)), SamplingParams(max_tokens=3, temperature=0.0))
    journeys, plain = {}, []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.request_id == "plain":
                plain.append(out.trace)
            elif out.finished:
                journeys[out.request_id] = msgspec.json.decode(out.trace)
            else:
                assert out.trace is None      # the journey rides on the last output only
    assert plain and all(t is None for t in plain)
    assert core.tracer.traces == {}           # nothing kept after the end
    assert journeys["new"]["preemptions"], "the pool was meant to force a preemption"
    for j in journeys.values():
        check_engine_journey(j)
        assert j["finish"]["reason"] == "length"
    # Chunked prefill: 20 prompt tokens with a 16-token budget take two steps.
    old = journeys["old"]["steps"]
    assert [s["num_new_tokens"] for s in old[:2]] == [16, 4] and old[1]["phase"] == "prefill"


def test_trace_flag_and_blob_cross_the_wire():
    add = decode_request(encode_request(AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), trace=True)))
    assert add.trace and list(add.prompt_token_ids) == [1, 2, 3]
    assert not decode_request(encode_request(AddRequest("r", [1], SamplingParams()))).trace
    blob = json.dumps({"steps": [1, 2]}).encode()
    outs = decode_outputs(encode_outputs([EngineOutput("a", [7], None),
                                          EngineOutput("b", [8], "stop", trace=blob,
                                                                         error=None, stop_reason=8)]))
    assert outs[0].trace is None and outs[1].trace == blob and outs[1].stop_reason == 8


# -- a real server -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def debug_server(tiny_server):
    return tiny_server("--engines", "2", "--enable-debug-endpoints",
                       "--max-model-len", str(NUM_BLOCKS * BLOCK_SIZE), "--block-size", str(BLOCK_SIZE),
                       "--num-gpu-blocks-override", str(NUM_BLOCKS))


def _metric(text: str, name: str) -> list[tuple[str, float]]:
    return [(line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """/debug/engines once every engine has published an idle snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        data = httpx.get(url + "/debug/engines").json()
        snaps = [e["snapshot"] for e in data["engines"]]
        if all(s is not None and s["num_running"] == s["num_waiting"] == 0 for s in snaps):
            return data
        assert time.monotonic() < deadline, data
        time.sleep(0.1)


def check_journey(j: dict, prompt_len: int, max_tokens: int, num_engines: int) -> None:
    fe = j["frontend"]
    assert fe["num_prompt_tokens"] == prompt_len == len(fe["prompt_token_ids"])
    assert 0 <= fe["tokenize_ms"]
    (c,) = j["choices"]
    route = c["engine_client"]
    assert len(route["scores"]) == num_engines and 0 <= route["engine"] < num_engines
    assert route["scores"][route["engine"]] == min(route["scores"])
    assert fe["tokenize_ms"] <= route["chosen_ms"] <= route["written_ms"]
    e = c["engine"]
    check_engine_journey(e, time_key="at_ms")
    # (written_ms is taken after the doorbell: it may be later)
    assert route["chosen_ms"] <= e["received_ms"]
    fin = e["finish"]
    assert fin["num_prompt_tokens"] == prompt_len
    assert fin["num_output_tokens"] == c["num_output_tokens"] == max_tokens
    assert 0 <= c["ttft_ms"] <= c["e2e_ms"]
    assert e["steps"][0]["end_ms"] <= c["ttft_ms"]         # the first token came from a step
    assert fin["at_ms"] <= c["e2e_ms"]
    assert c["finish_reason"] == fin["reason"] == "length"


def test_traced_request_over_http_is_consistent(debug_server):
    url = debug_server
    prompt = "The journey of a request through ringserve"
    ids = httpx.post(url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 9, "temperature": 0, "ignore_eos": True,
            "ringserve_trace": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    j = data["ringserve_trace"]
    check_journey(j, len(ids), 9, num_engines=2)
    assert data["usage"]["completion_tokens"] == 9
    # /metrics speaks of the same pool.
    metrics = httpx.get(url + "/metrics").text
    (labels, _), = _metric(metrics, "ringserve:cache_config_info")
    fin = j["choices"][0]["engine"]["finish"]
    assert f'block_size="{fin["block_size"]}"' in labels and f'num_gpu_blocks="{fin["num_blocks"]}"' in labels
    # Its blocks are back in the pool: /debug/engines shows none of them held by anyone.
    engines = wait_idle(url)["engines"]
    snap = engines[j["choices"][0]["engine_client"]["engine"]]["snapshot"]
    blocks = [state for state, count in snap["blocks_rle"] for _ in range(count)]
    assert all(blocks[b] < 0 for b in fin["blocks_freed"])
    assert snap["num_free_blocks"] == snap["num_blocks"] == fin["num_blocks"]
    assert sum(v for _, v in _metric(httpx.get(url + "/metrics").text,
                                     "ringserve:kv_cache_usage_perc")) == 0
    # Untraced: no journey, nothing else changes.
    plain = httpx.post(url + "/v1/completions", json=dict(body, ringserve_trace=False)).json()
    assert "ringserve_trace" not in plain
    assert plain["choices"][0]["text"] == data["choices"][0]["text"]


def test_traced_stream_by_header_carries_the_journey_last(debug_server):
    url = debug_server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      headers={"X-Ringserve-Trace": "1"}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    last = json.loads(chunks[-2])
    assert last["object"] == "chat.completion.chunk" and last["choices"] == []
    assert all("ringserve_trace" not in json.loads(c) for c in chunks[:-2])
    j = last["ringserve_trace"]
    check_journey(j, j["frontend"]["num_prompt_tokens"], 5, num_engines=2)


def test_trace_cli_prints_every_station(debug_server):
    out = subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "trace", "Explain the KV cache",
                          "--url", debug_server, "--max-tokens", "6"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    at = [text.index(f"── {s} ") for s in ("Frontend", "Engine client", "Engine core",
                                            "KV-cache manager", "Model runner", "Way back")]
    assert at == sorted(at)
    assert "→ slots" in text and "back to the pool" in text and "TTFT" in text


def test_debug_engines_shows_queues_pool_and_steps(debug_server):
    data = wait_idle(debug_server)
    assert len(data["engines"]) == 2
    for e in data["engines"]:
        s = e["snapshot"]
        assert e["connected"] and e["score"] == 0
        assert s["block_size"] == BLOCK_SIZE and s["num_blocks"] == NUM_BLOCKS
        assert sum(count for _, count in s["blocks_rle"]) == NUM_BLOCKS
        assert s["num_free_blocks"] == NUM_BLOCKS
        for step in s["steps"]:
            assert step["start"] <= step["end"] and 0 <= step["num_free_blocks"] <= NUM_BLOCKS
    # Earlier tests ran requests: some engine has steps with prefill and decode tokens.
    steps = [t for e in data["engines"] for t in e["snapshot"]["steps"]]
    assert sum(t["num_prefill_tokens"] for t in steps) > 0 and sum(t["num_decode_tokens"] for t in steps) > 0


def test_debug_endpoints_are_off_by_default(tiny_model_dir):
    import falcon.testing

    from ringserve.server.app import AppOptions, create_app
    from ringserve.server.context import ServerContext
    from ringserve.server.engine_client import EngineClient
    from ringserve.server.metrics import RequestMetrics
    from ringserve.server.tokenizer import Tokenizer

    ctx = ServerContext(Tokenizer.from_dir(tiny_model_dir), EngineClient([]), ["tiny"], 256,
                        RequestMetrics("tiny", 256))
    client = falcon.testing.TestClient(create_app(ctx, AppOptions()))
    for path in ("/debug/engines", "/dashboard"):
        assert client.simulate_get(path).status_code == 404
    on = falcon.testing.TestClient(create_app(ctx, AppOptions(debug_engines=list)))
    assert on.simulate_get("/debug/engines").json["engines"] == []
    page = on.simulate_get("/dashboard")
    html = page.text
    assert page.status_code == 200 and "<script>" in html and "<style>" in html
    assert "<link" not in html and "src=" not in html     # self-contained: no outside assets
