"""The offline API, shaped like vLLM's `LLM` where they overlap; one import line brings it:

    from ringserve.server.llm import LLM, SamplingParams

    llm = LLM(model="SmolLM2-135M-Instruct", max_num_seqs=64, enable_prefix_caching=True)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))
    outs[0].outputs[0].text

It runs an EngineCore in this process until every request of the call is done. It is a
frontend like the HTTP server (vLLM's entrypoints/llm.py), so it lives beside it and uses its
code: server/tokenizer.py and the output processor (server/output_processor.py), so that text,
stop strings, logprobs and finish reasons come out exactly as they do over HTTP (a stop string
aborts the engine sample). A request the engine refuses (too long for max_model_len or the
pool) raises ValueError.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence, Union, cast

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.gpu.loader.config import generation_defaults
from ringserve.gpu.loader.model_store import resolve_model, resolve_tokenizer
from ringserve.gpu.loader.weights import check_quantization
from ringserve.ipc.messages import FinishReason
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.server.output_processor import SampleParams, SampleState, TokenLogprob
from ringserve.server.tokenizer import Tokenizer

__all__ = ["LLM", "SamplingParams", "GenerationOutput", "CompletionOutput", "Logprob"]

PromptType = Union[str, Sequence[int]]


@dataclass
class Logprob:
    logprob: float
    rank: int | None                 # 1 = the most likely token


# vLLM's per-position logprobs: token id -> Logprob (the token itself and the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the n samples of a request (vLLM's CompletionOutput)."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None    # the stop token id or stop string that ended it

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(lp[t].logprob for lp, t in zip(self.logprobs, self.token_ids, strict=True))


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
        """model: a known name (None: the default model), a Hugging Face id (ORG/NAME,
        ORG/NAME:QUANT), an HF folder or a .gguf file; engine_args: the setting names of
        EngineConfig and its parts, flat (the `ringserve serve` flags in snake_case, as vLLM's
        EngineArgs; revision and download_dir pick a Hugging Face id's files): EngineConfig.create
        sorts them. generation_config: vLLM's, as the server's --generation-config: "auto" (the
        default) takes the model's generation_config.json sampling fields as the defaults of a
        call without SamplingParams, "vllm" SamplingParams' own, a folder its file's."""
        generation_config = engine_args.pop("generation_config", "auto")
        model_dir = resolve_model(model, revision=engine_args.get("revision"),
                                  download_dir=engine_args.get("download_dir"))
        if engine_args.get("tokenizer") is not None:
            engine_args["tokenizer"] = str(resolve_tokenizer(engine_args["tokenizer"],
                                                             engine_args.get("download_dir")))
        self.config = EngineConfig.create(model=str(model_dir), **engine_args)
        check_quantization(self.config.quantization, model_dir)
        self.default_sampling = generation_defaults(generation_config, model_dir)
        self.tokenizer = Tokenizer.from_dir(self.config.tokenizer or model_dir)
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams samples with (vLLM's method): generation_config's
        defaults over SamplingParams' own (a caller's SamplingParams is taken as it is)."""
        return SamplingParams(**self.default_sampling)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[GenerationOutput]:
        """Texts or token-id lists (one prompt, or a list of them) -> one output per prompt, in order."""
        batch = cast(list[PromptType], [prompts] if _is_one_prompt(prompts) else list(prompts))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(batch)
        if len(sampling_params) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(sampling_params)} SamplingParams")
        results: dict[str, tuple[GenerationOutput, SamplingParams]] = {}
        samples: dict[tuple[str, int], SampleState] = {}
        for prompt, params in zip(batch, sampling_params, strict=True):
            if isinstance(prompt, str):
                text, ids = prompt, self.tokenizer.encode(prompt)
            else:
                text, ids = None, [int(t) for t in prompt]
            rid = str(next(self._ids))
            results[rid] = GenerationOutput(rid, text, ids, []), params
            stop = cast(list[str], params.stop)  # SamplingParams.__post_init__ made it a list
            sample = SampleParams(stop, params.min_tokens, params.include_stop_str_in_output)
            for i in range(params.n):
                samples[rid, i] = SampleState(self.tokenizer, ids, sample)
            self.engine.add_request(rid, ids, params)
        self._run(samples)
        for rid, (res, params) in results.items():
            states = [samples[rid, i] for i in range(params.n)]
            res.outputs = [_completion(i, s, params.logprobs is not None) for i, s in enumerate(states)]
            if params.prompt_logprobs is not None:
                res.prompt_logprobs = [None, *_as_dicts(states[0].prompt_logprobs or [])]
        return [res for res, _ in results.values()]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True,
             tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[GenerationOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the
        model's chat template. The template writes the special tokens itself. tools: OpenAI's
        tool definitions, for the template (as vLLM's LLM.chat: the output is not parsed; a
        call can be constrained with SamplingParams(structured_outputs=...)).
        chat_template_kwargs: more variables for the template (Qwen3's enable_thinking), as the
        HTTP server's field of that name and vLLM's LLM.chat take them."""
        conversations = cast(list[list[dict]], [messages] if messages and isinstance(messages[0], dict)
                             else list(messages))
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools  # as transformers passes them
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, **extra)
                 for c in conversations]
        outs = self.generate([self.tokenizer.encode(t, add_special_tokens=False) for t in texts],
                             sampling_params)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text
        return outs

    def _run(self, samples: dict[tuple[str, int], SampleState]) -> None:
        """Step the engine until the call's requests are done, each output through its sample."""
        error = None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                state = samples.get((out.request_id, out.index))
                delta = state.process(out) if state is not None else None
                if state is None or delta is None:
                    continue
                if state.error is not None and error is None:
                    error = state.error
                    for rid, _ in samples:             # give the rest up: the call will raise
                        self.engine.abort_request(rid)
                elif delta.abort_engine:               # a stop string ended this sample
                    self.engine.abort_request(out.request_id, out.index)
        if error is not None:
            raise ValueError(error)


def _is_one_prompt(prompts: PromptType | Sequence[PromptType]) -> bool:
    """A text, or a token-id list (a list of ints), rather than a list of prompts."""
    return isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))


def _completion(index: int, state: SampleState, with_logprobs: bool) -> CompletionOutput:
    return CompletionOutput(index, state.text.text, state.token_ids,
                            _as_dicts(state.logprobs) if with_logprobs else None,
                            state.finish_reason, state.stop_reason)


def _as_dicts(entries: list[TokenLogprob]) -> list[PositionLogprobs]:
    return [{t: Logprob(lp, rank) for t, lp, rank in e.top or ()} for e in entries]
