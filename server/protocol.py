"""OpenAI request and response shapes (plus vLLM's sampling extensions), as msgspec Structs.

Decoding a body with `decode_request` checks types (msgspec's message names the field, which
becomes OpenAI's `param`); `sampling_params` builds the request's SamplingParams, whose own
`validate` checks every sampling value (ipc/sampling_params.py, the check the engine applies
again); `check_*` checks the rest: the model name, empty prompts, context length, and the
per-request limits (server/config.py `RequestLimits`) that keep a small body from costing the server much more
than its size. Every failure is an `APIError(400)`.
"""
from __future__ import annotations

import re
import time
import uuid
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _pkg_version
from typing import Annotated, Any, Iterator, Literal, TypeVar, Union, cast

import msgspec
from msgspec import Meta, Struct, field

from ringserve.ipc import limits
from ringserve.ipc.sampling_params import SamplingParams, SamplingParamsError
from ringserve.ipc.structured import StructuredOutputsParams
from ringserve.server import json_text
from ringserve.server.config import RequestLimits
from ringserve.server.errors import APIError, bad_request, from_validation_error
from ringserve.server.structured_outputs import ResponseFormat

# Ranges of sampling values are checked by SamplingParams.validate, not by the types; a token
# id's lower bound is here so that msgspec names the item (`prompt[3]`).
TokenId = Annotated[int, Meta(ge=limits.TOKEN_ID.lo)]


class StreamOptions(Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class _SamplingFields(Struct, kw_only=True):
    """Fields that completions and chat share; names as OpenAI and vLLM spell them. A
    SamplingParams field left out (None) takes SamplingParams' default (`sampling_params`)."""
    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1  # OpenAI's limit; each choice is an engine request
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool | None = None
    # ringserve extension: answer with the request's journey (server/trace.py)
    ringserve_trace: bool = False
    # Structured outputs (server/structured_outputs.py): OpenAI's, vLLM's, vLLM's older names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        """A stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields, kw_only=True):
    # One array-like type per union in msgspec: the list's items are checked in `prompt_inputs`.
    prompt: str | list[Union[str, TokenId, list[TokenId]]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ContentPart(Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None


class FunctionCall(Struct):
    name: str
    arguments: str            # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True, forbid_unknown_fields=False):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class FunctionDefinition(Struct, kw_only=True, forbid_unknown_fields=False):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema; None: no parameters
    strict: bool | None = None


class ChatTool(Struct, kw_only=True, forbid_unknown_fields=False):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Struct, forbid_unknown_fields=False):
    name: str


class NamedToolChoice(Struct, kw_only=True, forbid_unknown_fields=False):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None            # a tool result (role "tool"): the call it answers

    def to_template_dict(self, index: int, max_json_depth: int) -> dict[str, Any]:
        """The message (messages[index]) as a chat template expects it: text parts joined into
        one string, earlier calls' JSON arguments parsed (at most max_json_depth deep)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content part of type {part.type!r} is not supported",
                                      param=f"messages[{index}].content[{i}]")
                texts.append(part.text)
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates index the arguments as a mapping (Hermes/Qwen, Llama 3 tojson them):
            # JSON text becomes a dict, as vLLM hands them over.
            d["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _json_or_text(
                    c.function.arguments, max_json_depth,
                    f"messages[{index}].tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(self.tool_calls)]
        return d


def _json_or_text(text: str, max_depth: int, param: str) -> Any:
    try:
        return json_text.loads(text, max_depth, param)
    except json_text.NotJSON:
        return text
    except json_text.TooDeep as e:
        raise bad_request(str(e), param=param) from None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    echo: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None   # None: true, as OpenAI
    chat_template_kwargs: dict[str, Any] | None = None  # to the template, e.g. enable_thinking


class TokenizeCompletionRequest(Struct, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True


class TokenizeChatRequest(Struct, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    tools: list[ChatTool] | None = None
    model: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


# --- decoding and checks ---------------------------------------------------------------------

T = TypeVar("T")


def decode_request(body: bytes, type: type[T]) -> T:
    """Parse and type-check a JSON body; any failure is a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=type)
    except (UnicodeDecodeError, msgspec.DecodeError) as exc:
        raise _decode_error(exc, body) from None
    except RecursionError:
        raise _too_deep(body) from None


def decode_tokenize_request(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM's /tokenize takes either a `prompt` or chat `messages`."""
    try:
        raw = msgspec.json.decode(body)
        kind = (TokenizeChatRequest if isinstance(raw, dict) and "messages" in raw
                else TokenizeCompletionRequest)
        return cast(Union[TokenizeCompletionRequest, TokenizeChatRequest], msgspec.convert(raw, type=kind))
    except (UnicodeDecodeError, msgspec.DecodeError) as exc:
        raise _decode_error(exc, body) from None
    except RecursionError:
        raise _too_deep(body) from None


_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a string, or a bracket


def _too_deep(body: bytes) -> APIError:
    """The 400 for JSON nested deeper than the decoder recurses, naming the top-level field
    that holds it (a scan of the body, on this error path only)."""
    depth, key = 0, None
    for m in _JSON_TOKEN.finditer(body):
        tok = m.group()
        if tok[0] == 0x22:  # a string: at depth 1, a top-level key (a key precedes its value)
            if depth == 1:
                key = tok[1:-1].decode(errors="replace")
        elif tok in (b"{", b"["):
            depth += 1
            if depth > 64:
                break
        else:
            depth -= 1
    return bad_request("the request's JSON is nested too deeply", param=key)


_AT_BYTE = re.compile(r"\(byte (\d+)\)$")
# The key whose value was being read: `"name":` then the start of the value (e.g. `[1, `).
_KEY_BEFORE = re.compile(rb'"([A-Za-z_][A-Za-z0-9_]*)"\s*:[^:{}"]*$')


def _decode_error(exc: Exception, body: bytes) -> APIError:
    """The 400 for a body that is not UTF-8, not JSON, or not the request's shape."""
    if isinstance(exc, UnicodeDecodeError):
        return bad_request("request body is not valid UTF-8")
    if isinstance(exc, msgspec.ValidationError):  # a DecodeError too: test it first
        return from_validation_error(exc)
    # Malformed inside a value (NaN, Infinity: not JSON): name the field it belongs to.
    at, param = _AT_BYTE.search(str(exc)), None
    if at is not None:
        key = _KEY_BEFORE.search(body[:int(at.group(1))])
        param = key.group(1).decode() if key else None
    return bad_request(f"malformed JSON: {exc}", param=param)


def check_model(model: str | None, served_names: list[str]) -> str:
    """The model name to answer with; a name we do not serve is a 404, as OpenAI and vLLM answer."""
    if model is None or model == "":
        return served_names[0]
    if model not in served_names:
        raise APIError(404, f"The model `{model}` does not exist.", param="model",
                       code="model_not_found")
    return model


PromptInput = Union[str, list[int]]


def prompt_inputs(prompt: str | list) -> list[PromptInput]:
    """The completion prompt as a list of single prompts: strings or token-id lists."""
    if isinstance(prompt, str):
        items: list[PromptInput] = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    elif all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        items = list(prompt)
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids "
                          "or a list of token-id lists", param="prompt")
    for item in items:
        if len(item) == 0:
            raise bad_request("prompt must not be empty", param="prompt")
    return items


def check_common(req: _SamplingFields, lim: RequestLimits, vocab_size: int) -> None:
    """Checks no type can express, shared by completions and chat, beyond SamplingParams' own."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []  # (counted, not kept)
    if len(stops) > lim.max_stop_strings:
        raise bad_request(f"at most {lim.max_stop_strings} stop strings are allowed "
                          f"(--max-stop-strings), got {len(stops)}", param="stop")
    size = sum(len(s.encode()) for s in stops)
    if size > lim.max_stop_bytes:
        raise bad_request(f"stop strings may have at most {lim.max_stop_bytes} bytes together "
                          f"(--max-stop-bytes), got {size}", param="stop")
    if req.stop_token_ids:
        if len(req.stop_token_ids) > lim.max_stop_token_ids:
            raise bad_request(f"at most {lim.max_stop_token_ids} stop_token_ids are allowed "
                              f"(--max-stop-token-ids), got {len(req.stop_token_ids)}",
                              param="stop_token_ids")
        check_token_ids(req.stop_token_ids, vocab_size, param="stop_token_ids")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          param="stream_options")


def check_token_ids(ids: list[int], vocab_size: int, *, param: str) -> None:
    """Token ids the model has (the types already refused negative ones)."""
    if any(t >= vocab_size for t in ids):
        raise bad_request(f"token ids must be below the vocabulary size {vocab_size}", param=param)


def check_logprobs(num_top: int | None, lim: RequestLimits, *, param: str) -> None:
    if num_top is not None and num_top > lim.max_logprobs:
        raise bad_request(f"{param} must be at most {lim.max_logprobs} (--max-logprobs), "
                          f"got {num_top}", param=param)


def check_choices(num_prompts: int, n: int, lim: RequestLimits) -> None:
    """Each prompt x sample is an engine request: bound how many one body may start."""
    if num_prompts * n > lim.max_choices_per_request:
        raise bad_request(f"a request may ask for at most {lim.max_choices_per_request} choices (number of "
                          f"prompts x n, --max-choices-per-request), got {num_prompts} x {n}",
                          param="n" if num_prompts == 1 else "prompt")


def check_response_logprobs(positions: int, num_top: int | None, lim: RequestLimits,
                            *, param: str) -> None:
    """Bound the logprob entries of one answer: positions (tokens with logprobs, summed over
    choices, echoed prompts included) x (the token's own + num_top alternatives)."""
    if num_top is None:
        return
    entries = positions * (1 + num_top)
    if entries > lim.max_response_logprobs:
        raise bad_request(f"this request could return {entries} logprob entries (choices x "
                          f"tokens x (1 + {param})), more than the limit "
                          f"{lim.max_response_logprobs} (--max-response-logprobs); ask for "
                          f"fewer tokens, choices or logprobs", param=param)


def check_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                 *, param: str, defaults: dict | None = None) -> int:
    """Max new tokens for one prompt, or a 400 when it does not fit the context
    (ipc/limits.py `fit_context`, the rule the engine applies too). The generation config's
    max_new_tokens (`defaults["max_tokens"]`) caps it, asked for or not, as vLLM's
    get_max_tokens does."""
    fit = limits.fit_context(num_prompt_tokens, max_tokens, max_model_len)
    if fit.error is not None:
        raise bad_request(fit.error, param=param if fit.field == "prompt" else "max_tokens",
                          code="context_length_exceeded")
    cap = (defaults or {}).get("max_tokens")
    return fit.max_tokens if cap is None else min(fit.max_tokens, cap)


# The request fields that are SamplingParams fields of the same name and meaning.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop",
                    "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
                    "presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_params(req: _SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, defaults: dict | None = None) -> SamplingParams:
    """The request's SamplingParams, checked (SamplingParams.validate: a 400 naming the
    request's field). Its fields left out (None) take `defaults` (--generation-config), else
    SamplingParams' defaults; n is 1: the frontend fans `n` out into n engine requests, so that
    a stop string ends one."""
    given = {**{name: value for name, value in (defaults or {}).items() if name != "max_tokens"},
             **{name: value for name in _SAMPLING_FIELDS if (value := getattr(req, name)) is not None}}
    with _refused_as_400(req):
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, **given)


def for_engine(req: _SamplingFields, params: SamplingParams, *, max_tokens: int,
               structured_outputs: str | None) -> SamplingParams:
    """`params` as the engine is to run them: max_tokens resolved against the context
    (check_length), the compiled llguidance grammar (server/structured_outputs.py). Checked
    again: min_tokens may be more than the resolved max_tokens."""
    with _refused_as_400(req):
        return msgspec.structs.replace(params, max_tokens=max_tokens,
                                       structured_outputs=structured_outputs)


@contextmanager
def _refused_as_400(req: _SamplingFields) -> Iterator[None]:
    """SamplingParamsError -> a 400 naming the field as the request spells it."""
    try:
        yield
    except SamplingParamsError as e:
        param = _request_field(req, e.field)
        raise bad_request(f"{param} {e.reason}", param=param) from None


def _request_field(req: _SamplingFields, name: str) -> str:
    """The request's name for SamplingParams field `name`."""
    if name == "prompt_logprobs":  # completions' echo: the prompt's logprobs, as many as `logprobs`
        return "logprobs"
    if isinstance(req, ChatCompletionRequest):
        if name == "logprobs":
            return "top_logprobs"
        if name == "max_tokens" and req.max_completion_tokens is not None:
            return "max_completion_tokens"
    return name


# --- responses -------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_HEADER = 256  # characters; the engine ids add a suffix (ipc/messages.py MAX_REQUEST_ID)
_REQUEST_ID_OK = re.compile(r"[\x21-\x7e]+")  # visible ASCII: it goes into logs and headers


def public_request_id(prefix: str, header: str | None) -> str:
    """The request's id in its response, its `X-Request-Id` answer, logs and trace: the client's
    `X-Request-Id` as vLLM takes it (`<prefix>-<header>`), else a fresh one. The engine requests
    keep ids of their own (a client may send the same header twice at once)."""
    if header is None or header == "":
        return new_id(prefix)
    if len(header) > MAX_REQUEST_ID_HEADER or not _REQUEST_ID_OK.fullmatch(header):
        raise bad_request(f"the {REQUEST_ID_HEADER} header must be 1 to {MAX_REQUEST_ID_HEADER} "
                          f"visible ASCII characters", param=REQUEST_ID_HEADER)
    return f"{prefix}-{header}"


def _fingerprint() -> str:
    try:
        return f"fp_ringserve_{_pkg_version('ringserve')}"
    except PackageNotFoundError:  # run from a tree that was never installed
        return "fp_ringserve"


# OpenAI's `system_fingerprint`: the backend configuration that produced an answer; ours is the
# ringserve version, on every response and every chunk (the spec wants a string, never null).
SYSTEM_FINGERPRINT = _fingerprint()


def now() -> int:
    return int(time.time())


class UsageInfo(Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(Struct):
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"
    system_fingerprint: str = SYSTEM_FINGERPRINT


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None  # OpenAI's schema requires the key (null)


class ResponseMessage(Struct, omit_defaults=True):
    role: str
    content: str | None
    refusal: str | None  # no default: always sent, null (OpenAI's schema requires the key)
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # --reasoning-parser (server/reasoning.py)


class ChatChoice(Struct):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion"
    system_fingerprint: str = SYSTEM_FINGERPRINT


class DeltaFunctionCall(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """One piece of a streamed tool call, as OpenAI streams them: the first has the id, type
    and name (arguments ""), the next ones pieces of the arguments."""
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str = SYSTEM_FINGERPRINT


class CompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    # Only the last chunk, and only with stream_options.include_usage: no key otherwise (OpenAI's schema)
    usage: UsageInfo | msgspec.UnsetType = msgspec.UNSET
    object: str = "text_completion"
    system_fingerprint: str = SYSTEM_FINGERPRINT


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "ringserve"
    root: str | None = None
    max_model_len: int | None = None
    object: str = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"
