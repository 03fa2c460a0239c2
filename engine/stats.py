"""What the engine core reports for each step as a whole (per-request outputs are
ipc/messages.py `EngineOutput`, the same in-process and on the wire)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """One step, as /metrics wants it (counters are for this step; the reader sums them)."""
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0             # 0..1
    num_preemptions: int = 0
    prefix_cache_queries: int = 0           # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0              # of which found
    num_prefill_tokens: int = 0             # tokens scheduled as prompt (or recompute)
    num_decode_tokens: int = 0
    num_scheduled_reqs: int = 0
