"""EngineConfig: every setting an engine is built with, flat (vLLM's EngineArgs).

The union of gpu/settings.py's DeviceConfig, CacheConfig and SchedulerConfig (which the runner
reads too) and the model fields below. `LLM(**kwargs)` takes these names, the launcher builds
one from the `ringserve serve` flags of the same names (generated from these fields), and the
engine process (run_engine) and the runner (engine/core.py _make_runner) are built from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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

    def __post_init__(self) -> None:
        DeviceConfig.__post_init__(self)
        CacheConfig.__post_init__(self)
        SchedulerConfig.__post_init__(self)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.max_num_batched_tokens is None:  # the one place the by-device default is resolved
            from ringserve.gpu.devices import resolve_device
            self.max_num_batched_tokens = max_num_batched_tokens_for(resolve_device(self.device))

    @property
    def token_budget(self) -> int:
        """max_num_batched_tokens as resolved for the device (never None once built)."""
        assert self.max_num_batched_tokens is not None
        return self.max_num_batched_tokens
