"""EngineConfig: every setting an engine is built with, flat (vLLM's EngineArgs).

The union of gpu/settings.py's DeviceConfig, CacheConfig and SchedulerConfig (which the runner
reads too) and the model fields below. `LLM(**kwargs)` takes these names, the launcher builds
one from the `ringserve serve` flags of the same names (generated from these fields), and the
engine process (run_engine) and the runner (engine/core.py _make_runner) are built from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.engine.kv_events import KVEventsConfig, parse_kv_events_config
from ringserve.gpu.settings import CacheConfig, DeviceConfig, SchedulerConfig, max_num_batched_tokens_for


@dataclass(kw_only=True)
class EngineConfig(DeviceConfig, CacheConfig, SchedulerConfig):
    model: str | None = field(default=None, metadata={
        "help": "a known model name, an HF folder or a .gguf file (default: the default model, "
                "SmolLM2-135M-Instruct)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt + output in tokens (default: the model's "
                "max_position_embeddings)"})
    seed: int = field(default=0, metadata={
        "help": "seeds the sampling of requests that carry no seed of their own"})
    kv_events_config: str | None = field(default=None, metadata={
        "help": "publish KV-cache events as vLLM does, a JSON object of vLLM's keys: "
                "enable_kv_cache_events, publisher (\"zmq\"/\"null\"), endpoint, replay_endpoint, "
                "buffer_steps, hwm, max_queue_size, topic; each engine's ports are offset by its "
                "index (docs/scale-out.md; needs pyzmq, the kv-events extra). Published by the "
                "engine processes of `ringserve serve`, not by the offline LLM"})

    def __post_init__(self) -> None:
        DeviceConfig.__post_init__(self)
        CacheConfig.__post_init__(self)
        SchedulerConfig.__post_init__(self)
        kv_events = parse_kv_events_config(self.kv_events_config)  # ValueError: one line
        if kv_events is not None and kv_events.enabled:
            try:
                import zmq  # noqa: F401 - the engine imports it; say so now, in one line
            except ImportError:
                raise ValueError("--kv-events-config: publisher \"zmq\" needs pyzmq "
                                 "(pip install 'ringserve[kv-events]')") from None
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.max_num_batched_tokens is None:  # the one place the by-device default is resolved
            from ringserve.gpu.devices import resolve_device
            self.max_num_batched_tokens = max_num_batched_tokens_for(resolve_device(self.device))

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """--kv-events-config parsed (None: not given)."""
        return parse_kv_events_config(self.kv_events_config)

    @property
    def token_budget(self) -> int:
        """max_num_batched_tokens as resolved for the device (never None once built)."""
        assert self.max_num_batched_tokens is not None
        return self.max_num_batched_tokens
