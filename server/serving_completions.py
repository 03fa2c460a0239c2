"""POST /v1/completions: OpenAI's legacy completions, streaming and not."""
from __future__ import annotations

from typing import AsyncIterator

import msgspec

from ringserve.server import protocol as P
from ringserve.server.context import ServerContext
from ringserve.server.generate import Choice, Generation
from ringserve.server.output_processor import TokenLogprob
from ringserve.server.sse import DONE, event
from ringserve.server.structured_outputs import compile_request


async def prepare(ctx: ServerContext, req: P.CompletionRequest, request_id: str) -> Generation:
    """Validate and tokenize; every problem is a 400 before anything reaches the engine."""
    P.check_model(req.model, ctx.served_model_names)
    echo_only = echo_without_generation(req)
    if echo_only:
        # As vLLM: the engine runs one token (it always samples the prompt's last position)
        # and the frontend drops it (SampleParams.discard_output).
        req = msgspec.structs.replace(req, max_tokens=1)
    P.check_common(req, ctx.limits, ctx.vocab_size)
    # The echoed prompt's logprobs, as vLLM gives them; the values checked before any tokenizing.
    params = P.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                               prompt_logprobs=req.logprobs if req.echo else None,
                               defaults=ctx.default_sampling)
    P.check_logprobs(req.logprobs, ctx.limits, param="logprobs")
    if req.suffix:
        raise P.bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise P.bad_request("best_of must equal n", param="best_of")
    inputs = P.prompt_inputs(req.prompt)
    P.check_choices(len(inputs), req.n, ctx.limits)  # before any tokenizing
    prompts = []
    for item in inputs:
        if isinstance(item, str):
            ids = await ctx.encode_prompt(item, req.add_special_tokens, param="prompt")
            if not ids:
                raise P.bad_request("prompt must not be empty", param="prompt")
        else:
            ids = item
            P.check_token_ids(ids, ctx.vocab_size, param="prompt")
        prompts.append(ids)
    max_tokens = min(P.check_length(len(ids), req.max_tokens, ctx.max_model_len, param="prompt",
                                    defaults=ctx.default_sampling)
                     for ids in prompts)
    # Every choice answers with its own copy of its (echoed) prompt's logprobs.
    positions = req.n * sum(max_tokens + (len(ids) if req.echo else 0) for ids in prompts)
    P.check_response_logprobs(positions, req.logprobs, ctx.limits, param="logprobs")
    grammar = await compile_request(req, ctx)  # off the loop (server/grammar_compiler.py)
    params = P.for_engine(req, params, max_tokens=max_tokens, structured_outputs=grammar)
    return Generation(ctx.engine, ctx.tokenizer, ctx.metrics, request_id, prompts, params, req.n,
                      skip_special_tokens=req.skip_special_tokens, discard_output=echo_only)


def echo_without_generation(req: P.CompletionRequest) -> bool:
    """`echo: true, max_tokens: 0`: the prompt (with its logprobs) and no completion tokens,
    as OpenAI's legacy API and vLLM answer it."""
    return req.echo and req.max_tokens == 0


def _logprobs(ctx: ServerContext, entries: list[TokenLogprob], offset: int) -> P.CompletionLogprobs:
    """OpenAI's completion logprobs from `offset` in the text (echoed prompt tokens included)."""
    lp = P.CompletionLogprobs()
    for e in entries:
        tok = ctx.token_text(e.token_id)
        lp.tokens.append(tok)
        lp.token_logprobs.append(e.logprob)
        top = None
        if e.logprob is not None:
            top = {ctx.token_text(t): v for t, v, _rank in e.top or ()}
            top.setdefault(tok, e.logprob)
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp


def _echoed(c: Choice) -> list[TokenLogprob]:
    """The prompt's entries: the first token has no logprob (nothing precedes it), as in
    OpenAI's and vLLM's echo; the others come from the engine's prompt_logprobs."""
    ids = c.prompt_token_ids
    scored = c.prompt_logprobs or [TokenLogprob(t, None) for t in ids[1:]]
    return [TokenLogprob(ids[0], None), *scored]


def _echo(ctx: ServerContext, req: P.CompletionRequest, choice: Choice) -> str:
    return ctx.tokenizer.decode(choice.prompt_token_ids, skip_special_tokens=False) if req.echo else ""


async def complete(ctx: ServerContext, req: P.CompletionRequest, gen: Generation,
                   request_id: str, model: str) -> P.CompletionResponse:
    async for _ in gen.deltas():
        pass
    choices = []
    for c in gen.choices:
        prefix = _echo(ctx, req, c)
        logprobs = None
        if req.logprobs is not None:
            logprobs = _logprobs(ctx, (_echoed(c) if req.echo else []) + c.logprobs, 0)
        choices.append(P.CompletionChoice(c.index, prefix + c.text.text, logprobs,
                                          c.finish_reason, c.stop_reason))
    return P.CompletionResponse(request_id, P.now(), model, choices, gen.usage())


async def stream(ctx: ServerContext, req: P.CompletionRequest, gen: Generation,
                 request_id: str, model: str) -> AsyncIterator[bytes]:
    created = P.now()
    offsets = [0] * len(gen.choices)
    echoed = [not req.echo] * len(gen.choices)
    async for d in gen.deltas():
        c = d.choice
        # The echo goes with a choice's first chunk: its prompt logprobs come with its first token.
        prefix, entries = "", d.logprobs
        if not echoed[c.index]:
            echoed[c.index] = True
            prefix, entries = _echo(ctx, req, c), _echoed(c) + entries
        lp = None
        if req.logprobs is not None:
            lp = _logprobs(ctx, entries, offsets[c.index])
            offsets[c.index] += sum(len(t) for t in lp.tokens)
        choice = P.CompletionChoice(c.index, prefix + d.text, lp,
                                    c.finish_reason if d.finished else None,
                                    c.stop_reason if d.finished else None)
        yield event(P.CompletionChunk(request_id, created, model, [choice]))
    if req.include_usage:
        yield event(P.CompletionChunk(request_id, created, model, [], gen.usage()))
    yield DONE
