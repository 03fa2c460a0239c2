"""POST /v1/chat/completions: messages rendered with the model's chat template (jinja2)."""
from __future__ import annotations

from typing import AsyncIterator, cast

from ringserve.server import protocol as P
from ringserve.server.context import ServerContext
from ringserve.server.generate import Generation
from ringserve.server.output_processor import TokenLogprob
from ringserve.server.sse import DONE, event
from ringserve.server.structured_outputs import compile_request


def render_prompt(ctx: ServerContext, messages: list[P.ChatMessage],
                  add_generation_prompt: bool) -> str:
    dicts = [m.to_template_dict() for m in messages]
    try:
        return ctx.tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:  # ChatTemplateError: the template refused these messages
        raise P.bad_request(f"cannot apply the chat template: {exc}", param="messages") from None


def prepare(ctx: ServerContext, req: P.ChatCompletionRequest, request_id: str) -> Generation:
    P.check_model(req.model, ctx.served_model_names)
    P.check_common(req, ctx.limits, ctx.vocab_size)
    P.check_logprobs(req.top_logprobs, ctx.limits, param="top_logprobs")
    P.check_choices(1, req.n, ctx.limits)
    if req.tools:
        raise P.bad_request("tools are not supported", param="tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise P.bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
    text = render_prompt(ctx, req.messages, req.add_generation_prompt)
    # The template already holds the special tokens (as vLLM's chat default).
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise P.bad_request("the rendered prompt is empty", param="messages")
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = P.check_length(len(ids), asked, ctx.max_model_len, param="messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    P.check_response_logprobs(req.n * max_tokens, logprobs, ctx.limits, param="top_logprobs")
    params = P.sampling_kwargs(req, max_tokens=max_tokens, logprobs=logprobs,
                               structured_outputs=compile_request(req, ctx.tokenizer))
    return Generation(ctx.engine, ctx.tokenizer, ctx.metrics, request_id, [ids], params, req.n,
                      P.stop_list(req.stop), include_stop=req.include_stop_str_in_output,
                      skip_special_tokens=req.skip_special_tokens)


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
    for c in gen.choices:
        lp = _logprobs(ctx, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
        choices.append(P.ChatChoice(c.index, P.ResponseMessage("assistant", c.text.text), lp,
                                    c.finish_reason, c.stop_reason))
    return P.ChatCompletionResponse(request_id, P.now(), model, choices, gen.usage())


async def stream(ctx: ServerContext, req: P.ChatCompletionRequest, gen: Generation,
                 request_id: str, model: str) -> AsyncIterator[bytes]:
    created = P.now()
    for c in gen.choices:
        first = P.ChatChunkChoice(c.index, P.DeltaMessage(role="assistant", content=""))
        yield event(P.ChatCompletionChunk(request_id, created, model, [first]))
    async for d in gen.deltas():
        c = d.choice
        lp = _logprobs(ctx, d.logprobs, req.top_logprobs or 0) if req.logprobs else None
        choice = P.ChatChunkChoice(c.index, P.DeltaMessage(content=d.text), lp,
                                   c.finish_reason if d.finished else None,
                                   c.stop_reason if d.finished else None)
        yield event(P.ChatCompletionChunk(request_id, created, model, [choice]))
    if req.include_usage:
        yield event(P.ChatCompletionChunk(request_id, created, model, [], gen.usage()))
    yield DONE
