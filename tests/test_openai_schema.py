"""Our answers against OpenAI's published schemas (openai/openai-openapi, trimmed to what is checked
here: tests/data/openai_schema/, with its source commit and the script that trims it): completions
and chat, streamed and not, with logprobs and tool calls, the models list, the Responses API's
response and stream events, and an error body. A real `ringserve serve` on the tiny model."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

SPEC = json.loads((Path(__file__).parent / "data" / "openai_schema" / "schemas.json").read_text())
SCHEMAS = SPEC["components"]["schemas"]
# Each Responses stream event's schema, by the `type` it carries.
EVENT_SCHEMAS = {s["properties"]["type"]["enum"][0]: name for name, s in SCHEMAS.items()
                 if name.endswith("Event") and "enum" in s.get("properties", {}).get("type", {})}
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"],
    "additionalProperties": False}}}


def check(obj: dict, schema: str) -> None:
    """obj is valid against components/schemas/<schema> (its $refs resolved in the document)."""
    validator = jsonschema.Draft202012Validator({**SPEC, "$ref": f"#/components/schemas/{schema}"})
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message[:300]}" for e in errors[:5])


@pytest.fixture(scope="module")
def client(tiny_server, no_segment_left_behind):
    with httpx.Client(base_url=tiny_server(), timeout=60) as c:
        yield c


def _post(c: httpx.Client, path: str, **body) -> dict:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _sse(c: httpx.Client, path: str, **body) -> list[tuple[str | None, dict]]:
    """(event name, data) of a stream, [DONE] left out."""
    r = c.post(path, json=dict(body, stream=True))
    assert r.status_code == 200, r.text
    out, name = [], None
    for line in r.text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((name, json.loads(line[6:])))
            name = None
    return out


def test_the_spec_is_what_the_trim_script_makes():
    assert SPEC["commit"] and len(EVENT_SCHEMAS) >= 12
    assert {"CreateCompletionResponse", "CreateChatCompletionStreamResponse", "Response"} <= set(SCHEMAS)


def test_completions(client):
    body = dict(prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=2)
    check(_post(client, "/v1/completions", **body), "CreateCompletionResponse")
    chunks = [d for _, d in _sse(client, "/v1/completions", **body)]
    assert chunks and all("usage" not in d for d in chunks)  # no key unless include_usage asked
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    for d in chunks:
        # The spec has no chunk schema: a chunk is checked as a completion, except that before the
        # last one finish_reason is null (as OpenAI's own streams send it).
        choices = [dict(ch, finish_reason=ch["finish_reason"] or "length") for ch in d["choices"]]
        check(dict(d, choices=choices), "CreateCompletionResponse")
    with_usage = [d for _, d in _sse(client, "/v1/completions", stream_options={"include_usage": True},
                                     **body)]
    assert with_usage[-1]["usage"]["completion_tokens"] == 4 and with_usage[-1]["choices"] == []


def test_chat(client):
    messages = [{"role": "user", "content": "hi"}]
    answer = _post(client, "/v1/chat/completions", messages=messages, max_tokens=4, logprobs=True,
                   top_logprobs=2)
    check(answer, "CreateChatCompletionResponse")
    assert answer["choices"][0]["message"]["refusal"] is None
    assert answer["choices"][0]["logprobs"]["refusal"] is None
    called = _post(client, "/v1/chat/completions", messages=messages, max_tokens=200, tools=[TOOL],
                   tool_choice="required")
    check(called, "CreateChatCompletionResponse")
    assert called["choices"][0]["message"]["tool_calls"]
    for extra in ({"logprobs": True, "top_logprobs": 1}, {"tools": [TOOL], "tool_choice": "required"},
                  {"stream_options": {"include_usage": True}}):
        chunks = _sse(client, "/v1/chat/completions", messages=messages, max_tokens=200, **extra)
        for _, d in chunks:
            check(d, "CreateChatCompletionStreamResponse")


def test_models_and_an_error(client):
    check(client.get("/v1/models").json(), "ListModelsResponse")
    bad = client.post("/v1/chat/completions", json={"messages": []})
    assert bad.status_code == 400
    check(bad.json(), "ErrorResponse")


def test_responses(client):
    text = _post(client, "/v1/responses", input="hi", max_output_tokens=4, instructions="be brief")
    check(text, "Response")
    tool = {"type": "function", **TOOL["function"]}
    called = _post(client, "/v1/responses", input="hi", max_output_tokens=200, tools=[tool],
                   tool_choice={"type": "function", "name": "pick"})
    check(called, "Response")
    assert called["output"][-1]["type"] == "function_call", called
    for body in (dict(input="hi", max_output_tokens=4), dict(input="hi", max_output_tokens=200, tools=[tool],
                                                             tool_choice="required")):
        events = _sse(client, "/v1/responses", **body)
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        for name, d in events:
            assert name == d["type"]
            check(d, EVENT_SCHEMAS[d["type"]])
