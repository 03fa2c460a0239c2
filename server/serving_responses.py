"""POST /v1/responses: OpenAI's Responses API as a translation over chat (as vLLM serves it).

The request becomes one ChatCompletionRequest (`to_chat`: `instructions` a system message,
`input` messages, function calls and their outputs as the chat turns they are, `tools` in chat's
shape, `text.format` as `response_format`, `max_output_tokens` as `max_completion_tokens`), which
goes through chat's one path: its checks, template, tool plan, reasoning split, grammar, engine
requests and output processor (server/serving_chat.py). What comes back is rewritten into
Responses output items (reasoning, message, function calls), or, streamed, chat's typed chunks
into Responses events. A chat 400 names the Responses field (`_PARAMS`).

Responses are not stored (`store` is answered false) and `previous_response_id` is a 400: each
Gunicorn worker is its own process, so a store in one worker's memory would find an earlier
response only when the next request happens to land on the same worker; a client keeps the
conversation by sending the earlier output items back as `input`, which works on any worker.
"""
from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

import msgspec

from ringserve.server import protocol as P
from ringserve.server import protocol_responses as R
from ringserve.server import serving_chat
from ringserve.server.context import ServerContext
from ringserve.server.errors import APIError, bad_request, from_validation_error
from ringserve.server.generate import Generation, stream_error

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")

# A chat field (the start of a 400's param) -> the Responses field it was translated from.
_PARAMS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
           ("max_tokens", "max_output_tokens"), ("response_format.json_schema.schema", "text.format.schema"),
           ("response_format", "text.format"), ("stream_options", "stream"))


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- request: Responses -> chat -------------------------------------------------------------------

def to_chat(req: R.ResponsesRequest) -> P.ChatCompletionRequest:
    """The chat request this Responses request means, or a 400 naming the Responses field."""
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: responses are not stored; send "
                          "the earlier output items back in input", param="previous_response_id")
    if req.background:
        raise bad_request("background responses are not supported", param="background")
    body: dict[str, Any] = {
        "messages": _messages(req), "model": req.model, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls, "user": req.user,
        "ringserve_trace": req.ringserve_trace, "tool_choice": req.tool_choice,
        "response_format": _response_format(req.text.format if req.text is not None else None)}
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # the last chunk's usage: response.completed's
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}}
            for t in req.tools]
    if isinstance(req.tool_choice, R.ToolChoiceFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    try:  # converted, not constructed: the chat types' own bounds apply (a tool's name length)
        return msgspec.convert({k: v for k, v in body.items() if v is not None},
                               P.ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise responses_error(from_validation_error(exc)) from None


def _messages(req: R.ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    if not req.input:
        raise bad_request("input must not be empty", param="input")
    for i, item in enumerate(req.input):
        _add_item(messages, item, f"input[{i}]")
    return messages


def _response_format(fmt: R.TextFormat | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {
        "name": fmt.name or "response", "description": fmt.description, "schema": fmt.schema,
        "strict": fmt.strict}}


def _add_item(messages: list[dict[str, Any]], item: R.InputItem, param: str) -> None:
    """One input item as chat messages: an earlier function call joins the assistant turn
    before it (one message holds a turn's calls), its output is a `tool` message."""
    if item.type == "message":
        role = _ROLES.get(item.role or "")
        if role is None:
            raise bad_request(f"role must be one of {', '.join(_ROLES)}, got {item.role!r}",
                              param=f"{param}.role")
        messages.append({"role": role, "content": _text(item.content, f"{param}.content")})
    elif item.type == "function_call":
        if item.call_id is None or item.name is None or item.arguments is None:
            raise bad_request("a function_call item needs call_id, name and arguments", param=param)
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif item.type == "function_call_output":
        if item.call_id is None or item.output is None:
            raise bad_request("a function_call_output item needs call_id and output", param=param)
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    elif item.type != "reasoning":  # an earlier turn's reasoning is not shown to the model again
        raise bad_request(f"input items of type {item.type!r} are not supported (message, "
                          "function_call, function_call_output, reasoning)", param=f"{param}.type")


def _text(content: str | list[R.InputPart] | None, param: str) -> str:
    if content is None:
        raise bad_request("a message needs content", param=param)
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise bad_request(f"content parts of type {part.type!r} are not supported (input_text)",
                              param=f"{param}[{j}]")
        texts.append(part.text)
    return "\n".join(texts)


def responses_error(exc: APIError) -> APIError:
    """A 400 of chat's path, naming the Responses field it came from."""
    if exc.param is None:
        return exc
    old = exc.param
    for chat, ours in _PARAMS:
        if old == chat or old.startswith((chat + ".", chat + "[")):
            exc.param = ours + old[len(chat):]
            exc.message = exc.message.replace(chat, ours)
            break
    else:
        if old.startswith("tools[") and ".function." in old:
            exc.param = old.replace(".function.", ".", 1)  # the Responses tool is flat
            exc.message = exc.message.replace(old, exc.param)
    return exc


async def prepare(ctx: ServerContext, req: R.ResponsesRequest, request_id: str) -> Generation:
    try:
        return await serving_chat.prepare(ctx, to_chat(req), request_id)
    except APIError as exc:
        raise responses_error(exc) from None


# --- response: chat -> Responses ------------------------------------------------------------------

def _response(req: R.ResponsesRequest, request_id: str, model: str, status: str,
              output: list[R.OutputItem], usage: R.ResponseUsage | msgspec.UnsetType) -> R.Response:
    return R.Response(
        id=request_id, created_at=P.now(), model=model, status=status, output=output, usage=usage,
        incomplete_details=R.IncompleteDetails("max_output_tokens") if status == "incomplete" else None,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p,
        tools=[msgspec.to_builtins(t) for t in req.tools or []],
        tool_choice=msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        text={"format": msgspec.to_builtins(req.text.format)} if req.text and req.text.format
        else {"format": {"type": "text"}},
        reasoning=msgspec.to_builtins(req.reasoning) if req.reasoning is not None else None,
        metadata=req.metadata or {}, user=req.user if req.user is not None else msgspec.UNSET)


def _usage(gen: Generation) -> R.ResponseUsage:
    u = gen.usage()
    return R.ResponseUsage(u.prompt_tokens, u.completion_tokens, u.total_tokens,
                           R.InputTokensDetails(gen.choices[0].num_cached_tokens))


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


async def complete(ctx: ServerContext, req: R.ResponsesRequest, gen: Generation, request_id: str,
                   model: str) -> R.Response:
    # NOTE: to_chat again (pure, microseconds) rather than a chat request carried on the Generation
    chat = await serving_chat.complete(ctx, to_chat(req), gen, request_id, model)
    choice = chat.choices[0]
    status, message = _status(choice.finish_reason), choice.message
    output: list[R.OutputItem] = []
    if message.reasoning_content:
        output.append(R.ReasoningItem(_item_id("rs"), status, [R.ReasoningText(message.reasoning_content)]))
    if message.content or not (message.tool_calls or message.reasoning_content):  # an empty answer: one item
        output.append(R.MessageItem(_item_id("msg"), status, [R.OutputText(message.content or "")]))
    for call in message.tool_calls or []:
        output.append(R.FunctionCallItem(_item_id("fc"), call.id, call.function.name,
                                         call.function.arguments, "completed"))
    return _response(req, request_id, model, status, output, _usage(gen))


async def stream(ctx: ServerContext, req: R.ResponsesRequest, gen: Generation, request_id: str,
                 model: str) -> AsyncIterator[bytes]:
    """Responses events (`event: <type>` + `data: <json>`, numbered by sequence_number) from
    chat's typed chunks: created, in_progress, per output item added / its deltas / done, then
    completed (or incomplete, cut by max_output_tokens). A failure under way ends it with an
    `error` event and `response.failed` (its output what was streamed, the open item incomplete),
    never chat's error chunk and [DONE], which the Responses API does not have."""
    events = _EventWriter()
    started = _response(req, request_id, model, "in_progress", [], msgspec.UNSET)
    yield events.send("response.created", response=started)
    yield events.send("response.in_progress", response=started)
    finish: str | None = None
    try:
        async for chunk in serving_chat.chunks(ctx, to_chat(req), gen, request_id, model):
            for choice in chunk.choices:
                for data in events.delta(choice.delta):
                    yield data
                finish = choice.finish_reason or finish
    except Exception as exc:  # noqa: BLE001 - whatever failed, the client gets a whole stream
        error = stream_error(exc, request_id)
        yield events.send("error", code=error.code, message=error.message, param=error.param)
        failed = _response(req, request_id, model, "failed", events.cut(), _usage(gen))
        failed.error = R.ResponseError(error.message)
        yield events.send("response.failed", response=failed)
        return
    status = _status(finish)
    for data in events.close(status):
        yield data
    yield events.send(f"response.{status}",
                      response=_response(req, request_id, model, status, events.output, _usage(gen)))


class _EventWriter:
    """The stream's state: the output items so far, the one open (receiving deltas), and the
    next sequence number."""

    def __init__(self) -> None:
        self.output: list[R.OutputItem] = []
        self._open: R.OutputItem | None = None
        self._text: list[str] = []          # the open item's text (or arguments) so far
        self._seq = 0

    def send(self, type: str, **fields: Any) -> bytes:
        data = msgspec.json.encode({"type": type, "sequence_number": self._seq, **fields})
        self._seq += 1
        return b"event: " + type.encode() + b"\ndata: " + data + b"\n\n"

    def delta(self, d: P.DeltaMessage) -> list[bytes]:
        out: list[bytes] = []
        if d.reasoning_content:
            out += self._open_item(R.ReasoningItem)
            out.append(self._piece("response.reasoning_text.delta", d.reasoning_content))
        if d.content:
            out += self._open_item(R.MessageItem)
            out.append(self._piece("response.output_text.delta", d.content, logprobs=[]))
        for call in d.tool_calls or []:
            if call.id is not None:  # a new call: its first piece has the id and the name
                out += self.close("completed")
                name = call.function.name if call.function and call.function.name else ""
                self._open = R.FunctionCallItem(_item_id("fc"), call.id, name, "", "in_progress")
                out.append(self.send("response.output_item.added", output_index=len(self.output),
                                     item=self._open))
            if call.function is not None and call.function.arguments:
                out.append(self._piece("response.function_call_arguments.delta", call.function.arguments,
                                       with_content_index=False))
        return out

    def _piece(self, type: str, text: str, with_content_index: bool = True, **extra: Any) -> bytes:
        assert self._open is not None
        self._text.append(text)
        where: dict[str, Any] = {"item_id": self._open.id, "output_index": len(self.output)}
        if with_content_index:
            where["content_index"] = 0
        return self.send(type, **where, delta=text, **extra)

    def _open_item(self, kind: type) -> list[bytes]:
        if isinstance(self._open, kind):
            return []
        out = self.close("completed")
        if kind is R.ReasoningItem:
            self._open = R.ReasoningItem(_item_id("rs"), "in_progress", [])
            part: Any = R.ReasoningText("")
        else:
            self._open = R.MessageItem(_item_id("msg"), "in_progress", [])
            part = R.OutputText("")
        where = {"output_index": len(self.output)}
        out.append(self.send("response.output_item.added", **where, item=self._open))
        out.append(self.send("response.content_part.added", item_id=self._open.id, **where,
                             content_index=0, part=part))
        return out

    def cut(self) -> list[R.OutputItem]:
        """The output so far, the open item (cut short by a failure) as incomplete."""
        if self._open is None:
            return self.output
        item, text = self._open, "".join(self._text)
        if isinstance(item, R.FunctionCallItem):
            item.arguments = text
        elif isinstance(item, R.ReasoningItem):
            item.content = [R.ReasoningText(text)]
        else:
            item.content = [R.OutputText(text)]
        item.status = "incomplete"
        return [*self.output, item]

    def close(self, status: str) -> list[bytes]:
        """End the open item: its `.done` events with the whole text, then output_item.done."""
        item, text = self._open, "".join(self._text)
        if item is None:
            return []
        self._open, self._text = None, []
        where = {"item_id": item.id, "output_index": len(self.output)}
        out = []
        if isinstance(item, R.FunctionCallItem):
            item.arguments, item.status = text, "completed"
            out.append(self.send("response.function_call_arguments.done", **where, name=item.name,
                                 arguments=text))
        else:
            item.status = status
            if isinstance(item, R.ReasoningItem):
                part: Any = R.ReasoningText(text)
                item.content = [part]
                out.append(self.send("response.reasoning_text.done", **where, content_index=0, text=text))
            else:
                part = R.OutputText(text)
                item.content = [part]
                out.append(self.send("response.output_text.done", **where, content_index=0, text=text,
                                     logprobs=[]))
            out.append(self.send("response.content_part.done", **where, content_index=0, part=part))
        out.append(self.send("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        return out
