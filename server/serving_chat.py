"""POST /v1/chat/completions: messages rendered with the model's chat template (jinja2)."""
from __future__ import annotations

from typing import AsyncIterator, cast

from ringserve.server import protocol as P
from ringserve.server import tool_calls as T
from ringserve.server.context import ServerContext
from ringserve.server.generate import Generation
from ringserve.server.output_processor import TokenLogprob
from ringserve.server.reasoning import ReasoningFormat, ReasoningStream, reasoning_format, split_reasoning
from ringserve.server.sse import DONE, event
from ringserve.server.structured_outputs import compile_request

# What the template is always given, so chat_template_kwargs may not set it.
_TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "unk_token",
                       "pad_token")

def render_prompt(ctx: ServerContext, messages: list[P.ChatMessage], add_generation_prompt: bool,
                  tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    depth = ctx.structured.max_json_depth
    dicts = [m.to_template_dict(i, depth) for i, m in enumerate(messages)]
    extra = dict(template_kwargs or {})  # chat_template_kwargs, e.g. Qwen3's enable_thinking
    taken = sorted(k for k in extra if k in _TEMPLATE_ARGUMENTS)
    if taken:
        raise P.bad_request(f"chat_template_kwargs may not set {', '.join(taken)}",
                            param="chat_template_kwargs")
    if tools is not None:
        extra["tools"] = tools  # as transformers passes them
    try:
        return ctx.tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt,
                                                 **extra)
    except ValueError as exc:  # ChatTemplateError: the template refused these messages
        raise P.bad_request(f"cannot apply the chat template: {exc}", param="messages") from None


async def prepare(ctx: ServerContext, req: P.ChatCompletionRequest, request_id: str) -> Generation:
    P.check_model(req.model, ctx.served_model_names)
    P.check_common(req, ctx.limits, ctx.vocab_size)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = P.sampling_params(req, max_tokens=asked, logprobs=logprobs,  # before any tokenizing
                               defaults=ctx.default_sampling)
    P.check_logprobs(req.top_logprobs, ctx.limits, param="top_logprobs")
    P.check_choices(1, req.n, ctx.limits)
    tp = T.plan(req, ctx.tool_call_parser, ctx.structured.max_json_depth)
    if req.top_logprobs is not None and not req.logprobs:
        raise P.bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
    text = render_prompt(ctx, req.messages, req.add_generation_prompt, tp.template_tools,
                         req.chat_template_kwargs)
    # The template already holds the special tokens (as vLLM's chat default).
    ids = await ctx.encode_prompt(text, False, param="messages")
    if not ids:
        raise P.bad_request("the rendered prompt is empty", param="messages")
    max_tokens = P.check_length(len(ids), asked, ctx.max_model_len, param="messages",
                                defaults=ctx.default_sampling)
    P.check_response_logprobs(req.n * max_tokens, logprobs, ctx.limits, param="top_logprobs")
    tools = None if tp.constraint is None else (tp.constraint, tp.constraint_param)
    grammar = await compile_request(req, ctx, tools)  # off the loop (server/grammar_compiler.py)
    params = P.for_engine(req, params, max_tokens=max_tokens, structured_outputs=grammar)
    # A parser reads the markers a model family may write as special tokens (vLLM keeps them too).
    skip_special = req.skip_special_tokens and tp.mode != "auto"
    gen = Generation(ctx.engine, ctx.tokenizer, ctx.metrics, request_id, [ids], params, req.n,
                     skip_special_tokens=skip_special)
    gen.tools = tp
    # A constrained tool call is the whole output: no reasoning to split off it.
    gen.reasoning = (reasoning_format(ctx.reasoning_parser, constrained=grammar is not None)
                     if tp.mode in ("none", "auto") else None)
    return gen


def _logprobs(ctx: ServerContext, entries: list[TokenLogprob], top_n: int) -> P.ChatLogprobs:
    content = []
    for e in entries:
        tok = ctx.token_text(e.token_id)
        top = [P.TopLogprob(t, v, list(t.encode())) for t, v in
               ((ctx.token_text(tid), lp) for tid, lp, _rank in (e.top or [])[:top_n])]
        logprob = cast(float, e.logprob)  # a sampled token always has one (None: echo's first)
        content.append(P.ChatTokenLogprob(tok, logprob, list(tok.encode()), top))
    return P.ChatLogprobs(content)


async def complete(ctx: ServerContext, req: P.ChatCompletionRequest, gen: Generation,
                   request_id: str, model: str) -> P.ChatCompletionResponse:
    async for _ in gen.deltas():
        pass
    choices = []
    tp: T.ToolPlan = gen.tools
    for c in gen.choices:
        lp = _logprobs(ctx, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
        message, finish = _message(tp, gen.reasoning, c.text.text, c.finish_reason)
        choices.append(P.ChatChoice(c.index, message, lp, finish, c.stop_reason))
    return P.ChatCompletionResponse(request_id, P.now(), model, choices, gen.usage())


def _message(tp: T.ToolPlan, fmt: ReasoningFormat | None, text: str,
             finish: str | None) -> tuple[P.ResponseMessage, str | None]:
    """The assistant message of a finished choice, with its reasoning and tool calls, and its
    finish reason ("tool_calls" when it made some; a named choice keeps "stop", as OpenAI).
    Tool calls are parsed from the content after the reasoning only."""
    reasoning, answer = split_reasoning(fmt, text) if fmt is not None else (None, text)
    if tp.mode == "none" or finish not in ("stop",) or answer is None:  # cut short: no call to parse
        return P.ResponseMessage("assistant", answer, None, reasoning_content=reasoning), finish
    if tp.mode == "auto":
        content, calls = T.parse_auto(tp.parser or "", answer)
    else:
        content, calls = None, T.constrained_calls(tp, answer)
    if not calls:
        return P.ResponseMessage("assistant", answer, None, reasoning_content=reasoning), finish
    return (P.ResponseMessage("assistant", content, None, calls, reasoning),
            "stop" if tp.mode == "named" else "tool_calls")


async def stream(ctx: ServerContext, req: P.ChatCompletionRequest, gen: Generation,
                 request_id: str, model: str) -> AsyncIterator[bytes]:
    async for chunk in chunks(ctx, req, gen, request_id, model):
        yield event(chunk)
    yield DONE


async def chunks(ctx: ServerContext, req: P.ChatCompletionRequest, gen: Generation,
                 request_id: str, model: str) -> AsyncIterator[P.ChatCompletionChunk]:
    """The stream's chunks, typed: chat's SSE events, and what the Responses API translates
    (server/serving_responses.py)."""
    created = P.now()
    for c in gen.choices:
        first = P.ChatChunkChoice(c.index, P.DeltaMessage(role="assistant", content=""))
        yield P.ChatCompletionChunk(request_id, created, model, [first])
    tp: T.ToolPlan = gen.tools
    reasoning = {c.index: ReasoningStream(gen.reasoning) for c in gen.choices} if gen.reasoning else None
    if tp.mode != "none":
        async for chunk in _stream_tools(ctx, req, gen, request_id, model, created, tp, reasoning):
            yield chunk
    async for d in gen.deltas():  # (nothing left after _stream_tools)
        c = d.choice
        lp = _logprobs(ctx, d.logprobs, req.top_logprobs or 0) if req.logprobs else None
        if reasoning is None:
            delta = P.DeltaMessage(content=d.text)
        else:
            thought, content = _split(reasoning, d)
            delta = P.DeltaMessage(content=content or None, reasoning_content=thought or None)
        choice = P.ChatChunkChoice(c.index, delta, lp,
                                   c.finish_reason if d.finished else None,
                                   c.stop_reason if d.finished else None)
        yield P.ChatCompletionChunk(request_id, created, model, [choice])
    if req.include_usage:
        yield P.ChatCompletionChunk(request_id, created, model, [], gen.usage())


def _split(reasoning: dict[int, ReasoningStream] | None, d) -> tuple[str, str]:
    """A delta's (reasoning, content) text: all content without a reasoning parser."""
    if reasoning is None:
        return "", d.text
    return reasoning[d.choice.index].push(d.text, final=d.finished)


async def _stream_tools(ctx: ServerContext, req: P.ChatCompletionRequest, gen: Generation,
                        request_id: str, model: str, created: int, tp: T.ToolPlan,
                        reasoning: dict[int, ReasoningStream] | None
                        ) -> AsyncIterator[P.ChatCompletionChunk]:
    """The choices' deltas through a ToolStream each (server/tool_calls.py): reasoning (when
    parsed: the tool stream reads the content after it), content, then the calls as OpenAI
    streams them, then the finish reason on a delta of its own."""
    streams = {c.index: T.ToolStream(tp) for c in gen.choices}

    def chunk(index: int, delta: P.DeltaMessage, lp=None, finish=None, stop=None) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(request_id, created, model,
                                     [P.ChatChunkChoice(index, delta, lp, finish, stop)])

    async for d in gen.deltas():
        c, ts = d.choice, streams[d.choice.index]
        lp = _logprobs(ctx, d.logprobs, req.top_logprobs or 0) if req.logprobs else None
        thought, text = _split(reasoning, d)
        deltas = ([P.DeltaMessage(reasoning_content=thought)] if thought else []) + ts.push(text)
        if lp is not None and not deltas:
            deltas = [P.DeltaMessage()]  # the logprobs still go out with their tokens
        for k, delta in enumerate(deltas):
            yield chunk(c.index, delta, lp if k == 0 else None)
        if d.finished:
            finish: str | None = c.finish_reason
            if finish == "stop":
                last, called = ts.finish()
                for delta in last:
                    yield chunk(c.index, delta)
                if called and tp.mode != "named":
                    finish = "tool_calls"
            else:  # cut short: what was held back goes out as it is (named: sent as arguments)
                rest = ts.text[ts.sent:] if tp.mode != "named" else ""
                if rest:
                    yield chunk(c.index, P.DeltaMessage(content=rest))
            yield chunk(c.index, P.DeltaMessage(), finish=finish, stop=c.stop_reason)
