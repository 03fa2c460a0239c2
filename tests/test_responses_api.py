"""POST /v1/responses through a real `ringserve serve` (the tiny model): the openai client's
`responses.create` for text, input items, tools, a JSON schema and reasoning, streamed and not; the
answer is chat's for the same messages (a translation, not a second path); every bad field a 400
naming it, the server still up; X-Request-Id as on chat."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

TOOL = {"type": "function", "name": "pick", "description": "pick one",
        "parameters": {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"],
                       "additionalProperties": False}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def url(tiny_server, no_segment_left_behind) -> str:
    return tiny_server()


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _chat(url: str, messages: list[dict], **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=dict(messages=messages, **body), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_text_is_chats_answer_whole_and_streamed(url, client):
    r = client.responses.create(model="", input="hello", instructions="be brief", max_output_tokens=6,
                                temperature=0)
    chat = _chat(url, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
                 max_tokens=6, temperature=0)
    assert r.object == "response" and r.id.startswith("resp-") and r.model == chat["model"]
    assert r.output_text == chat["choices"][0]["message"]["content"] and r.output_text.strip()
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat["usage"]["prompt_tokens"], 6)
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].status == "incomplete"
    assert r.instructions == "be brief" and r.max_output_tokens == 6 and r.store is False
    events = list(client.responses.create(model="", input="hello", instructions="be brief",
                                          max_output_tokens=6, temperature=0, stream=True))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == (TEXT_EVENTS + ["response.output_text.delta"] * len(deltas) + TEXT_END
                     + ["response.incomplete"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == r.output_text == events[-4].text
    last = events[-1].response
    assert last.output_text == r.output_text and last.usage.output_tokens == 6
    assert events[0].response.status == "in_progress" and events[2].item.id == last.output[0].id


def test_input_items_become_chats_messages(url, client):
    items = [{"role": "developer", "content": "rules"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                             {"type": "input_text", "text": "b"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
             {"type": "function_call", "call_id": "call_1", "name": "pick", "arguments": '{"x": "a"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "done"},
             {"role": "user", "content": "again"}]
    r = client.responses.create(model="", input=items, max_output_tokens=3, temperature=0)
    messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "a\nb"},
                {"role": "assistant", "content": "ok"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "pick", "arguments": '{"x": "a"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "done"},
                {"role": "user", "content": "again"}]
    chat = _chat(url, messages, max_tokens=3, temperature=0)
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.output_text == chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize("choice", [{"type": "function", "name": "pick"}, "required"])
def test_tool_calls_whole_and_streamed(client, choice):
    r = client.responses.create(model="", input="pick", tools=[TOOL], tool_choice=choice,
                                max_output_tokens=200, temperature=0)
    [call] = [o for o in r.output if o.type == "function_call"] or [r]
    assert call.name == "pick" and json.loads(call.arguments)["x"] in ("a", "b")
    assert call.call_id.startswith("call_") and r.status == "completed" and r.tools[0].name == "pick"
    events = list(client.responses.create(model="", input="pick", tools=[TOOL], tool_choice=choice,
                                          max_output_tokens=200, temperature=0, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] and added[0].item.name == "pick"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == call.arguments
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == call.arguments


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    r = client.responses.create(model="", input="yes?", max_output_tokens=200, text={
        "format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    assert json.loads(r.output_text)["answer"] in ("yes", "no")
    assert r.text.format.type == "json_schema"


def test_reasoning_items(tiny_server):
    """deepseek_r1: an output that never closes <think> is all reasoning (as on chat)."""
    c = openai.OpenAI(base_url=tiny_server("--reasoning-parser", "deepseek_r1") + "/v1", api_key="x")
    r = c.responses.create(model="", input="tell me", max_output_tokens=5, temperature=0)
    assert [o.type for o in r.output] == ["reasoning"] and r.output_text == ""
    thought = r.output[0].content[0].text
    assert thought.strip()
    events = list(c.responses.create(model="", input="tell me", max_output_tokens=5, temperature=0,
                                     stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning"]


BAD = [  # (body, the param the 400 names)
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**12}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "8"}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "top_p": 2}, "top_p"),
    ({"input": "x", "top_p": 0}, "top_p"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [dict(TOOL, name="")]}, "tools[0].name"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}},
     "tool_choice.function.name"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 5}}}},
     "text.format.schema"),
    ({"input": "x", "previous_response_id": "resp-1"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "stream": "yes"}, "stream"),
]


def test_bad_fields_are_400s_naming_them_and_the_server_stays_up(url):
    with httpx.Client(base_url=url, timeout=60) as c:
        for body, param in BAD:
            r = c.post("/v1/responses", json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
            # in the Responses API's words, not chat's it was translated into
            assert not re.search(r"messages|max_completion_tokens|response_format|\.function\.",
                                 error["message"]), error
        nan = c.post("/v1/responses", content=b'{"input": "x", "temperature": NaN}')
        assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature", nan.text
        assert c.post("/v1/responses", json={"input": "x", "model": "nope"}).status_code == 404
        ok = c.post("/v1/responses", json={"input": "x", "max_output_tokens": 2},
                    headers={"X-Request-Id": "my-req-42"})
        assert ok.status_code == 200, ok.text
        assert ok.headers["x-request-id"] == "my-req-42" and ok.json()["id"] == "resp-my-req-42"
