"""Every numeric field's edge values against a real server: each value alone, then hypothesis's
combinations, to /v1/completions and /v1/chat/completions. The answer is only ever 200 or 400
(never 5xx), a 400 is OpenAI's error JSON with `param` naming a field of the request, and the
engine process is the same one at the end (no crash, no restart)."""
from __future__ import annotations

import json
import math
import re

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import engine_pids

VOCAB = 384  # the tiny model's (tests/conftest.py tiny_model_dir)
RAW = "@@RAW@@"  # json.dumps(f"{RAW}NaN") -> the raw token NaN in the body

NUMBERS = [0, 1, -1, 2, 0.5, -0.5, 20, 21, VOCAB - 1, VOCAB,
           5e-324, 1e-40, 1.17549435e-38, 1e-46, 1e-300, -1e-300, 1e308, -1e308, 3.4028235e38, 3.5e38,
           2**31 - 1, 2**31, -2**31 - 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, 10**30, 10**400]
WRONG = [True, False, None, "1", "NaN", [1], {"a": 1}, f"{RAW}NaN", f"{RAW}Infinity",
         f"{RAW}-Infinity", f"{RAW}1e999", f"{RAW}-1e999", f"{RAW}1e-999"]
VALUES = NUMBERS + WRONG

FLOATS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty"]
INTS = ["top_k", "seed", "max_tokens", "min_tokens", "n"]
COMPLETION_ONLY = ["logprobs", "best_of"]
CHAT_ONLY = ["top_logprobs", "max_completion_tokens"]
ID_LISTS = ["stop_token_ids"]  # and completions' prompt as a token-id list
BOOLS = ["echo", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output"]

CHAT_BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION_BASE = {"prompt": "hi", "max_tokens": 2}


def fields(endpoint: str) -> list[str]:
    return FLOATS + INTS + ID_LISTS + (COMPLETION_ONLY if endpoint == "completions" else CHAT_ONLY)


def body_bytes(body: dict) -> bytes:
    """JSON, with RAW-marked strings written as raw tokens (NaN, 1e999: not JSON, or not finite)."""
    return re.sub(f'"{RAW}([^"]*)"', r"\1", json.dumps(body)).encode()


@pytest.fixture(scope="module")
def server(serve, tiny_model_dir, no_segment_left_behind):
    s = serve(tiny_model_dir, "--workers", "1", "--max-model-len", "256", "--device", "cpu",
              "--drain-timeout", "2")
    pids = set(engine_pids(s.proc.pid))
    assert len(pids) == 1
    with httpx.Client(base_url=s.url, timeout=60) as client:
        yield s, client
    assert set(engine_pids(s.proc.pid)) == pids, "the engine was restarted"
    s.stop()


def check(client: httpx.Client, endpoint: str, body: dict) -> int:
    """POST it; the answer must be 200 or OpenAI's 400 naming a field that was sent."""
    base = COMPLETION_BASE if endpoint == "completions" else CHAT_BASE
    sent = {**base, **body}
    r = client.post(f"/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                    content=body_bytes(sent), headers={"content-type": "application/json"})
    what = (endpoint, sent, r.status_code, r.text[:300])
    assert r.status_code in (200, 400), what
    data = r.json()
    if r.status_code == 200:
        assert data["choices"], what
        assert all(c["finish_reason"] in ("stop", "length") for c in data["choices"]), what
        return 200
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], what
    assert err["type"] == "invalid_request_error", what
    param = err["param"]
    assert isinstance(param, str) and param, what
    root = param.split("[")[0].split(".")[0]
    assert root in sent, what  # the field at fault, one the request has
    return 400


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_each_field_alone_at_each_edge(server, endpoint):
    s, client = server
    seen = {200: 0, 400: 0}
    for name in fields(endpoint):
        for value in VALUES:
            v = [value] if name in ID_LISTS else value
            seen[check(client, endpoint, {name: v})] += 1
    if endpoint == "completions":
        for value in VALUES:  # the prompt as token ids
            seen[check(client, endpoint, {"prompt": [value]})] += 1
            seen[check(client, endpoint, {"prompt": [[1, value]]})] += 1
    assert seen[200] > 50 and seen[400] > 200, seen  # both kinds were really exercised
    assert client.get("/health").status_code == 200


def _value(name: str):
    if name in BOOLS:
        return st.booleans()
    one = st.sampled_from(VALUES)
    if name in ID_LISTS:
        return st.lists(st.one_of(one, st.integers(0, VOCAB - 1)), max_size=3)
    return one


@st.composite
def requests(draw):
    endpoint = draw(st.sampled_from(["completions", "chat"]))
    names = draw(st.lists(st.sampled_from(fields(endpoint) + BOOLS), min_size=1, max_size=5,
                          unique=True))
    body = {name: draw(_value(name)) for name in names}
    if endpoint == "completions" and draw(st.booleans()):
        ints = [v for v in NUMBERS if isinstance(v, int)]
        body["prompt"] = draw(st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(ints)),
                                       min_size=1, max_size=4))
    # Keep each request small: a valid max_tokens stays a few tokens, n a few choices.
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and 3 < body[key] < 256:
            body[key] = 3
    return endpoint, body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests())
def test_combinations_are_200_or_400(server, req):
    s, client = server
    endpoint, body = req
    check(client, endpoint, body)


def test_seed_accepts_the_int64_range_end_to_end(server):
    """vLLM's range; sample j of n gets seed + j (wrapped in int64), and a seed gives the same
    tokens every time."""
    s, client = server
    for seed in (-1, -2**63, 2**63 - 1, 0, 12345):
        body = {"prompt": "hi", "max_tokens": 4, "temperature": 1.0, "seed": seed, "n": 2,
                "ignore_eos": True}
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        again = client.post("/v1/completions", json=body).json()
        assert [c["text"] for c in again["choices"]] == [c["text"] for c in first.json()["choices"]]
    for seed in (2**63, -2**63 - 1, 2**64):
        r = client.post("/v1/completions", json={"prompt": "hi", "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


@pytest.mark.parametrize("body,param", [
    ({"top_p": 1e-46}, "top_p"), ({"top_p": 1e-300}, "top_p"), ({"temperature": 1e308}, "temperature"),
    ({"min_p": 1e-40}, "min_p"), ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"presence_penalty": 5e-324}, "presence_penalty"), ({"top_k": 2**31}, "top_k"),
    ({"stop_token_ids": [VOCAB], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": [10**9], "min_tokens": 1}, "stop_token_ids"),
    ({"prompt": [1, VOCAB]}, "prompt"), ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 2**64}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"n": True}, "n"), ({"best_of": 2**63}, "best_of"),
])
def test_what_crashed_the_engine_is_a_400_naming_the_field(server, body, param):
    s, client = server
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_edges_that_are_valid_are_served(server):
    s, client = server
    for body in ({"top_p": 1.2e-38, "temperature": 1.0}, {"temperature": 3.4028235e38},
                 {"repetition_penalty": 3.4028235e38, "temperature": 1.0}, {"top_k": 2**31 - 1},
                 {"stop_token_ids": [VOCAB - 1], "min_tokens": 1}, {"prompt": [0, VOCAB - 1]},
                 {"logprobs": 20, "echo": True}, {"min_p": 1.0, "temperature": 1.0}):
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, **body})
        assert r.status_code == 200, (body, r.text)
        assert not math.isnan(r.json()["usage"]["total_tokens"])
