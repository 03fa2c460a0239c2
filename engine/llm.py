"""The offline API, shaped like vLLM's `LLM` where they overlap.

    llm = LLM(model="SmolLM2-135M-Instruct", max_num_seqs=64, enable_prefix_caching=True)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))
    outs[0].outputs[0].text

It runs an EngineCore in this process until every request of the call is done. It is a
frontend facade (like vLLM's entrypoints/llm.py): the one engine module that tokenizes and
detokenizes, with the HTTP server's own code (server/tokenizer.py, server/output_text.py), so
that stop strings end a sample exactly as they do over HTTP (the engine sample is aborted).
A request the engine refuses (too long for max_model_len or the pool) raises ValueError.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence, Union

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.engine.outputs import PositionLogprobs, RequestOutput
from ringserve.engine.sampling_params import SamplingParams
from ringserve.gpu.model_store import resolve_model
from ringserve.server.output_text import OutputText
from ringserve.server.tokenizer import Tokenizer

PromptType = Union[str, Sequence[int]]


@dataclass
class CompletionOutput:
    """One of the n samples of a request (vLLM's CompletionOutput)."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None    # the stop token id or stop string that ended it

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(lp[t].logprob for lp, t in zip(self.logprobs, self.token_ids))


@dataclass
class GenerationOutput:
    """One prompt's result (vLLM's RequestOutput)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # With SamplingParams(prompt_logprobs=N): per prompt token, None for the first, then
    # {token id: Logprob} with the prompt's own token and the top N.
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """model: a known name (None: the default model), an HF folder or a .gguf file;
        engine_args: the EngineConfig fields (the `ringserve serve` flags in snake_case)."""
        model_dir = resolve_model(model)
        self.config = EngineConfig(model=str(model_dir), **engine_args)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[GenerationOutput]:
        """Texts or token-id lists (one prompt, or a list of them) -> one output per prompt, in order."""
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} SamplingParams")
        results: dict[str, GenerationOutput] = {}
        texts: dict[tuple[str, int], OutputText] = {}
        for prompt, params in zip(prompts, sampling_params):
            if isinstance(prompt, str):
                text, ids = prompt, self.tokenizer.encode(prompt)
            else:
                text, ids = None, [int(t) for t in prompt]
            rid = str(next(self._ids))
            results[rid] = GenerationOutput(rid, text, ids, [CompletionOutput(i) for i in range(params.n)])
            for i in range(params.n):
                texts[rid, i] = OutputText(self.tokenizer.decode_stream(skip_special_tokens=True),
                                           params.stop, min_tokens=params.min_tokens,
                                           include_stop=params.include_stop_str_in_output)
            self.engine.add_request(rid, ids, params)
        self._run(results, texts)
        for (rid, i), text in texts.items():
            results[rid].outputs[i].text = text.text
        return list(results.values())

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[GenerationOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the
        model's chat template. The template writes the special tokens itself."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt) for c in conversations]
        outs = self.generate([self.tokenizer.encode(t, add_special_tokens=False) for t in texts],
                             sampling_params)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def _run(self, results: dict[str, GenerationOutput], texts: dict[tuple[str, int], OutputText]) -> None:
        error = None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finish_reason == "error" and error is None:
                    error = out.error
                    for rid in results:                # give the rest up: the call will raise
                        self.engine.abort_request(rid)
                res = results.get(out.request_id)
                if res is not None and res.outputs[out.index].finish_reason is None:
                    self._apply(res, texts[out.request_id, out.index], out)
        if error is not None:
            raise ValueError(error)

    def _apply(self, res: GenerationOutput, text: OutputText, out: RequestOutput) -> None:
        """One engine output into its sample; a stop string ends the sample here (the tokens
        after the one that completed it are dropped) and aborts it in the engine."""
        c = res.outputs[out.index]
        if out.prompt_logprobs is not None:
            res.prompt_logprobs = out.prompt_logprobs
        before = text.num_tokens
        text.push(out.new_token_ids)
        kept = text.num_tokens - before
        c.token_ids.extend(out.new_token_ids[:kept])
        if out.new_logprobs is not None:
            c.logprobs = (c.logprobs or []) + out.new_logprobs[:kept]
        if text.stop_string is not None:
            c.finish_reason, c.stop_reason = "stop", text.stop_string
            if not out.finished:
                self.engine.abort_request(out.request_id, out.index)
        elif out.finished:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
