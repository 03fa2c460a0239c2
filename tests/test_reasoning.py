"""--reasoning-parser (server/reasoning.py): ``<think>…</think>`` into reasoning_content, as vLLM.

The parser on real token streams: the default model's tokenizer and the server's own output
path (OutputText over the incremental detokenizer), one token at a time, against the whole
text split at once. Then a real `ringserve serve --reasoning-parser qwen3 --tool-call-parser
hermes` on the default model with a Qwen3-style chat template (it reads enable_thinking): the
model does not think by itself, so a structured output (a regex) makes it write
``<think>…</think>``; streamed and whole answers, beside a tool call, and chat_template_kwargs.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from conftest import with_chat_template
from ringserve.server.output_text import OutputText
from ringserve.server.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning
from ringserve.server.tokenizer import Tokenizer

QWEN3_STYLE_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{%- endif %}
{% endif %}"""

TEXTS = [
    "<think>\nThe user asks for 12 x 7. That is 84.\n</think>\n\nIt is 84.",
    "<think>short</think>",
    "No thinking here, just an answer with a < and a </ in it.",
    "Before<think>inside</think>after</think>",
    "It is 84.\n</think>\n\nThe answer.",
    "<think>cut short before its end </thi",
    '<think>check the weather</think><tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.mark.parametrize("parser", list(REASONING_PARSERS))
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_tokens_split_as_the_whole_text(tokenizer, parser, text):
    """Token by token through OutputText, as a stream's deltas come: the pieces joined are the
    whole text's split, and no marker leaks into either part."""
    fmt = REASONING_PARSERS[parser]
    out = OutputText(tokenizer.decode_stream(True), [])
    stream = ReasoningStream(fmt)
    ids = tokenizer.encode(text, add_special_tokens=False)
    reasoning, content = "", ""
    for k, tid in enumerate(ids):
        piece = out.push([tid]) + (out.flush() if k == len(ids) - 1 else "")
        r, c = stream.push(piece, final=k == len(ids) - 1)
        reasoning, content = reasoning + r, content + c
    assert out.text == text
    whole = split_reasoning(fmt, text)
    assert (reasoning or None, content or None) == (whole[0] or None, whole[1] or None)
    if whole[0] is not None:  # (deepseek_r1 drops only a leading <think>)
        assert "</think>" not in whole[0] and (parser != "qwen3" or "<think>" not in whole[0])


def test_the_two_parsers_as_vllm():
    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
    assert split_reasoning(qwen3, TEXTS[0]) == ("\nThe user asks for 12 x 7. That is 84.\n", "\n\nIt is 84.")
    assert split_reasoning(r1, TEXTS[0]) == split_reasoning(qwen3, TEXTS[0])
    assert split_reasoning(qwen3, TEXTS[1]) == ("short", None)
    # qwen3 needs the opening tag; deepseek_r1 takes all before </think> as reasoning
    assert split_reasoning(qwen3, TEXTS[4]) == (None, TEXTS[4])
    assert split_reasoning(r1, TEXTS[4]) == ("It is 84.\n", "\n\nThe answer.")
    assert split_reasoning(qwen3, TEXTS[2]) == (None, TEXTS[2])
    assert split_reasoning(r1, TEXTS[2]) == (TEXTS[2], None)   # never closed: all reasoning
    assert split_reasoning(qwen3, TEXTS[3]) == ("inside", "Beforeafter</think>")
    assert split_reasoning(qwen3, TEXTS[5]) == ("cut short before its end </thi", None)


# ----------------------------------------------------------------------------- a real server

THINK = r"<think>\n[a-z ]{1,40}\n</think>\n\n"
ANSWER = r"The answer is (yes|no)\."
CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}\n'
        r"</tool_call>")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ASK = [{"role": "user", "content": "Is the sky blue? Think first."}]


@pytest.fixture(scope="module")
def model_dir(default_model_dir, tmp_path_factory) -> Path:
    """The default model with a Qwen3-style template (weights linked, not copied)."""
    return with_chat_template(default_model_dir, tmp_path_factory.mktemp("smol-qwen3-template") / "smol",
                              QWEN3_STYLE_TEMPLATE)


@pytest.fixture(scope="module")
def server(serve, model_dir, no_segment_left_behind) -> str:
    return serve(model_dir, "--workers", "1", "--max-model-len", "512", "--served-model-name", "x",
                 "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                 timeout=300).url


def _post(url: str, **body) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=300) as c:
        return c.post("/v1/chat/completions", json=dict(model="x", messages=ASK, temperature=0, **body))


def _streamed(url: str, **body) -> tuple[str, str, list[dict], str | None]:
    """(reasoning_content, content, tool call deltas, finish_reason) joined from the deltas."""
    r = _post(url, stream=True, **body)
    assert r.status_code == 200, r.text
    reasoning, content, calls, finish = "", "", [], None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                reasoning += ch["delta"].get("reasoning_content") or ""
                content += ch["delta"].get("content") or ""
                calls += ch["delta"].get("tool_calls") or []
                finish = ch["finish_reason"] or finish
    return reasoning, content, calls, finish


def test_forced_reasoning_is_split_streamed_and_whole(server):
    body = dict(max_tokens=60, structured_outputs={"regex": THINK + ANSWER})
    r = _post(server, **body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] in ("\n\nThe answer is yes.", "\n\nThe answer is no.")  # as vLLM: not stripped
    thought = message["reasoning_content"]
    assert thought.startswith("\n") and thought.endswith("\n") and thought.strip()
    assert _streamed(server, **body) == (thought, message["content"], [], "stop")
    # no <think> in the output: everything is content, and no reasoning_content key
    plain = _post(server, max_tokens=20, structured_outputs={"regex": ANSWER}).json()["choices"][0]
    assert "reasoning_content" not in plain["message"] and plain["message"]["content"].startswith("The")


def test_tool_calls_are_parsed_after_the_reasoning(server):
    body = dict(max_tokens=100, tools=[WEATHER], structured_outputs={"regex": THINK + CALL})
    r = _post(server, **body).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] == "\n\n"  # what </think> left
    assert r["message"]["reasoning_content"].strip()
    [call] = r["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
    reasoning, content, calls, finish = _streamed(server, **body)
    assert (reasoning, content, finish) == (r["message"]["reasoning_content"], "\n\n", "tool_calls")
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]


def test_chat_template_kwargs_reach_the_template(server):
    def prompt_tokens(**body) -> int:
        r = _post(server, max_tokens=1, **body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    thinking = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > thinking
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == thinking
    with httpx.Client(base_url=server, timeout=60) as c:  # /tokenize renders the same prompt
        counts = [c.post("/tokenize", json=dict(messages=ASK, **extra)).json()["count"]
                  for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})]
    assert counts == [thinking, prompt_tokens(chat_template_kwargs={"enable_thinking": False})]
    bad = _post(server, max_tokens=1, chat_template_kwargs={"add_generation_prompt": False})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "chat_template_kwargs"
    assert "add_generation_prompt" in bad.json()["error"]["message"]


def test_deepseek_r1_takes_an_unclosed_output_for_reasoning_unless_constrained(serve, model_dir):
    """Unconstrained, the model never writes </think>: all of it is reasoning (vLLM's
    deepseek_r1). A grammar that does not spell <think> is the answer, not reasoning."""
    url = serve(model_dir, "--workers", "1", "--max-model-len", "512", "--served-model-name", "x",
                "--reasoning-parser", "deepseek_r1", timeout=300).url
    free = _post(url, max_tokens=8).json()["choices"][0]["message"]
    assert free["content"] is None and free["reasoning_content"]
    assert _streamed(url, max_tokens=8)[:2] == (free["reasoning_content"], "")
    json_answer = _post(url, max_tokens=20, response_format={"type": "json_object"}).json()
    message = json_answer["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].lstrip().startswith("{")
    forced = _post(url, max_tokens=60, structured_outputs={"regex": THINK + ANSWER}).json()
    assert forced["choices"][0]["message"]["reasoning_content"].strip()


def test_offline_chat_passes_chat_template_kwargs(model_dir):
    """LLM.chat takes chat_template_kwargs as the HTTP field does: the Qwen3-style template's
    empty think block appears only with enable_thinking false."""
    from ringserve.server.llm import LLM, SamplingParams
    llm = LLM(model=str(model_dir), max_model_len=256)
    messages = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    thinking = llm.chat(messages, params)[0].prompt
    plain = llm.chat(messages, params, chat_template_kwargs={"enable_thinking": False})[0].prompt
    assert "<think>" not in thinking and "<think>" in plain and "</think>" in plain
