"""What a real client touches beyond generating (issue 17 item 6), against a real `ringserve serve`
on the tiny model: echo with max_tokens 0, GET /v1/models/{id}, X-Request-Id, system_fingerprint."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from ringserve.server.protocol import SYSTEM_FINGERPRINT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(tiny_server, no_segment_left_behind) -> str:
    return tiny_server("--served-model-name", "tiny", "org/tiny-v1")


def _events(r: httpx.Response) -> list[dict]:
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_only(url):
    prompt = [5, 17, 33, 40, 101]
    with httpx.Client(base_url=url, timeout=60) as c:
        body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert usage == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
        assert choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt)          # the prompt's tokens, nothing generated
        assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
        detok = c.post("/detokenize", json={"tokens": prompt}).json()["prompt"]
        assert choice["text"] == detok == "".join(lp["tokens"])
        # The same logprobs as an echo that does generate (its first entries are the prompt's).
        longer = c.post("/v1/completions", json=dict(body, max_tokens=3)).json()["choices"][0]
        assert longer["logprobs"]["token_logprobs"][:5] == pytest.approx(lp["token_logprobs"])
        assert longer["text"].startswith(detok) and len(longer["logprobs"]["tokens"]) == 8
        # Streamed: one chunk per choice with the prompt, then the usage.
        events = _events(c.post("/v1/completions", json=dict(
            body, n=2, stream=True, stream_options={"include_usage": True})))
        texts = {e["choices"][0]["index"]: e["choices"][0] for e in events if e["choices"]}
        assert sorted(texts) == [0, 1]
        assert all(t["text"] == detok and t["finish_reason"] == "length" for t in texts.values())
        assert events[-1]["usage"]["completion_tokens"] == 0
        # Without echo, max_tokens 0 is still a 400 naming the field.
        bad = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_models_by_id(url):
    with httpx.Client(base_url=url, timeout=30) as c:
        for name in ("tiny", "org/tiny-v1"):  # a served name may hold a "/"
            r = c.get(f"/v1/models/{name}")
            assert r.status_code == 200, r.text
            card = r.json()
            assert card["id"] == name and card["object"] == "model" and card["max_model_len"] == 256
        r = c.get("/v1/models/nope")
        assert r.status_code == 404
        assert r.json()["error"] == {"message": "The model `nope` does not exist.",
                                     "type": "invalid_request_error", "param": "model",
                                     "code": "model_not_found"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    assert client.models.retrieve("org/tiny-v1").id == "org/tiny-v1"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("missing")


async def _same_id_at_once(url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return await asyncio.gather(*(
            c.post("/v1/chat/completions", headers={"X-Request-Id": "same"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                         "ignore_eos": True}) for _ in range(n)))


def test_x_request_id_is_echoed_and_names_the_request(url):
    with httpx.Client(base_url=url, timeout=60) as c:
        body = {"prompt": [5, 6, 7], "max_tokens": 2, "ringserve_trace": True}
        r = c.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
        assert r.status_code == 200, r.text
        # The header comes back unchanged; the body's id is vLLM's `cmpl-<header>`.
        assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
        assert r.json()["ringserve_trace"]["request_id"] == "cmpl-abc-123"
        # Requests with the same id at once: all run (engine ids are the server's own).
        both = asyncio.run(_same_id_at_once(url, 4))
        assert [b.status_code for b in both] == [200] * 4, [b.text for b in both]
        assert [b.json()["id"] for b in both] == ["chatcmpl-same"] * 4
        # None given: one is made and sent back, the same as the body's id (and every chunk's).
        r = c.post("/v1/completions", json={"prompt": [5], "max_tokens": 2, "stream": True})
        assert r.headers["x-request-id"].startswith("cmpl-")
        assert {e["id"] for e in _events(r)} == {r.headers["x-request-id"]}
        bad = c.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 300})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
        assert c.post("/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 200


def test_system_fingerprint_on_every_response_and_chunk(url):
    assert SYSTEM_FINGERPRINT.startswith("fp_ringserve")
    with httpx.Client(base_url=url, timeout=60) as c:
        for path, body in (("/v1/completions", {"prompt": [5, 6], "max_tokens": 3}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})):
            r = c.post(path, json=body)
            assert r.json()["system_fingerprint"] == SYSTEM_FINGERPRINT
            events = _events(c.post(path, json=dict(body, stream=True, ringserve_trace=True,
                                                    stream_options={"include_usage": True})))
            assert len(events) >= 4
            assert all(e["system_fingerprint"] == SYSTEM_FINGERPRINT for e in events), events
