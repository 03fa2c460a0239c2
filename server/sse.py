"""Server-sent events framing (`data: {json}\\n\\n` … `data: [DONE]\\n\\n`) and the watcher
that notices a client hanging up while its stream is open."""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import msgspec

from ringserve.server.errors import APIError

_encode = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"
# scope["extensions"] keys the server's protocol adds (http_worker.py), for streams whose
# client does not read: is the connection's writer blocked on the client (`() -> bool`), and
# cut the connection at once (`() -> None`): such a stream's writer is stuck in `send`.
CLIENT_BLOCKED = "ringserve.client_blocked"
CLOSE_CONNECTION = "ringserve.close_connection"


def event(obj: Any) -> bytes:
    """One SSE event carrying `obj` as JSON."""
    return b"data: " + _encode(obj) + b"\n\n"


def error_event(error: APIError) -> bytes:
    """An error that ends a stream already under way (its 200 is sent): the same JSON body as
    the error would have had before it (server/errors.py), as one event."""
    return b"data: " + error.to_json() + b"\n\n"


def watch_disconnect(receive: Callable, on_disconnect: Callable[[], None]) -> asyncio.Task:
    """Call `on_disconnect` as soon as the ASGI server reports that the client went away.

    Only valid once the request body has been read in full: from then on the only event
    `receive` can deliver is `http.disconnect`. The caller cancels the task when its stream ends.
    """
    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return

    return asyncio.get_running_loop().create_task(watch())
