"""EngineConfig: every setting an engine is built with, in parts (vLLM's VllmConfig).

It holds a DeviceConfig and a CacheConfig (gpu/settings.py: the runner takes them whole), a
SchedulerConfig (below: the scheduler takes it whole) and the model fields. The runner learns
the scheduler's bounds as gpu's own StepLimits (step_limits). `LLM(**kwargs)` takes the flat
setting names, as vLLM's EngineArgs does (EngineConfig.create sorts them into the parts); the
launcher builds one from the `ringserve serve` flags of the same names (generated from these
fields), and the engine process (run_engine) and the runner (engine/core.py _make_runners) are
built from it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace

from ringserve.engine.kv_events import KVEventsConfig, parse_kv_events_config
from ringserve.engine.speculative import SpeculativeConfig, parse_speculative_config
from ringserve.gpu.settings import CacheConfig, DeviceConfig, StepLimits

# Tokens per step when max_num_batched_tokens is not given; longer prompts are chunked.
CUDA_MAX_NUM_BATCHED_TOKENS = 8192
# The CPU's is small so that a step stays short: every running request waits for the whole
# step for its next token. Measured (docs/engine.md, the default model, 2 cores): an 8,000-token
# prompt is one 84-166 s step at 8192, 4 steps of up to 37 s at 2048, 16 of 3.6-9 s at 512;
# its total cost is the same at any budget. 512 = 2 x the default max_num_seqs: all running
# sequences decode every step with room left for a prompt chunk.
CPU_MAX_NUM_BATCHED_TOKENS = 512


def max_num_batched_tokens_for(device: str) -> int:
    """The default tokens per step on a resolved device ("cpu" or "cuda")."""
    return CUDA_MAX_NUM_BATCHED_TOKENS if device == "cuda" else CPU_MAX_NUM_BATCHED_TOKENS


@dataclass(kw_only=True)
class SchedulerConfig:
    """The scheduler's budgets per step (vLLM's SchedulerConfig)."""
    max_num_seqs: int = field(default=256, metadata={
        "help": "most sequences in one engine step (the CUDA graph ladder goes up to it)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": f"most tokens in one engine step; longer prompts are prefilled in chunks "
                f"(default: {CUDA_MAX_NUM_BATCHED_TOKENS} on cuda, {CPU_MAX_NUM_BATCHED_TOKENS} "
                f"on cpu, where it keeps a step short: docs/engine.md)"})

    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "most tokens one request's prompt chunk takes in a step (vLLM's flag); 0: as many "
                "as max_num_batched_tokens leaves. A smaller cap keeps the steps short while a "
                "long prompt is prefilled, so the running streams get their tokens more often "
                "(cpu: below 256 a chunk attends key by key, not in tiles: docs/engine.md)"})

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be at least 0 (0: no cap), "
                             f"got {self.long_prefill_token_threshold}.")

    @property
    def token_budget(self) -> int:
        """max_num_batched_tokens as EngineConfig resolved it for the device."""
        if self.max_num_batched_tokens is None:
            raise ValueError("max_num_batched_tokens is not resolved: EngineConfig resolves it by device")
        return self.max_num_batched_tokens


def fit_max_model_len(requested: int | None, model_len: int, pool_tokens: int) -> tuple[int, str | None]:
    """The max_model_len an engine serves with, and a warning when it is less than asked for.
    requested: --max-model-len (None: not given, the model's max_position_embeddings);
    pool_tokens: the longest request the KV pool holds (its blocks x block size; with a window on
    every layer, any length whose window and chunk fit: engine/kv_cache.py). A pool that cannot hold one
    request of an explicit max_model_len is refused (ValueError, as vLLM refuses); without an
    explicit one the length is clamped to the pool, so that the default KV budget (the CPU's 1 GiB
    against a long-context model) still starts, and a longer request is a 400 at the frontend."""
    if requested is not None and requested > pool_tokens:
        raise ValueError(
            f"the KV pool holds {pool_tokens} tokens, less than one request of --max-model-len "
            f"{requested}: give a smaller --max-model-len, or a larger pool (--kv-cache-memory-bytes "
            f"on cpu, --gpu-memory-utilization on cuda, --num-gpu-blocks-override, --kv-cache-dtype)")
    if requested is None and model_len > pool_tokens:
        return pool_tokens, (f"max_model_len clamped from the model's {model_len} to {pool_tokens} "
                             f"tokens, what the KV pool holds (give a larger pool: "
                             f"--kv-cache-memory-bytes on cpu, --gpu-memory-utilization on cuda)")
    return (model_len if requested is None else requested), None


PARTS = {"device_config": DeviceConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig}


@dataclass(kw_only=True)
class EngineConfig:
    model: str | None = field(default=None, metadata={
        "help": "a Hugging Face model id (ORG/NAME; ORG/NAME:QUANT for one GGUF of a repository), "
                "a model folder, a .gguf file or a known name (default: SmolLM2-135M-Instruct); "
                "also the positional argument, as `vllm serve MODEL`"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "a tokenizer other than the model's: a folder with a tokenizer.json, or a Hugging "
                "Face repository's (ORG/NAME); its vocabulary must be the model's"})
    revision: str | None = field(default=None, metadata={
        "help": "a Hugging Face model id's branch, tag or commit (default: main)"})
    download_dir: str | None = field(default=None, metadata={
        "help": "the Hugging Face cache to look for and download a model id in (default: "
                "$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt + output in tokens (default: the model's "
                "max_position_embeddings); picks a LongRoPE model's factors (long past its "
                "original context)"})
    quantization: str | None = field(default=None, metadata={
        "help": "the checkpoint's quantization method (awq, gptq, gguf), as vLLM's flag; weights are "
                "served as stored, so another method is refused (default: the checkpoint's)"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "accepted for vLLM's command lines, with no effect: ringserve never runs code from "
                "a model repository (its architectures are built in)"})
    seed: int = field(default=0, metadata={
        "help": "seeds the sampling of requests that carry no seed of their own"})
    kv_events_config: str | None = field(default=None, metadata={
        "help": "publish KV-cache events as vLLM does, a JSON object of vLLM's keys: "
                "enable_kv_cache_events, publisher (\"zmq\"/\"null\"), endpoint, replay_endpoint, "
                "buffer_steps, hwm, max_queue_size, topic; each engine's ports are offset by its "
                "index (docs/scale-out.md; needs pyzmq, the kv-events extra). Published by the "
                "engine processes of `ringserve serve`, not by the offline LLM"})
    speculative_config: str | None = field(default=None, metadata={
        "help": "speculative decoding as vLLM spells it, a JSON object: {\"method\": \"ngram\", "
                "\"num_speculative_tokens\": K, \"prompt_lookup_max\": N, \"prompt_lookup_min\": M} "
                "or a draft model sharing the target's vocabulary, {\"model\": PATH_OR_ID, "
                "\"num_speculative_tokens\": K}; optionally \"disable_by_batch_size\" (default 8: "
                "no speculation in a step with more running requests; docs/speculative.md)"})
    # The parts: settings classes of their own (no flag each; their fields are the flags).
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        kv_events = parse_kv_events_config(self.kv_events_config)  # ValueError: one line
        if kv_events is not None and kv_events.enabled:
            try:
                import zmq  # noqa: F401 - the engine imports it; say so now, in one line
            except ImportError:
                raise ValueError("--kv-events-config: publisher \"zmq\" needs pyzmq "
                                 "(pip install 'ringserve[kv-events]')") from None
        if isinstance(self.speculative_config, dict):  # LLM(speculative_config={...}), as vLLM
            self.speculative_config = json.dumps(self.speculative_config)
        parse_speculative_config(self.speculative_config)  # ValueError: one line
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.scheduler_config.max_num_batched_tokens is None:  # the one place it is resolved
            from ringserve.gpu.devices import resolve_device
            budget = max_num_batched_tokens_for(resolve_device(self.device_config.device))
            self.scheduler_config = replace(self.scheduler_config, max_num_batched_tokens=budget)

    @classmethod
    def create(cls, **settings) -> EngineConfig:
        """An EngineConfig from the flat setting names (`LLM(**kwargs)`, vLLM's EngineArgs): each
        name goes to the part that declares it. An unknown name is a TypeError."""
        parts = {}
        for name, part in PARTS.items():
            own = {f.name for f in fields(part)}
            parts[name] = part(**{k: settings.pop(k) for k in list(settings) if k in own})
        return cls(**settings, **parts)

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """--kv-events-config parsed (None: not given)."""
        return parse_kv_events_config(self.kv_events_config)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config parsed (None: no speculation)."""
        return parse_speculative_config(self.speculative_config)

    @property
    def step_limits(self) -> StepLimits:
        """The scheduler's bounds on a step, as the runner takes them (with speculative
        decoding: the verify steps' K and most requests, for the CUDA runner's verify graphs)."""
        spec = self.speculative
        return StepLimits(max_num_seqs=self.scheduler_config.max_num_seqs,
                          max_num_batched_tokens=self.scheduler_config.token_budget,
                          max_model_len=self.max_model_len,
                          num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                          max_num_verify_seqs=spec.disable_by_batch_size if spec else 0,
                          long_prefill_token_threshold=self.scheduler_config.long_prefill_token_threshold)
