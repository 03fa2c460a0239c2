"""The Gunicorn worker class (`worker_class` in gunicorn_conf.py): Uvicorn's worker with
connection limits that uvicorn 0.54's h11 protocol lacks.

Uvicorn arms its keep-alive timer only after a response has completed, and cancels it on any
byte received. So a connection that never sends a byte, or that sends part of a request line or
of the headers and then trickles or stops (slowloris), is never closed. Here:

- a new connection gets the keep-alive timer too (--timeout-keep-alive): idle is idle; and a
  finished response its client does not take is cut once no byte of it moved for that long;
- once a request's first byte has arrived, its whole head (request line and headers) must
  arrive within --timeout-header-read seconds, counted from that byte, however it trickles
  (a deadline, not an inactivity timer, which one byte per period would defeat); then 408.
- a request's head (request line and headers) is at most --h11-max-incomplete-event-size
  bytes (vLLM's flag, h11's limit on an incomplete head, here on any head): else 431;
- a request's body must have arrived --timeout-body-read seconds after its head (a deadline
  again): else 408, or, when the app has already answered (a 401 decided from the headers),
  the connection is just closed;
- a request whose framing h11 accepts but RFC 9112 does not (Content-Length beside
  Transfer-Encoding, §6.1; Transfer-Encoding in HTTP/1.0) is refused with 400 and its
  connection closed, so whatever follows in the same bytes (a smuggled request) is never read;
  an HTTP version other than 1.0 and 1.1 gets 505.

Every answer written here (and h11's parse errors, and uvicorn's own 500) is OpenAI's error
JSON, as the app's are (server/errors.py).

It also gives the app, in the ASGI scope, a way to see that the client is not reading and to
cut the connection (sse.CLIENT_BLOCKED, sse.CLOSE_CONNECTION): a stream whose client does not
read blocks in `send` forever, so the app cannot end it by returning.

Imported by the Gunicorn master (it loads the worker class): keep it free of the app's imports.
"""
from __future__ import annotations

import asyncio
import functools
import http
import os
import re
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # as uvicorn imports it
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from uvicorn_worker import UvicornWorker

from ringserve.server.config import ServerConfig
from ringserve.server.errors import error_body
from ringserve.server.sse import CLIENT_BLOCKED, CLOSE_CONNECTION

# The launcher passes the flags through the environment (gunicorn_conf.py has the others).
TIMEOUT_HEADER_READ_ENV = "RINGSERVE_TIMEOUT_HEADER_READ"
TIMEOUT_BODY_READ_ENV = "RINGSERVE_TIMEOUT_BODY_READ"
H11_MAX_INCOMPLETE_EVENT_SIZE_ENV = "RINGSERVE_H11_MAX_INCOMPLETE_EVENT_SIZE"
DEFAULT_TIMEOUT_HEADER_READ = ServerConfig.timeout_header_read
DEFAULT_TIMEOUT_BODY_READ = ServerConfig.timeout_body_read

_HEAD_END = re.compile(b"\n\r?\n")  # where a request's head ends, as h11 finds it
_HTTP_VERSIONS = (b"1.1", b"1.0")


def _refusal(status: int, message: str, code: str) -> bytes:
    """A whole response, OpenAI's error JSON, that closes the connection."""
    body = error_body(message, "server_error" if status >= 500 else "invalid_request_error",
                      code=code)
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


_HEADER_TIMEOUT_408 = _refusal(408, "request headers not received in time", "request_timeout")
_BODY_TIMEOUT_408 = _refusal(408, "request body not received in time", "request_timeout")
_TOO_LARGE_431 = _refusal(431, "request line and headers are too large", "headers_too_large")
_SERVER_ERROR = error_body("internal error", "server_error", code="internal_error")


class _StrictConnection(h11.Connection):
    """h11's connection, refusing the requests RFC 9112 says to refuse that h11 accepts. A
    refusal is a RemoteProtocolError, so uvicorn's protocol answers it (send_400_response) and
    closes: nothing after it in the same bytes is parsed."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                _check_framing(event)
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise
        return event


def _check_framing(request: h11.Request) -> None:
    if request.http_version not in _HTTP_VERSIONS:
        raise h11.RemoteProtocolError(f"HTTP/{request.http_version.decode(errors='replace')} is not "
                                      "supported; use HTTP/1.1", error_status_hint=505)
    names = {name for name, _ in request.headers}
    if b"transfer-encoding" in names:
        if b"content-length" in names:  # RFC 9112 §6.1: a smuggling attempt or a broken proxy
            raise h11.RemoteProtocolError("a request may not have both Content-Length and "
                                          "Transfer-Encoding")
        if request.http_version == b"1.0":  # §6.1: faulty framing
            raise h11.RemoteProtocolError("Transfer-Encoding is not allowed in HTTP/1.0")


class TimedH11Protocol(H11Protocol):
    """Uvicorn's h11 protocol plus a header-read deadline and an idle timer from the start."""

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.timeout_header_read: float = getattr(config, "timeout_header_read",
                                                  DEFAULT_TIMEOUT_HEADER_READ)
        self.timeout_body_read: float = getattr(config, "timeout_body_read", DEFAULT_TIMEOUT_BODY_READ)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._unsent: int | None = None  # idle with a response not yet taken: its bytes left
        self.max_head_size: int = (config.h11_max_incomplete_event_size
                                   or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        self.conn = _StrictConnection(h11.SERVER, self.max_head_size)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A connection that has sent nothing yet is as idle as one between two requests.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_deadline()
        self._stop_body_deadline()
        self._unset_keepalive_if_required()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # NOTE once per received chunk, not per token: state checks, a bounded search, a timer.
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            self._refuse(_TOO_LARGE_431)
            return
        super().data_received(data)  # cancels the keep-alive timer, parses what it can
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._header_deadline is None:  # bytes of a head have come, not the whole head
                self._header_deadline = self.loop.call_later(self.timeout_header_read,
                                                             self._header_timeout)
        else:
            self._stop_header_deadline()

    def timeout_keep_alive_handler(self) -> None:
        """Idle: close. A finished response the client has not taken yet keeps the connection
        while its bytes move; once nothing moved for a whole period, cut it: a graceful close
        would wait forever to flush to a client that does not read."""
        unsent = self.transport.get_write_buffer_size()
        if not unsent or self.transport.is_closing():
            super().timeout_keep_alive_handler()
        elif self._unsent is None or unsent < self._unsent:
            self._unsent = unsent
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)
        else:
            self.transport.abort()

    def _unset_keepalive_if_required(self) -> None:
        self._unsent = None
        super()._unset_keepalive_if_required()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request began (its ASGI task has not run yet)
            # Our extensions (server/sse.py) are callables; ASGI types extension values as dicts.
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            extensions[CLIENT_BLOCKED] = self._client_blocked
            extensions[CLOSE_CONNECTION] = self.transport.abort
            # Uvicorn's 500 (the app raised past Falcon, or never answered) in OpenAI's shape.
            self.cycle.send_500_response = functools.partial(  # type: ignore[method-assign]
                _send_500, self.cycle)
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            if self._body_deadline is None:  # a head has come, its body has not (all)
                self._body_deadline = self.loop.call_later(self.timeout_body_read,
                                                           self._body_timeout)
        else:
            self._stop_body_deadline()

    def send_400_response(self, msg: str) -> None:
        """h11 (or _StrictConnection) refused what it read: its reason in OpenAI's error JSON,
        with h11's status (400, 431 for a long line, 505, 501), and close."""
        exc = self.conn.last_error if isinstance(self.conn, _StrictConnection) else None
        status = exc.error_status_hint if exc is not None else 400
        reason = str(exc) if exc is not None else msg
        code = {431: "headers_too_large", 505: "http_version_not_supported"}.get(
            status, "invalid_http_request")
        self._refuse(_refusal(status, f"invalid HTTP request: {reason}", code))

    def _client_blocked(self) -> bool:
        """The client is not taking what was sent: the transport's buffer is above its high-water
        mark (the kernel's buffers are full), and the app's next `send` waits."""
        return self.flow.write_paused

    def _stop_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _head_too_large(self, data: bytes) -> bool:
        """Does the head being read end past max_head_size? h11 bounds only an incomplete
        head, so a larger one that arrives whole in one read (up to 256 KiB) would pass."""
        pending = self.conn.trailing_data[0]  # what h11 holds of this head so far (< the limit)
        window = pending + data if pending else data
        limit = self.max_head_size
        return len(window) > limit and _HEAD_END.search(window, 0, limit + 3) is None

    def _header_timeout(self) -> None:
        self._header_deadline = None
        self._refuse(_HEADER_TIMEOUT_408)

    def _stop_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_timeout(self) -> None:
        """The body did not come in time: 408, or, when the app has answered already (a 401
        decided from the headers), just close. The app, waiting in `receive`, then gets
        http.disconnect and its answer goes nowhere."""
        self._body_deadline = None
        if self.cycle is not None and self.cycle.response_started:
            self._refuse(b"")
        else:
            self._refuse(_BODY_TIMEOUT_408)

    def _refuse(self, response: bytes) -> None:
        """Answer a request that cannot be read, and close."""
        self._stop_header_deadline()
        self._stop_body_deadline()
        if self.transport.is_closing():
            return
        if response:
            self.transport.write(response)
        if self.transport.get_write_buffer_size():  # a peer that does not read either
            self.transport.abort()
        else:
            self.transport.close()


async def _send_500(cycle: RequestResponseCycle) -> None:
    """RequestResponseCycle.send_500_response, with OpenAI's error JSON for a body."""
    await cycle.send({"type": "http.response.start", "status": 500,
                      "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
    await cycle.send({"type": "http.response.body", "body": _SERVER_ERROR})


class Worker(UvicornWorker):
    """`ringserve.server.http_worker.Worker`: the ASGI worker with the protocol above."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        size = os.environ.get(H11_MAX_INCOMPLETE_EVENT_SIZE_ENV)
        self.CONFIG_KWARGS = {"loop": "auto", "http": TimedH11Protocol,
                              "h11_max_incomplete_event_size": int(size) if size else None}
        super().__init__(*args, **kwargs)
        self.config.timeout_header_read = float(os.environ.get(TIMEOUT_HEADER_READ_ENV,
                                                               DEFAULT_TIMEOUT_HEADER_READ))
        self.config.timeout_body_read = float(os.environ.get(TIMEOUT_BODY_READ_ENV,
                                                             DEFAULT_TIMEOUT_BODY_READ))
