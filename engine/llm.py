"""The offline API, shaped like vLLM's `LLM` where they overlap.

    llm = LLM(model="SmolLM2-135M-Instruct", max_num_seqs=64, enable_prefix_caching=True)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))
    outs[0].outputs[0].text

It runs an EngineCore in this process until every request of the call is done. It is a
frontend facade (like vLLM's entrypoints/llm.py): the one engine module that tokenizes.
A request the engine refuses (too long for max_model_len or the pool) raises ValueError.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence, Union

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.engine.outputs import PositionLogprobs
from ringserve.engine.sampling_params import SamplingParams
from ringserve.gpu.model_store import resolve_model
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
    stop_reason: int | None = None

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
        for prompt, params in zip(prompts, sampling_params):
            if isinstance(prompt, str):
                text, ids = prompt, self.tokenizer.encode(prompt)
            else:
                text, ids = None, [int(t) for t in prompt]
            rid = str(next(self._ids))
            results[rid] = GenerationOutput(rid, text, ids, [CompletionOutput(i) for i in range(params.n)])
            self.engine.add_request(rid, ids, params)
        self._run(results)
        for res in results.values():
            for c in res.outputs:
                c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
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

    def _run(self, results: dict[str, GenerationOutput]) -> None:
        error = None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finish_reason == "error" and error is None:
                    error = out.error
                    for rid in results:                # give the rest up: the call will raise
                        self.engine.abort_request(rid)
                res = results.get(out.request_id)
                if res is None:
                    continue
                c = res.outputs[out.index]
                c.token_ids.extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    c.logprobs = (c.logprobs or []) + out.new_logprobs
                if out.finished:
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        if error is not None:
            raise ValueError(error)
