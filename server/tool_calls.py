"""Tool calling for chat: `tools`, `tool_choice`, `parallel_tool_calls` (OpenAI's names), as vLLM
serves them.

- The tools reach the chat template (`tools=`, as transformers passes them), and so do earlier
  calls (`message.tool_calls`) and tool results (`role: "tool"`).
- `tool_choice` "required" or a named function: the output is constrained (structured outputs,
  ipc/structured.py) to a valid call: for "required" a JSON array of `{"name", "parameters"}`
  (each valid against its function's schema; one item only without parallel_tool_calls), for
  a named function its arguments object. The output is the call, never text.
- "auto" (the default when tools are given, as OpenAI): the model writes text in its family's
  tool-call format (hermes, llama3_json, pythonic), which a parser (`--tool-call-parser`, as
  vLLM's flag) turns into `message.tool_calls`; without a parser, "auto" is a 400 (vLLM
  answers the same).
- "none": tools are shown to the template, no call is parsed.
A response with calls has `finish_reason` "tool_calls" (a named choice keeps "stop", as OpenAI).
A constrained answer cut before its call is whole (a `stop` string, `max_tokens`) has no calls:
its text so far is the content, with the finish reason it ended with (vLLM's behaviour); a
streamed named call has sent its arguments as they came, so it ends with them as they are.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ringserve.ipc.structured import StructuredOutputsParams
from ringserve.server import json_text
from ringserve.server import protocol as P


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """What a chat request's tools mean for it."""
    mode: str                                   # "none", "auto", "required" or "named"
    template_tools: list[dict] | None = None    # for the chat template (OpenAI's shape)
    constraint: StructuredOutputsParams | None = None  # required / named
    constraint_param: str = "tools"             # the field a 400 about the constraint names
    name: str | None = None                     # named: the function
    parser: str | None = None                   # auto: the --tool-call-parser


def plan(req: P.ChatCompletionRequest, parser: str | None, max_json_depth: int) -> ToolPlan:
    """The request's tool mode, or a 400 naming the field."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise P.bad_request("tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise P.bad_request("tools must have different function names", param="tools")
    tools = template_tools(req.tools, max_json_depth)
    if choice == "none":
        return ToolPlan("none", tools)
    if choice is None or choice == "auto":
        if parser is None:
            raise P.bad_request('"auto" tool choice (the default with tools) needs the server '
                                "started with --enable-auto-tool-choice and --tool-call-parser; or "
                                'ask for tool_choice "required", a named function or "none"',
                                param="tool_choice")
        return ToolPlan("auto", tools, parser=parser)
    if choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": t.function.name},
                                              "parameters": _schema(t.function)},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in req.tools]}}
        if req.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return ToolPlan("required", tools, StructuredOutputsParams(json=calls))
    assert isinstance(choice, P.NamedToolChoice)
    at = next((i for i, t in enumerate(req.tools) if t.function.name == choice.function.name), None)
    if at is None:
        raise P.bad_request(f"tool_choice names the function {choice.function.name!r}, which "
                            "is not in tools", param="tool_choice.function.name")
    tool = req.tools[at]
    return ToolPlan("named", tools, StructuredOutputsParams(json=_schema(tool.function)),
                    f"tools[{at}].function.parameters", name=tool.function.name)


def template_tools(tools: list[P.ChatTool], max_json_depth: int) -> list[dict]:
    """The tools as the chat template gets them (OpenAI's shape), each one's parameters schema
    at most max_json_depth deep (templates `tojson` it; a constraint compiles it)."""
    out = []
    for i, t in enumerate(tools):
        if t.function.parameters is not None:
            try:
                json_text.check_depth(t.function.parameters, max_json_depth,
                                      f"tools[{i}].function.parameters")
            except json_text.TooDeep as e:
                raise P.bad_request(str(e), param=e.param) from None
        out.append({"type": "function",
                    "function": {k: v for k, v in (("name", t.function.name),
                                                   ("description", t.function.description),
                                                   ("parameters", t.function.parameters))
                                 if v is not None}})
    return out


def _schema(f: P.FunctionDefinition) -> dict[str, Any]:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


# --- turning output text into calls -------------------------------------------------------------

def constrained_calls(tp: ToolPlan, text: str) -> list[P.ToolCall]:
    """The calls of a required / named answer (its text is the constrained JSON); none when the
    text is not a whole call: a stop string or max_tokens cut it before the grammar was done."""
    try:
        value = json.loads(text)
        if tp.mode == "named":
            if not isinstance(value, dict):
                return []
            return [P.ToolCall(id=new_call_id(), function=P.FunctionCall(tp.name or "", text))]
        return [P.ToolCall(id=new_call_id(), function=P.FunctionCall(
                    str(c["name"]), json.dumps(c["parameters"], ensure_ascii=False)))
                for c in value]
    # RecursionError: a model's output nested past the decoder's recursion limit is no call
    except (ValueError, KeyError, TypeError, RecursionError):  # cut (or a stop string inside a string)
        return []


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# Where a call begins, for the parsers whose calls follow a marker (content may come before it)
MARKERS = {"hermes": "<tool_call>", "phi4_mini_json": "functools["}
_PARSE_ERRORS = (ValueError, KeyError, TypeError, AttributeError, RecursionError)


def parse_auto(parser: str, text: str) -> tuple[str | None, list[P.ToolCall]]:
    """(content, calls) of a model's text in its family's format; text that does not parse is
    content, as vLLM's parsers leave it. RecursionError: a model's output nested past the
    decoder's recursion limit is no call."""
    if parser == "pythonic":
        return _parse_pythonic(text)
    start = text.find(MARKERS[parser]) if parser in MARKERS else 0
    if start < 0:
        return text, []
    try:
        if parser == "hermes":
            # Qwen / Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one per call
            return text[:start] or None, [_call(json.loads(m)) for m in _HERMES.findall(text[start:])]
        if parser == "phi4_mini_json":
            # Phi-4-mini: functools[{"name": ..., "arguments": {...}}, ...] (vLLM's phi4_mini_json;
            # decoded as JSON from the "[", so an argument holding "]" is whole)
            calls, _ = json.JSONDecoder().raw_decode(text, start + len("functools"))
            if not isinstance(calls, list):
                return text, []
            return text[:start] or None, [_call(c) for c in calls]
        return _llama3_json(text)
    except _PARSE_ERRORS:
        return text, []


def _llama3_json(text: str) -> tuple[str | None, list[P.ToolCall]]:
    """llama3_json: the answer is {"name": ..., "parameters": {...}} (after an optional
    <|python_tag|>), several separated by ";"."""
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        obj, end = decoder.raw_decode(body, at)
        calls.append(_call(obj))
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


def _parse_pythonic(text: str) -> tuple[str | None, list[P.ToolCall]]:
    """vLLM's pythonic parser (Gemma 3 with examples/tool_chat_template_gemma3_pythonic.jinja,
    Llama 3.2/4): the whole answer is a Python list of calls with keyword arguments of literal
    values, ``[get_weather(city="Paris", days=3), now()]``; read with ast, never evaluated."""
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(k.arg is not None for k in node.keywords)):
                return text, []
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append(P.ToolCall(id=new_call_id(), function=P.FunctionCall(
                node.func.id, json.dumps(args, ensure_ascii=False))))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return text, []
    return None, calls


def _call(obj: Any) -> P.ToolCall:
    """One call object: its arguments under "arguments" (or "parameters", as Llama 3 writes them)."""
    args = obj["arguments"] if "arguments" in obj else obj["parameters"]
    return P.ToolCall(id=new_call_id(), function=P.FunctionCall(
        str(obj["name"]), args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))


# --- streaming ------------------------------------------------------------------------------

@dataclass
class ToolStream:
    """One choice's streamed deltas in a tool mode. Content before a tool call streams as it
    comes; from the first character that may begin a call, text is held back until the end,
    then sent as OpenAI streams calls (per call: id, type and name with arguments "", then the
    arguments). A named choice streams its arguments as they come."""
    tp: ToolPlan
    text: str = ""
    sent: int = 0                     # characters of text sent as content
    held: bool = False                # a call may have begun: nothing more is sent as content
    calls: list[P.ToolCall] = field(default_factory=list)

    def push(self, delta: str) -> list[P.DeltaMessage]:
        self.text += delta
        if self.tp.mode == "named":
            out = []
            if not self.calls:  # the head: id, type, name
                self.calls.append(P.ToolCall(id=new_call_id(),
                                             function=P.FunctionCall(self.tp.name or "", "")))
                out.append(_head(0, self.calls[0]))
            if delta:
                out.append(P.DeltaMessage(tool_calls=[P.DeltaToolCall(
                    0, function=P.DeltaFunctionCall(arguments=delta))]))
            return out
        if self.tp.mode != "auto" or self.held:
            return []
        safe = self._safe_end()
        piece, self.sent = self.text[self.sent:safe], safe
        return [P.DeltaMessage(content=piece)] if piece else []

    def _safe_end(self) -> int:
        """How much of text is surely content (no call can begin before it)."""
        marker = MARKERS.get(self.tp.parser or "")
        if marker is not None:
            at = self.text.find(marker)
            if at >= 0:
                self.held = True
                return at
            for k in range(min(len(marker) - 1, len(self.text)), 0, -1):  # a marker's beginning
                if marker.startswith(self.text[-k:]):
                    return len(self.text) - k
            return len(self.text)
        # llama3_json, pythonic: a call is the whole answer, so only its first characters decide
        head = self.text.lstrip()
        if not head:
            return 0
        if self.tp.parser == "pythonic":
            self.held = head.startswith("[")
            return 0 if self.held else len(self.text)
        if head.startswith("{") or head.startswith("<|python_tag|>"):
            self.held = True
            return 0
        if "<|python_tag|>".startswith(head):
            return 0
        return len(self.text)

    def finish(self) -> tuple[list[P.DeltaMessage], bool]:
        """The last deltas of the choice, and whether it made calls."""
        if self.tp.mode == "named":
            return [], True
        if self.tp.mode == "required":
            calls = constrained_calls(self.tp, self.text)
            if not calls:  # cut before the call was whole: the text so far is content
                return ([P.DeltaMessage(content=self.text)] if self.text else []), False
            return [d for i, c in enumerate(calls) for d in _whole(i, c)], True
        content, calls = parse_auto(self.tp.parser or "", self.text)
        if not calls:  # no call after all: what was held is content
            rest = self.text[self.sent:]
            return ([P.DeltaMessage(content=rest)] if rest else []), False
        rest = (content or "")[self.sent:]
        out = [P.DeltaMessage(content=rest)] if rest else []
        return out + [d for i, c in enumerate(calls) for d in _whole(i, c)], True


def _head(index: int, call: P.ToolCall) -> P.DeltaMessage:
    return P.DeltaMessage(tool_calls=[P.DeltaToolCall(
        index, id=call.id, type="function",
        function=P.DeltaFunctionCall(name=call.function.name, arguments=""))])


def _whole(index: int, call: P.ToolCall) -> list[P.DeltaMessage]:
    return [_head(index, call), P.DeltaMessage(tool_calls=[P.DeltaToolCall(
        index, function=P.DeltaFunctionCall(arguments=call.function.arguments))])]
