"""The app of one Gunicorn worker: `gunicorn ... 'ringserve.server.worker:worker_app()'`.

Built after the fork, from the JSON the launcher puts in RINGSERVE_WORKER_CONFIG: the model
folder (already resolved: a worker never downloads or converts), the served names, the
engines' control sockets. The engine client connects at ASGI startup, on the worker's own loop.
"""
from __future__ import annotations

import functools
import gc
import json
import logging
import os

from ringserve.ipc.stats import (
    BLOCK_SIZE,
    DRAFT_KV_CACHE_BYTES,
    DRAFT_WEIGHT_BYTES,
    KV_CACHE_BYTES,
    NUM_BLOCKS,
    NUM_FREE_BLOCKS,
    NUM_PREEMPTIONS,
    PID,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
)
from ringserve.server.app import AppOptions, create_app
from ringserve.server.config import WORKER_CONFIG_ENV, RequestLimits, StructuredOutputsConfig
from ringserve.server.context import ServerContext
from ringserve.server.debug import engine_views
from ringserve.server.engine_client import EngineClient, EngineUnavailable
from ringserve.server.memory import release_free_heap, server_root, tree_pss_bytes
from ringserve.server.metrics import CacheConfig, EngineSnapshot, RequestMetrics
from ringserve.server.tokenizer import Tokenizer

log = logging.getLogger("ringserve.worker")


def snapshots(client: EngineClient) -> list[EngineSnapshot]:
    """What each connected engine last published (a dead engine has no sample)."""
    out = []
    for e in client.engines:
        if e is None:
            continue
        s = e.stats
        blocks = s[NUM_BLOCKS]
        usage = 1.0 - s[NUM_FREE_BLOCKS] / blocks if blocks else 0.0
        out.append(EngineSnapshot(s.running, s.waiting, usage, num_preemptions=s[NUM_PREEMPTIONS],
                                  prefix_cache_queries=s[PREFIX_CACHE_QUERIES],
                                  prefix_cache_hits=s[PREFIX_CACHE_HITS],
                                  kv_cache_bytes=s[KV_CACHE_BYTES], weight_bytes=s.weight_bytes(), pid=s[PID],
                                  spec_decode=s.spec_decode(), draft_weight_bytes=s[DRAFT_WEIGHT_BYTES],
                                  draft_kv_cache_bytes=s[DRAFT_KV_CACHE_BYTES]))
    return out


def resident_memory(engines: list[EngineSnapshot]) -> dict[str, int]:
    """The PSS of this server's engines and of its frontend (the launcher's tree without them)."""
    pids = frozenset(s.pid for s in engines if s.pid)
    return {"engine": sum(tree_pss_bytes(p) for p in pids), "frontend": tree_pss_bytes(server_root(), pids)}


def cache_config(client: EngineClient) -> CacheConfig | None:
    for e in client.engines:
        if e is not None:
            return CacheConfig(e.stats[BLOCK_SIZE], e.stats[NUM_BLOCKS])
    return None


@functools.cache
def load_tokenizer(tokenizer_dir: str, chat_template: str | None) -> Tokenizer:
    """The workers' tokenizer, made once per process: preload makes it in the master."""
    return Tokenizer.from_dir(tokenizer_dir, chat_template)


def _tokenizer_of(cfg: dict) -> Tokenizer:
    return load_tokenizer(cfg.get("tokenizer_dir") or cfg["model_dir"], cfg.get("chat_template"))


def preload() -> None:
    """In Gunicorn's master, before it forks the workers (gunicorn_conf.on_starting): this module's
    imports and the tokenizer, made once, so that every worker shares their pages instead of
    making its own (PSS counts a page shared by n processes 1/n in each; a 128K-entry tokenizer
    is ~45 MB a process, the imports ~40 MB). Nothing here starts a thread (a fork after one is
    unsafe): the tokenizer's thread pool starts on its first batch encode, in a worker."""
    try:
        _tokenizer_of(json.loads(os.environ[WORKER_CONFIG_ENV]))
    except Exception:  # NOTE: each worker then makes it and reports the error as it always has
        log.debug("the tokenizer was not preloaded", exc_info=True)
    release_free_heap()  # NOTE: before the fork, so that no worker inherits the parse's garbage
    # NOTE: what exists now out of the cyclic collector's reach: a worker's collections would
    # otherwise write to every inherited object's header and copy its page (CPython's gc docs;
    # master + worker 117 -> 108 MB PSS after a c=16 run on the 1B)
    gc.freeze()


def worker_app():
    cfg = json.loads(os.environ[WORKER_CONFIG_ENV])
    names = cfg["served_model_names"]
    client = EngineClient(cfg["control_paths"], max_stream_backlog=cfg["max_stream_backlog"])
    tokenizer = _tokenizer_of(cfg)
    ctx = ServerContext(tokenizer, client, names, cfg["max_model_len"],
                        RequestMetrics(names[0], cfg["max_model_len"], cfg["metrics_prefix"]),
                        RequestLimits(**cfg["request_limits"]), cfg["vocab_size"],
                        tool_call_parser=cfg.get("tool_call_parser"),
                        structured=StructuredOutputsConfig(**cfg["structured_outputs"]),
                        reasoning_parser=cfg.get("reasoning_parser"),
                        default_sampling=cfg.get("default_sampling") or {})

    async def stop() -> None:
        await ctx.grammars.close()
        await client.close()

    async def start() -> None:
        await client.start()
        try:  # engines are up before Gunicorn starts: accept only once connected
            await client.wait_ready(timeout=30.0)
        except EngineUnavailable as exc:  # one is restarting: answer 503 until it is back
            log.warning("%s", exc)
        release_free_heap()  # what building the app and connecting left freed (server/memory.py)

    options = AppOptions(
        api_key=cfg.get("api_key"), max_body_bytes=cfg["max_body_bytes"],
        model_root=cfg["model_dir"],
        engine_alive=lambda: client.num_ready > 0,
        engine_snapshots=lambda: snapshots(client),
        resident_memory=lambda: resident_memory(snapshots(client)),
        cache_config=lambda: cache_config(client),
        on_startup=[start], on_shutdown=[stop],
        server_info=cfg["server_info"],
        kv_event_sources=cfg["kv_event_sources"],
        log_requests=not cfg.get("disable_log_requests", False),
        allowed_origins=cfg.get("allowed_origins"), root_path=cfg.get("root_path"),
        allowed_methods=cfg.get("allowed_methods", ["*"]), allowed_headers=cfg.get("allowed_headers", ["*"]),
        allow_credentials=cfg.get("allow_credentials", False),
        debug_engines=((lambda: engine_views(client, cfg["debug_paths"]))
                       if cfg.get("debug_paths") else None))
    return create_app(ctx, options)
