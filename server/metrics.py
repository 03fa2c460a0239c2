"""Prometheus metrics under vLLM's names, units and buckets, with the `ringserve:` prefix, or
`vllm:` with --metrics-prefix vllm (then a vLLM dashboard or a router's default scrape config
reads them as they are). The prefix is chosen once, in RequestMetrics; the engine metrics take it
from there.

Two sources make up one /metrics page:
- request metrics (TTFT, inter-token latency, e2e latency, token counters, finish reasons) are
  observed in the Gunicorn worker that served the request. With PROMETHEUS_MULTIPROC_DIR set (the
  launcher sets it before any worker starts), prometheus_client writes them to per-process files
  and `render` sums over all workers, alive or dead;
- engine metrics (running/waiting requests, KV-cache usage, cache config; cumulative preemptions
  and prefix-cache queries/hits) are read at scrape time from the stats every engine publishes
  in shared memory, one sample per engine (label `engine`, as vLLM labels them): a restarted
  engine's counters start again at 0, which rate() reads as a reset of that one series only.

Memory, two ways (docs/bench_quant.md "Where the memory goes" reads them): `memory_bytes{part}`
is what each engine holds by design (weights_packed: GGUF blocks and 16-bit weights as stored;
weights_float: float32 weights, norms; kv_cache: the pool, allocated, touched as it fills; with a
draft model for speculative decoding, draft_weights and draft_kv_cache, its own), and
`process_memory_pss_bytes{process}` what the machine counts at the scrape (server/memory.py):
the engines' PSS, and the frontend's (launcher, Gunicorn master and workers).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, … up to max_value (vLLM's token-count buckets)."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


@dataclass
class EngineSnapshot:
    """What one engine publishes, as the frontend reads it."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float      # 0..1
    num_preemptions: int = 0          # the rest: cumulative since the engine started
    prefix_cache_queries: int = 0     # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0        # of which found
    kv_cache_bytes: int = 0           # the memory it holds, written once at its start
    pid: int = 0                      # its process (server/memory.py reads its PSS)
    weight_bytes: dict[str, int] | None = None   # by storage type ("Q4_K", "F32", ...)
    # speculative decoding (ipc/stats.py EngineStats.spec_decode): drafts, draft tokens,
    # accepted tokens, steps off by batch size, accepted per position; None: not speculating
    spec_decode: tuple[int, int, int, int, list[int]] | None = None
    draft_weight_bytes: int = 0       # a draft model's (speculative decoding), 0: none
    draft_kv_cache_bytes: int = 0


@dataclass
class CacheConfig:
    block_size: int
    num_gpu_blocks: int


def spec_decode_metrics(P: str, model_name: str, stats: list[EngineSnapshot]) -> Iterable:
    """vLLM's spec_decode counters (engine/speculation.py), and ours for the steps that did not
    speculate because the batch was large (--speculative-config disable_by_batch_size)."""
    labels = ["model_name", "engine"]
    families = [CounterMetricFamily(P + name, doc, labels=labels) for name, doc in (
        ("spec_decode_num_drafts", "Number of spec decoding drafts."),
        ("spec_decode_num_draft_tokens", "Number of draft tokens."),
        ("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
        ("spec_decode_num_disabled_steps",
         "Engine steps that did not speculate: more running requests than disable_by_batch_size."))]
    per_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.", labels=[*labels, "position"])
    for i, s in enumerate(stats):
        if s.spec_decode is None:
            continue
        lv = [model_name, str(i)]
        *counts, positions = s.spec_decode
        for family, n in zip(families, counts, strict=True):
            family.add_metric(lv, n)
        for pos, n in enumerate(positions):
            per_pos.add_metric([*lv, str(pos)], n)
    yield from (*families, per_pos)


class RequestMetrics:
    """The per-request metrics one worker observes."""

    def __init__(self, model_name: str, max_model_len: int, prefix: str = "ringserve"):
        self.prefix = P = prefix + ":"  # every metric's name starts with it, engine ones too
        self._registry = None if multiprocess() else CollectorRegistry()
        labels = ["model_name"]
        tokens_buckets = build_1_2_5_buckets(max_model_len)
        kw: dict[str, Any] = dict(labelnames=labels, registry=self._registry)
        self.ttft = Histogram(P + "time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              buckets=TTFT_BUCKETS, **kw).labels(model_name)
        self.itl = Histogram(P + "inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             buckets=ITL_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram(P + "e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             buckets=E2E_BUCKETS, **kw).labels(model_name)
        self.request_prompt_tokens = Histogram(
            P + "request_prompt_tokens", "Number of prefill tokens processed.",
            buckets=tokens_buckets, **kw).labels(model_name)
        self.request_generation_tokens = Histogram(
            P + "request_generation_tokens", "Number of generation tokens processed.",
            buckets=tokens_buckets, **kw).labels(model_name)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Number of prefill tokens processed.",
                                     **kw).labels(model_name)
        self.generation_tokens = Counter(P + "generation_tokens",
                                         "Number of generation tokens processed.",
                                         **kw).labels(model_name)
        self._success = Counter(P + "request_success",
                                "Count of successfully processed requests.",
                                labelnames=["model_name", "finished_reason"],
                                registry=self._registry)
        self._model_name = model_name

    def finished(self, finish_reason: str, num_prompt_tokens: int, num_generated: int,
                 e2e_seconds: float) -> None:
        """One engine request ended (aborted ones count their tokens but not as a success)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated)
        if finish_reason in ("stop", "length"):
            self._success.labels(self._model_name, finish_reason).inc()
            self.e2e.observe(e2e_seconds)
            self.request_prompt_tokens.observe(num_prompt_tokens)
            self.request_generation_tokens.observe(num_generated)
        elif finish_reason == "abort":
            self._success.labels(self._model_name, "abort").inc()

    def registry(self) -> CollectorRegistry:
        if self._registry is not None:
            return self._registry
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return registry


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class _EngineCollector:
    def __init__(self, prefix: str, model_name: str, stats: list[EngineSnapshot],
                 cache: CacheConfig | None, resident: dict[str, int]):
        self._prefix, self._model_name, self._stats, self._cache = prefix, model_name, stats, cache
        self._resident = resident

    def collect(self) -> Iterable:
        P = self._prefix
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily(P + "num_requests_running",
                                    "Number of requests in model execution batches.",
                                    labels=labels)
        waiting = GaugeMetricFamily(P + "num_requests_waiting",
                                    "Number of requests waiting to be processed.", labels=labels)
        usage = GaugeMetricFamily(P + "kv_cache_usage_perc",
                                  "KV-cache usage. 1 means 100 percent usage.", labels=labels)
        preempt = CounterMetricFamily(P + "num_preemptions",
                                      "Cumulative number of preemption from the engine.",
                                      labels=labels)
        queries = CounterMetricFamily(
            P + "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.", labels=labels)
        hits = CounterMetricFamily(
            P + "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.", labels=labels)
        kv_bytes = GaugeMetricFamily(P + "kv_cache_bytes",
                                     "Memory the engine's KV-cache pool takes, in bytes.", labels=labels)
        weights = GaugeMetricFamily(P + "model_weight_bytes",
                                    "Memory the engine's weights take, in bytes, by storage type.",
                                    labels=[*labels, "type"])
        for i, s in enumerate(self._stats):
            lv = [self._model_name, str(i)]
            running.add_metric(lv, s.num_running)
            waiting.add_metric(lv, s.num_waiting)
            usage.add_metric(lv, s.kv_cache_usage)
            preempt.add_metric(lv, s.num_preemptions)
            queries.add_metric(lv, s.prefix_cache_queries)
            hits.add_metric(lv, s.prefix_cache_hits)
            kv_bytes.add_metric(lv, s.kv_cache_bytes)
            for kind, nbytes in (s.weight_bytes or {}).items():
                weights.add_metric([*lv, kind], nbytes)
        yield from (running, waiting, usage, preempt, queries, hits, kv_bytes, weights)
        yield from memory_metrics(P, self._model_name, self._stats, self._resident)
        if any(s.spec_decode is not None for s in self._stats):
            yield from spec_decode_metrics(P, self._model_name, self._stats)
        if self._cache is not None:
            info = GaugeMetricFamily(P + "cache_config_info",
                                     "Information of the LLMEngine CacheConfig",
                                     labels=["block_size", "num_gpu_blocks"])
            info.add_metric([str(self._cache.block_size), str(self._cache.num_gpu_blocks)], 1.0)
            yield info


def memory_metrics(P: str, model_name: str, stats: list[EngineSnapshot],
                   resident: dict[str, int]) -> Iterable:
    """Each engine's bytes by part, and the PSS of the server's processes by kind (the module doc)."""
    parts = GaugeMetricFamily(P + "memory_bytes", "Memory an engine holds, in bytes, by part: packed "
                              "and float weights as stored, the KV-cache pool as allocated.",
                              labels=["model_name", "engine", "part"])
    for i, s in enumerate(stats):
        weights = s.weight_bytes or {}
        floats = sum(n for kind, n in weights.items() if kind == "F32")
        for part, n in (("weights_packed", sum(weights.values()) - floats), ("weights_float", floats),
                        ("kv_cache", s.kv_cache_bytes)):
            parts.add_metric([model_name, str(i), part], n)
        if s.draft_weight_bytes:  # a draft model (speculative decoding): its own parts
            parts.add_metric([model_name, str(i), "draft_weights"], s.draft_weight_bytes)
            parts.add_metric([model_name, str(i), "draft_kv_cache"], s.draft_kv_cache_bytes)
    yield parts
    if resident:
        pss = GaugeMetricFamily(P + "process_memory_pss_bytes", "Proportional set size of the "
                                "server's processes, in bytes, by kind (engine, frontend).",
                                labels=["model_name", "process"])
        for kind, n in resident.items():
            pss.add_metric([model_name, kind], n)
        yield pss


def render(requests: RequestMetrics, model_name: str, engine_stats: list[EngineSnapshot],
           cache: CacheConfig | None, resident: dict[str, int] | None = None) -> bytes:
    """The whole /metrics page: every worker's request metrics plus every engine's gauges;
    resident: the processes' PSS by kind (server/memory.py), where known."""
    engines = CollectorRegistry()
    engines.register(_EngineCollector(requests.prefix, model_name, engine_stats, cache, resident or {}))
    return generate_latest(requests.registry()) + generate_latest(engines)


def mark_process_dead(pid: int) -> None:
    """Gunicorn's child_exit hook: drop a dead worker's live-gauge files (counters stay)."""
    if multiprocess():
        from prometheus_client import multiprocess as mp
        mp.mark_process_dead(pid)



