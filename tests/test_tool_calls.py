"""Tool calling (issue 17 item 3) through a real `ringserve serve` on the default model, with a
Hermes-style chat template that shows the tools (the default model's own template ignores
them): tools and tool results reach the template; "required" and named choices are
constrained to valid calls; "auto" parses the model's text (`--tool-call-parser hermes`,
`llama3_json`, `phi4_mini_json` and `pythonic`, the last under a Gemma 3 style template);
streamed and non-streamed answers carry the same calls, in OpenAI's shapes."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from conftest import with_chat_template

pytestmark = pytest.mark.slow

# vLLM's way: the default model's template ignores tools, so `--chat-template` gives it one that
# renders them (ringserve serve --chat-template examples/tool_chat_template_smollm2.jinja).
HERMES_TEMPLATE = (Path(__file__).parent.parent / "examples" / "tool_chat_template_smollm2.jinja").read_text()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(default_model_dir, tmp_path_factory) -> Path:
    """The default model with a chat template that renders tools (weights linked, not copied)."""
    return with_chat_template(default_model_dir, tmp_path_factory.mktemp("smol-tools") / "smol-tools",
                              HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def hermes(serve, model_dir, no_segment_left_behind) -> str:
    return serve(model_dir, "--workers", "1", "--max-model-len", "1024",
                 "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--served-model-name", "x",
                 timeout=300).url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=300)


def _streamed(url: str, **body) -> tuple[list[dict], str | None, str, list[dict]]:
    """(tool calls joined from the deltas as the openai client joins them, finish_reason,
    content, every delta) of a streamed chat request."""
    with httpx.Client(base_url=url, timeout=300) as c:
        r = c.post("/v1/chat/completions", json=dict(body, stream=True))
    assert r.status_code == 200, r.text
    calls: dict[int, dict] = {}
    finish, content, deltas = None, "", []
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        for ch in chunk["choices"]:
            d = ch["delta"]
            deltas.append(d)
            content += d.get("content") or ""
            finish = ch["finish_reason"] or finish
            for tc in d.get("tool_calls") or []:
                if "id" in tc:  # a call's first delta: OpenAI's shape
                    assert tc["type"] == "function" and tc["function"]["arguments"] == ""
                    calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"],
                                          "arguments": ""}
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                    calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return [calls[i] for i in sorted(calls)], finish, content, deltas


def _calls(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


def _valid(calls: list[dict]) -> None:
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_tools_and_tool_results_reach_the_template(hermes):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"}]
    with httpx.Client(base_url=hermes, timeout=60) as c:
        ids = c.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
        text = c.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '"name": "get_weather"' in text and '"description": "The time in a time zone"' in text
    # the earlier call's arguments as a JSON object (not a string), the result as the user's
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert "<tool_response>\n22 degrees and sunny\n</tool_response>" in text
    # and a completion with them runs
    r = _client(hermes).chat.completions.create(model="x", messages=messages, tools=TOOLS,
                                                tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_named_tool_choice_is_a_valid_call(hermes):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = _client(hermes).chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                                tool_choice=choice, max_tokens=100, temperature=0)
    msg = r.choices[0].message
    calls = _calls(msg)
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and msg.content is None
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    assert r.choices[0].finish_reason == "stop"  # OpenAI's for a forced function
    _valid(calls)
    streamed, finish, content, deltas = _streamed(hermes, messages=ASK, tools=TOOLS,
                                                  tool_choice=choice, max_tokens=100, temperature=0)
    assert [{k: c[k] for k in ("name", "arguments")} for c in streamed] == calls
    assert finish == "stop" and content == ""
    assert sum(1 for d in deltas if d.get("tool_calls")) > 2  # arguments stream as they come


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_choice_gives_valid_calls(hermes, parallel):
    body = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                temperature=0, parallel_tool_calls=parallel)
    r = _client(hermes).chat.completions.create(model="x", **body)
    calls = _calls(r.choices[0].message)
    assert calls and r.choices[0].finish_reason == "tool_calls"
    if not parallel:
        assert len(calls) == 1
    _valid(calls)
    assert len({c.id for c in r.choices[0].message.tool_calls}) == len(calls)
    streamed, finish, content, _ = _streamed(hermes, **body)
    assert [{k: c[k] for k in ("name", "arguments")} for c in streamed] == calls
    assert finish == "tool_calls" and content == ""
    # Sampled (with these seeds, one of the 12 makes two calls when it may): each choice's calls
    # are valid, and without parallel_tool_calls there is one per choice.
    r = _client(hermes).chat.completions.create(model="x", **dict(body, temperature=1.0, seed=1,
                                                                  n=12, max_tokens=300))
    for ch in r.choices:
        calls = _calls(ch.message)
        assert calls and ch.finish_reason == "tool_calls", ch
        _valid(calls)
        assert parallel or len(calls) == 1


# The tiny model does not call tools of itself: a regex makes it write a call in the parser's
# format (the constraint is the request's own, allowed with "auto"), with some text before.
HERMES_CALL = (r'Let me check\.<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>')


def test_auto_parses_hermes_calls(hermes):
    body = dict(messages=ASK, tools=TOOLS, max_tokens=100, temperature=0,
                structured_outputs={"regex": HERMES_CALL})
    r = _client(hermes).chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                                max_tokens=100, temperature=0,
                                                extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    msg = r.choices[0].message
    calls = _calls(msg)
    assert msg.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather"]
    _valid(calls)
    streamed, finish, content, _ = _streamed(hermes, **body)
    assert [{k: c[k] for k in ("name", "arguments")} for c in streamed] == calls
    assert (finish, content) == ("tool_calls", "Let me check.")
    # No call in the text: it is the content, finish_reason as it ended.
    plain = dict(body, structured_outputs={"regex": "It is (sunny|rainy)\\."})
    r = _client(hermes).chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                                max_tokens=20, temperature=0,
                                                extra_body={"structured_outputs":
                                                            plain["structured_outputs"]})
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    streamed, finish, content, _ = _streamed(hermes, **plain)
    assert (streamed, finish, content) == ([], "stop", r.choices[0].message.content)


def test_auto_parses_llama3_json_calls(serve, model_dir):
    url = serve(model_dir, "--workers", "1", "--max-model-len", "1024",
                "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice", "--served-model-name", "x",
                timeout=300).url
    regex = r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}'
    body = dict(messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                structured_outputs={"regex": regex})
    r = _client(url).chat.completions.create(model="x", messages=ASK, tools=TOOLS, max_tokens=60,
                                             temperature=0,
                                             extra_body={"structured_outputs": {"regex": regex}})
    calls = _calls(r.choices[0].message)
    assert [c["name"] for c in calls] == ["get_time"] and r.choices[0].message.content is None
    assert json.loads(calls[0]["arguments"])["zone"] in ("UTC", "CET")
    assert r.choices[0].finish_reason == "tool_calls"
    streamed, finish, content, _ = _streamed(url, **body)
    assert [{k: c[k] for k in ("name", "arguments")} for c in streamed] == calls
    assert (finish, content) == ("tool_calls", "")


def test_auto_parses_phi4_mini_json_calls(serve, model_dir):
    """Phi-4-mini writes functools[{"name", "arguments"}, ...] (vLLM's phi4_mini_json): two calls
    in one array, an argument holding "]" whole, the text before it content, streamed the same."""
    url = serve(model_dir, "--workers", "1", "--max-model-len", "1024",
                "--tool-call-parser", "phi4_mini_json", "--enable-auto-tool-choice",
                "--served-model-name", "x", timeout=300).url
    regex = (r'Checking\. functools\[\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)\]"\}\}, '
             r'\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "celsius"\}\}\]')
    body = dict(messages=ASK, tools=TOOLS, max_tokens=80, temperature=0, structured_outputs={"regex": regex})
    r = _client(url).chat.completions.create(model="x", messages=ASK, tools=TOOLS, max_tokens=80,
                                             temperature=0,
                                             extra_body={"structured_outputs": {"regex": regex}})
    calls = _calls(r.choices[0].message)
    assert [c["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[0]["arguments"])["zone"] in ("UTC]", "CET]")
    assert json.loads(calls[1]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    assert r.choices[0].message.content == "Checking. " and r.choices[0].finish_reason == "tool_calls"
    streamed, finish, content, _ = _streamed(url, **body)
    assert [{k: c[k] for k in ("name", "arguments")} for c in streamed] == calls
    assert (finish, content) == ("tool_calls", "Checking. ")
# Gemma 3's turns, with tools shown and calls written as a Python list (the shape of vLLM's
# examples/tool_chat_template_gemma3_pythonic.jinja, which `--tool-call-parser pythonic` reads)
GEMMA3_PYTHONIC_TEMPLATE = """\
{{ bos_token or '' }}
{%- for message in messages %}
{%- set role = {'assistant': 'model', 'tool': 'user'}.get(message.role, message.role) %}
{{- '<start_of_turn>' + role + '\n' }}
{%- if loop.first and tools %}Tools are available. To call them, answer only with a python list of \
calls: [name(arg=value), ...]
{{ tools | tojson }}

{% endif %}
{%- if message.tool_calls %}[
{%- for tc in message.tool_calls %}{{ tc.function.name }}(
{%- for k, v in tc.function.arguments.items() %}{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}\
{% endfor %})\
{{ ', ' if not loop.last }}{% endfor %}]
{%- endif %}
{%- if message.role == 'tool' %}<tool_response>
{{ message.content }}</tool_response>{% else %}{{ (message.content or '') | trim }}{% endif %}<end_of_turn>
{% endfor %}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


def test_auto_parses_pythonic_calls(serve, default_model_dir, tmp_path_factory):
    """`--tool-call-parser pythonic` (vLLM's, for Gemma 3): the answer `[get_time(zone="UTC")]`
    is one call with JSON arguments, streamed the same; an answer that is no list of calls
    stays content."""
    folder = with_chat_template(default_model_dir, tmp_path_factory.mktemp("gemma-tools") / "m",
                                GEMMA3_PYTHONIC_TEMPLATE)
    url = serve(folder, "--workers", "1", "--max-model-len", "1024", "--tool-call-parser", "pythonic",
                "--enable-auto-tool-choice",
                "--served-model-name", "x", timeout=300).url
    with httpx.Client(base_url=url, timeout=60) as c:
        prompt = c.post("/tokenize", json=dict(model="x", messages=ASK, tools=TOOLS)).json()
    assert prompt["count"] > 0
    regex = r'\[get_time\(zone="(UTC|CET)"\), get_weather\(city="Paris", unit="celsius"\)\]'
    body = dict(messages=ASK, tools=TOOLS, max_tokens=60, temperature=0, structured_outputs={"regex": regex})
    r = _client(url).chat.completions.create(model="x", messages=ASK, tools=TOOLS, max_tokens=60,
                                             temperature=0,
                                             extra_body={"structured_outputs": {"regex": regex}})
    calls = _calls(r.choices[0].message)
    assert [c["name"] for c in calls] == ["get_time", "get_weather"] and r.choices[0].message.content is None
    assert json.loads(calls[1]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    _valid(calls)
    assert r.choices[0].finish_reason == "tool_calls"
    streamed, finish, content, _ = _streamed(url, **body)
    assert [{k: c[k] for k in ("name", "arguments")} for c in streamed] == calls
    assert (finish, content) == ("tool_calls", "")
    plain = dict(body, structured_outputs={"regex": r"\[1, 2\] is a list\."})
    streamed, finish, content, _ = _streamed(url, **plain)
    assert (streamed, finish, content) == ([], "stop", "[1, 2] is a list.")
    # the call written back into the conversation renders as the model wrote it
    history = ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    with httpx.Client(base_url=url, timeout=60) as c:
        r2 = c.post("/v1/chat/completions", json=dict(model="x", messages=history, tools=TOOLS,
                                                      max_tokens=1, temperature=0))
    assert r2.status_code == 200, r2.text


@pytest.mark.parametrize("text, calls", [
    ('[f(a=1, b="x\\n\\"y"), g()]', [("f", {"a": 1, "b": "x\n\"y"}), ("g", {})]),
    ('  [f(xs=[1, 2.5, None, True], d={"k": -3})]\n', [("f", {"xs": [1, 2.5, None, True], "d": {"k": -3}})]),
    ("[f(1)]", None),                 # positional arguments: not a call vLLM reads
    ("[f(a=b)]", None),               # a variable, not a literal
    ("[f(a=1), 3]", None),            # not every item a call
    ("[a.b(c=1)]", None),             # not a plain name
    ("[]", None), ("Sure: [f(a=1)]", None), ("[f(a=1)", None), ("[f(**{'a': 1})]", None),
    ("[" * 300 + "]" * 300, None),    # nested past the parser's limit
])
def test_pythonic_parser_reads_calls_and_leaves_the_rest_content(text, calls):
    from ringserve.server import tool_calls as T
    content, got = T.parse_auto("pythonic", text)
    if calls is None:
        assert (content, got) == (text, [])
    else:
        assert content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls


BAD_TOOLS = [  # (body fields, param)
    ({"tools": TOOLS}, "tool_choice"),                     # auto without a parser (llama server has one)
    ({"tool_choice": "required"}, "tool_choice"),          # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),  # the missing field itself
]


def test_bad_tool_requests_are_400_naming_the_field(serve, model_dir, hermes):
    plain = serve(model_dir, "--workers", "1", "--max-model-len", "1024", timeout=300).url
    with httpx.Client(timeout=60) as c:
        for fields, param in BAD_TOOLS:
            url = plain if fields.get("tools") == TOOLS and "tool_choice" not in fields else hermes
            r = c.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **fields})
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == param, (fields, r.json())
        assert c.post(hermes + "/v1/chat/completions",
                      json={"messages": ASK, "max_tokens": 2}).status_code == 200


def test_llm_chat_passes_tools_to_the_template(model_dir):
    """Offline: LLM.chat(tools=...) renders them (as vLLM's LLM.chat); a call constrained to a
    function's schema is valid."""
    from ringserve.ipc.sampling_params import SamplingParams
    from ringserve.ipc.structured import StructuredOutputsParams
    from ringserve.server.llm import LLM
    llm = LLM(model=str(model_dir), max_model_len=1024)
    params = SamplingParams(max_tokens=100, temperature=0, structured_outputs=
                            StructuredOutputsParams(json=SCHEMAS["get_weather"]))
    out = llm.chat(ASK, params, tools=TOOLS)[0]
    assert '"name": "get_weather"' in out.prompt and "<tools>" in out.prompt
    _valid([{"name": "get_weather", "arguments": out.outputs[0].text}])
    assert "<tools>" not in llm.chat(ASK, SamplingParams(max_tokens=1))[0].prompt


# A constrained call cut by a stop string or max_tokens (issue 33 item 5): no call, the text so
# far as content, the finish reason it ended with; streamed, a whole stream ending in [DONE].
CUT_CALLS = [  # (tool_choice, cut, finish_reason)
    ("required", {"stop": ["parameters"]}, "stop"),
    ("required", {"max_tokens": 6}, "length"),
    ({"type": "function", "function": {"name": "get_weather"}}, {"stop": ["unit"]}, "stop"),
    ({"type": "function", "function": {"name": "get_weather"}}, {"max_tokens": 4}, "length"),
]


@pytest.mark.parametrize("tool_choice,cut,finish", CUT_CALLS)
def test_a_constrained_call_cut_short_is_content(hermes, tool_choice, cut, finish):
    body = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                **{"max_tokens": 100, **cut})
    r = _client(hermes).chat.completions.create(model="x", **body)
    ch = r.choices[0]
    assert ch.finish_reason == finish and ch.message.tool_calls is None, ch
    text = ch.message.content
    assert text and ("{" in text or "[" in text), text  # the call's JSON so far
    with pytest.raises(ValueError):
        json.loads(text)  # not a whole call
    if "stop" in cut:
        assert cut["stop"][0] not in text and ch.stop_reason == cut["stop"][0]
    with httpx.Client(base_url=hermes, timeout=300) as c:
        raw = c.post("/v1/chat/completions", json=dict(body, stream=True)).text
    assert raw.endswith("data: [DONE]\n\n") and '"error"' not in raw, raw[-500:]
    streamed, s_finish, content, _ = _streamed(hermes, **body)
    assert s_finish == finish
    if tool_choice == "required":  # held back until the end, then sent as content
        assert (streamed, content) == ([], text)
    else:  # a named call's arguments went out as they came
        assert content == "" and [c["arguments"] for c in streamed] == [text]


def test_auto_call_cut_inside_tool_call_is_content(hermes):
    body = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=12,
                structured_outputs={"regex": HERMES_CALL})
    r = _client(hermes).chat.completions.create(
        model="x", messages=ASK, tools=TOOLS, temperature=0, max_tokens=12,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.tool_calls is None
    assert ch.message.content.startswith("Let me check.<tool_call>"), ch.message.content
    streamed, finish, content, _ = _streamed(hermes, **body)
    assert (streamed, finish, content) == ([], "length", ch.message.content)
    # a stop string inside the call: the same, finishing with "stop"
    streamed, finish, content, _ = _streamed(hermes, **dict(body, max_tokens=100, stop=["arguments"]))
    assert streamed == [] and finish == "stop" and content.startswith("Let me check.<tool_call>")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "phi4_mini_json"])
def test_model_output_nested_past_the_recursion_limit_is_content(parser):
    """A model may write any text: a call nested 5,000 deep (past Python's decoder's recursion
    limit) is no call, and the text stays content, instead of a RecursionError (a 500)."""
    from ringserve.server import tool_calls as T
    deep = "[" * 5000 + "]" * 5000
    text = {"hermes": f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>',
            "llama3_json": f'{{"name": "f", "parameters": {deep}}}',
            "phi4_mini_json": f'functools[{{"name": "f", "arguments": {deep}}}]'}[parser]
    assert T.parse_auto(parser, text) == (text, [])
    assert T.constrained_calls(T.ToolPlan(mode="required"), f'[{{"name": "f", "parameters": {deep}}}]') == []
