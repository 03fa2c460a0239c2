"""OpenAI's Responses API shapes (`POST /v1/responses`), as msgspec Structs: the request as the
openai client's `responses.create` sends it, and the response object and stream events it reads.

The endpoint is a translation over chat (server/serving_responses.py): these types exist only
to be decoded from and encoded to; nothing here runs a request.
"""
from __future__ import annotations

from typing import Any, Literal

from msgspec import UNSET, Struct, UnsetType, field


class InputPart(Struct, kw_only=True, forbid_unknown_fields=False):
    """A content part of an input message: `input_text` (or an assistant's earlier `output_text`)."""
    type: str
    text: str | None = None


class InputItem(Struct, kw_only=True, forbid_unknown_fields=False):
    """One item of `input`: a message (`type` "message" or left out: EasyInputMessage), an
    earlier `function_call`, or a `function_call_output` answering one. Which fields an item
    needs depends on its type: checked when it is translated (serving_responses.to_chat)."""
    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(Struct, kw_only=True, forbid_unknown_fields=False):
    """A function tool in the Responses shape: name and parameters at the top level."""
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(Struct, kw_only=True, forbid_unknown_fields=False):
    type: Literal["function"]
    name: str


class TextFormat(Struct, kw_only=True, forbid_unknown_fields=False):
    """`text.format`: plain text, any JSON object, or JSON valid against `schema`."""
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True, forbid_unknown_fields=False):
    format: TextFormat | None = None


class ReasoningConfig(Struct, kw_only=True, forbid_unknown_fields=False):
    """Accepted and echoed; a reasoning model here thinks as its chat template says."""
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(Struct, kw_only=True):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    ringserve_trace: bool = False  # as on chat (server/trace.py)


# --- the response ------------------------------------------------------------------------------

class OutputText(Struct):
    text: str
    type: str = "output_text"
    annotations: list[Any] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)


class ReasoningText(Struct):
    text: str
    type: str = "reasoning_text"


class MessageItem(Struct):
    id: str
    status: str                       # in_progress, completed, incomplete, failed
    content: list[OutputText]
    role: str = "assistant"
    type: str = "message"


class ReasoningItem(Struct):
    id: str
    status: str
    content: list[ReasoningText]
    summary: list[Any] = field(default_factory=list)
    type: str = "reasoning"


class FunctionCallItem(Struct):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str
    type: str = "function_call"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(Struct):
    cached_tokens: int = 0          # prompt tokens found in the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = field(default_factory=OutputTokensDetails)


class IncompleteDetails(Struct):
    reason: str


class ResponseError(Struct):
    """A failed response's `error` (status "failed"): OpenAI's codes name no engine failure,
    so every failure under way is a `server_error`."""
    message: str
    code: str = "server_error"


class Response(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str                       # in_progress, completed, incomplete, failed
    output: list[OutputItem]
    usage: ResponseUsage | UnsetType  # UNSET while in progress (the schema has no null)
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    # Never stored (serving_responses.py says why): GET /v1/responses/{id} has nothing to find.
    store: bool = False
    previous_response_id: None = None
    background: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    truncation: str = "disabled"
    user: str | UnsetType = UNSET     # only when the request gave one (the schema has no null)
    object: str = "response"
