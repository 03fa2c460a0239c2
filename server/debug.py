"""GET /debug/engines and GET /dashboard, only with `ringserve serve --enable-debug-endpoints`.

Each engine then writes a JSON snapshot of itself (queues, the block pool block by block, its
recent steps; engine/trace.py) into the server's private runtime folder, at most five times a
second while busy. /debug/engines adds what this worker's engine client sees (connected, the
routing score) and returns them all; /dashboard is one self-contained HTML page (inline CSS and
JS, no outside assets) that polls it and draws the pool and the step composition.
"""
from __future__ import annotations

import json
import os
import time
from importlib.resources import files
from typing import Any, Callable

import falcon

_encode = json.JSONEncoder(separators=(",", ":")).encode


def engine_views(client, debug_paths: list[str]) -> list[dict[str, Any]]:
    """One entry per engine: this worker's view of it and the engine's last snapshot."""
    out = []
    now = time.monotonic()
    for i, path in enumerate(debug_paths):
        engine = client.engines[i] if i < len(client.engines) else None
        try:
            with open(path) as f:
                snapshot = json.load(f)
        except (OSError, ValueError):  # not written yet (no step so far), or the engine is down
            snapshot = None
        out.append({
            "engine": i,
            "connected": engine is not None,
            "score": engine.score() if engine is not None else None,
            "snapshot_age_s": round(now - snapshot["time"], 3) if snapshot else None,
            "snapshot": snapshot,
        })
    return out


class DebugEngines:
    def __init__(self, views: Callable[[], list[dict]]):
        self._views = views

    async def on_get(self, req, resp) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.set_header("Cache-Control", "no-store")
        resp.data = _encode({"worker_pid": os.getpid(), "engines": self._views()}).encode()


class Dashboard:
    def __init__(self):
        self._html = files("ringserve.server").joinpath("dashboard.html").read_bytes()

    async def on_get(self, req, resp) -> None:
        resp.content_type = "text/html; charset=utf-8"
        resp.data = self._html


def add_debug_routes(app, views: Callable[[], list[dict]]) -> None:
    app.add_route("/debug/engines", DebugEngines(views))
    app.add_route("/dashboard", Dashboard())
