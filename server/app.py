"""The Falcon ASGI app: OpenAI's HTTP surface (docs/design.md §7) over one worker's engine client.

`create_app` builds it from a ready `ServerContext`; Gunicorn workers call
`ringserve.server.worker:worker_app()`, which builds the context after the fork.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field
from importlib.metadata import version as _pkg_version
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import falcon
import falcon.asgi
import msgspec
from falcon.routing import CompiledRouter

from ringserve.ipc.ring import MessageTooLarge
from ringserve.server import protocol as P
from ringserve.server import protocol_responses as R
from ringserve.server import serving_chat, serving_completions, serving_responses
from ringserve.server.config import ServerConfig
from ringserve.server.context import ServerContext, off_loop
from ringserve.server.cors import CORS
from ringserve.server.engine_client import EngineUnavailable
from ringserve.server.errors import APIError, engine_error, error_body
from ringserve.server.generate import EngineError, Generation, stream_error
from ringserve.server.metrics import CONTENT_TYPE, CacheConfig, EngineSnapshot, render
from ringserve.server.sse import CLIENT_BLOCKED, CLOSE_CONNECTION, DONE, error_event, watch_disconnect
from ringserve.server.tool_calls import template_tools
from ringserve.server.trace import TRACE_FIELD, TRACE_HEADER, start_trace, stream_with_trace, wants_trace

log = logging.getLogger("ringserve.server")
access_log = logging.getLogger("ringserve.access")

MAX_BODY_BYTES = ServerConfig.max_body_bytes
RECEIVE_KEY = "ringserve.receive"  # the ASGI receive callable, for the disconnect watcher
REQUEST_ID_KEY = "ringserve.request_id"  # a generation's public id, for its access line
_encode = msgspec.json.Encoder().encode


@dataclass
class AppOptions:
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    model_root: str | None = None
    # Engine facts, read at request time: are engines alive, their published stats, pool shape.
    engine_alive: Callable[[], bool] = lambda: True
    engine_snapshots: Callable[[], list[EngineSnapshot]] = list
    cache_config: Callable[[], CacheConfig | None] = lambda: None
    resident_memory: Callable[[], dict[str, int]] = dict  # PSS by process kind (server/memory.py)
    on_startup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # --enable-debug-endpoints: what /debug/engines shows (server/debug.py); None: no such routes
    debug_engines: Callable[[], list[dict]] | None = None
    # Static facts for /get_server_info, set by the launcher (instance id, scheduler settings)
    server_info: dict[str, Any] = field(default_factory=dict)
    # GET /kv_event_sources: each engine's KV-event publisher by rank ({}: events off)
    kv_event_sources: dict[str, dict] = field(default_factory=dict)
    log_requests: bool = True  # an access line per request (--disable-log-requests: none)
    allowed_origins: list[str] | None = None  # --allowed-origins: CORS (None: no CORS headers)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])  # --allowed-methods
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])  # --allowed-headers
    allow_credentials: bool = False  # --allow-credentials
    root_path: str | None = None  # --root-path: a proxy's path prefix, stripped when present


# --- plumbing --------------------------------------------------------------------------------

async def read_body(req: falcon.asgi.Request, limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed `limit`."""
    too_big = APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    if req.content_length is not None and req.content_length > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in req.stream:
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def json_response(resp: falcon.asgi.Response, obj, status: int = 200) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = _encode(obj)


async def _api_error(req, resp, ex: APIError, params) -> None:
    resp.status = ex.status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = ex.to_json()
    if ex.status == 413:  # the rest of the body is not read: close rather than take it in
        resp.set_header("Connection", "close")


async def _http_error(req, resp, ex: falcon.HTTPError, params) -> None:
    """Falcon's own errors (404 route, 405 method, bad headers) in OpenAI's shape."""
    resp.status = ex.status
    resp.content_type = falcon.MEDIA_JSON
    message = ex.description or ex.title
    if ex.status_code == 404:
        message = f"no route for {req.method} {req.path}"
    resp.data = error_body(message, "invalid_request_error" if ex.status_code < 500 else "server_error")
    for name, value in dict(ex.headers or {}).items():
        resp.set_header(name, value)


async def _unexpected(req, resp, ex: Exception, params) -> None:
    log.exception("unhandled error on %s %s (request %s)", req.method, req.path,
                  getattr(req.context, "request_id", None))
    resp.status = 500
    resp.content_type = falcon.MEDIA_JSON
    resp.data = error_body(f"internal error: {type(ex).__name__}", "server_error")


class _Auth:
    """Bearer-token check when --api-key is set, on every route but those marked `public`
    (/health, /version, /metrics: open as in vLLM, for load balancers and Prometheus), and on
    every method of a route (OPTIONS too: its Allow header would tell what a route serves).

    It runs on the request's head, before Falcon, which waits for the first body bytes before
    it routes: an unauthorized client gets its 401 at once, never a `100 Continue`, and, when
    it declared a body, the connection is closed rather than that body read (RFC 9110 §15.5.2).

    NOTE: it checks the resource Falcon's router resolves, never the raw path: the router
    ignores empty and `.` segments and the server has already decoded %2F, so `//v1/models`,
    `/%2Fv1/models`, `/./v1/models` and `/v1//models` reach the same resource as `/v1/models`
    and meet the same check. A new route is protected unless it says otherwise."""

    def __init__(self, api_key: str, router: CompiledRouter):
        self._expected = f"Bearer {api_key}".encode()
        self._router = router

    def allows(self, scope: dict) -> bool:
        path = scope["path"] or "/"
        if len(path) > 1 and path.endswith("/"):  # as Falcon routes (strip_url_path_trailing_slash)
            path = path[:-1]
        route = self._router.find(path)
        if route is None or getattr(route[0], "public", False):
            return True  # no route (Falcon's 404) or an open one
        given = [value for name, value in scope["headers"] if name == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], self._expected)

    @staticmethod
    async def refuse(scope: dict, send: Callable[[dict], Awaitable[None]]) -> None:
        body = APIError(401, "invalid or missing API key", code="invalid_api_key").to_json()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        if any(name in (b"content-length", b"transfer-encoding") and value != b"0"
               for name, value in scope["headers"]):
            headers.append((b"connection", b"close"))  # its body is not read
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _preflight(scope: dict) -> bool:
    """A CORS preflight: a browser's OPTIONS that never carries credentials (the Fetch standard),
    so the API key cannot be asked of it; CORSMiddleware answers it, and no route runs."""
    return scope["method"] == "OPTIONS" and any(name == b"access-control-request-method"
                                                for name, _ in scope["headers"])


class _Lifespan:
    def __init__(self, options: AppOptions):
        self._options = options

    async def process_startup(self, scope, event) -> None:
        for hook in self._options.on_startup:
            await hook()

    async def process_shutdown(self, scope, event) -> None:
        for hook in self._options.on_shutdown:
            await hook()


# --- resources -------------------------------------------------------------------------------

class _Serving(Protocol):
    """One endpoint's protocol code (server/serving_completions.py, serving_chat.py)."""

    async def prepare(self, ctx: ServerContext, req: Any, request_id: str) -> Generation: ...

    async def complete(self, ctx: ServerContext, req: Any, gen: Generation, request_id: str,
                       model: str) -> Any: ...

    def stream(self, ctx: ServerContext, req: Any, gen: Generation, request_id: str,
               model: str) -> AsyncIterator[bytes]: ...


class _Generate:
    """Shared body of the completions and chat resources."""

    request_type: type
    prefix: str
    chunk_object: str
    serving: _Serving

    def __init__(self, ctx: ServerContext, options: AppOptions):
        self._ctx, self._options = ctx, options

    async def on_post(self, req, resp) -> None:
        arrival, arrival_unix = time.monotonic(), time.time()
        body = await read_body(req, self._options.max_body_bytes)
        request: Any = P.decode_request(body, self.request_type)
        if not self._options.engine_alive():
            raise APIError(503, "no engine is available", code="engine_unavailable")
        # Public id (response, logs, trace) and the engine requests' own ids. The client's
        # X-Request-Id comes back unchanged (vLLM's middleware); without one, the public id.
        header = req.get_header(P.REQUEST_ID_HEADER)
        request_id = P.public_request_id(self.prefix, header)
        resp.set_header(P.REQUEST_ID_HEADER, header or request_id)
        req.context.request_id = request_id
        req.scope[REQUEST_ID_KEY] = request_id
        model = request.model or self._ctx.model_name
        gen = await self.serving.prepare(self._ctx, request, P.new_id(self.prefix))
        extensions = req.scope.get("extensions") or {}  # from our protocol (http_worker.py)
        gen.client_blocked = extensions.get(CLIENT_BLOCKED)
        gen.close_connection = extensions.get(CLOSE_CONNECTION)
        if wants_trace(request.ringserve_trace, req.get_header(TRACE_HEADER)):
            gen.trace = start_trace(request_id, arrival, arrival_unix)
        try:
            await gen.start()
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        except MessageTooLarge as exc:  # over the limit of one ring message (docs/ipc.md)
            raise APIError(400, str(exc), code="request_too_large") from None
        receive = req.scope.get(RECEIVE_KEY)
        watcher = watch_disconnect(receive, gen.abort) if receive is not None else None
        if request.stream:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            resp.set_header("X-Accel-Buffering", "no")
            chunks = self.serving.stream(self._ctx, request, gen, request_id, model)
            if gen.trace is not None:
                chunks = stream_with_trace(chunks, gen, gen.trace, self.chunk_object, model)
            resp.stream = _guarded(chunks, gen, watcher)
            return
        try:
            result = await self.serving.complete(self._ctx, request, gen, request_id, model)
        except EngineError as exc:
            log.warning("request %s failed in the engine: %s", request_id, exc)
            raise engine_error(exc) from None
        finally:
            gen.abort()
            if watcher is not None:
                watcher.cancel()
        if gen.trace is not None:
            result = msgspec.to_builtins(result)
            result[TRACE_FIELD] = gen.trace.journey(gen)
        json_response(resp, result)


async def _guarded(chunks: AsyncIterator[bytes], gen: Generation,
                   watcher: asyncio.Task | None) -> AsyncIterator[bytes]:
    """A stream that ends with an error event and [DONE] instead of a cut connection, whatever
    failed (the engine, or our own output processing), and that aborts whatever is still
    running in the engine however it ends (client gone, error)."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - whatever failed, the client still gets a whole stream
        yield error_event(stream_error(exc, gen.choices[0].request_id))
        yield DONE
    finally:
        gen.abort()
        if watcher is not None:
            watcher.cancel()


class Completions(_Generate):
    request_type = P.CompletionRequest
    prefix = "cmpl"
    chunk_object = "text_completion"
    serving = serving_completions


class ChatCompletions(_Generate):
    request_type = P.ChatCompletionRequest
    prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    serving = serving_chat


class Responses(_Generate):
    """POST /v1/responses: a translation over chat (server/serving_responses.py)."""
    request_type = R.ResponsesRequest
    prefix = "resp"
    chunk_object = "response"
    serving = serving_responses


class Tokenize:
    def __init__(self, ctx: ServerContext, options: AppOptions):
        self._ctx, self._options = ctx, options

    async def on_post(self, req, resp) -> None:
        body = await read_body(req, self._options.max_body_bytes)
        request = P.decode_tokenize_request(body)
        P.check_model(request.model, self._ctx.served_model_names)
        ids = await off_loop(len(body), self._tokenize, request)
        json_response(resp, {"count": len(ids), "max_model_len": self._ctx.max_model_len,
                             "tokens": ids, "token_strs": None})

    def _tokenize(self, request: P.TokenizeCompletionRequest | P.TokenizeChatRequest) -> list[int]:
        if isinstance(request, P.TokenizeChatRequest):
            tools = None if request.tools is None else template_tools(
                request.tools, self._ctx.structured.max_json_depth)
            text = serving_chat.render_prompt(self._ctx, request.messages,
                                              request.add_generation_prompt, tools,
                                              request.chat_template_kwargs)
        else:
            text = request.prompt
        return self._ctx.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)


class Detokenize:
    def __init__(self, ctx: ServerContext, options: AppOptions):
        self._ctx, self._options = ctx, options

    async def on_post(self, req, resp) -> None:
        body = await read_body(req, self._options.max_body_bytes)
        request = P.decode_request(body, P.DetokenizeRequest)
        P.check_model(request.model, self._ctx.served_model_names)
        P.check_token_ids(request.tokens, self._ctx.vocab_size, param="tokens")
        json_response(resp, {"prompt": self._ctx.tokenizer.decode(request.tokens)})


class Models:
    def __init__(self, ctx: ServerContext, options: AppOptions):
        self._ctx, self._options = ctx, options
        self._created = P.now()

    def _card(self, name: str) -> P.ModelCard:
        return P.ModelCard(name, self._created, root=self._options.model_root or name,
                           max_model_len=self._ctx.max_model_len)

    async def on_get(self, req, resp) -> None:
        json_response(resp, P.ModelList([self._card(n) for n in self._ctx.served_model_names]))

    async def on_get_one(self, req, resp, model_id: str) -> None:
        """GET /v1/models/{id}: one card, or OpenAI's 404 for a model we do not serve."""
        json_response(resp, self._card(P.check_model(model_id, self._ctx.served_model_names)))


class Health:
    public = True  # no API key needed (_Auth)

    def __init__(self, options: AppOptions):
        self._options = options

    async def on_get(self, req, resp) -> None:
        if self._options.engine_alive():
            resp.status = 200
            resp.content_type = falcon.MEDIA_JSON
            resp.data = b"{}"
        else:
            raise APIError(503, "no engine is alive", code="engine_unavailable")


class Version:
    public = True

    async def on_get(self, req, resp) -> None:
        json_response(resp, {"version": _pkg_version("ringserve")})


class Metrics:
    public = True  # Prometheus scrapes it without a key, as vLLM's /metrics

    def __init__(self, ctx: ServerContext, options: AppOptions):
        self._ctx, self._options = ctx, options

    async def on_get(self, req, resp) -> None:
        resp.content_type = CONTENT_TYPE
        resp.data = render(self._ctx.metrics, self._ctx.model_name,
                           self._options.engine_snapshots(), self._options.cache_config(),
                           self._options.resident_memory())


class Load:
    """What routers poll for the least-loaded replica: the requests the engines hold now (waiting +
    running, over all engines), read from the stats every engine publishes, the same snapshots
    /metrics reads. Open like /metrics: routers poll without a key.

    GET /get_load is the shape vllm-router's power_of_two reads (`{"load": n}`, SGLang's name);
    GET /load is vLLM's (`{"server_load": n}`). NOTE: vLLM counts HTTP requests in flight in its
    API server; ours counts engine requests, so a request with n > 1 weighs n."""
    public = True

    def __init__(self, options: AppOptions):
        self._options = options

    def _engines(self) -> list[dict[str, Any]]:
        return [{"engine": i, "num_requests_waiting": s.num_waiting,
                 "num_requests_running": s.num_running, "kv_cache_usage_perc": s.kv_cache_usage}
                for i, s in enumerate(self._options.engine_snapshots())]

    async def on_get(self, req, resp) -> None:
        engines = self._engines()
        waiting = sum(e["num_requests_waiting"] for e in engines)
        running = sum(e["num_requests_running"] for e in engines)
        json_response(resp, {"load": waiting + running, "num_requests_waiting": waiting,
                             "num_requests_running": running, "engines": engines})

    async def on_get_vllm(self, req, resp) -> None:
        engines = self._engines()
        json_response(resp, {"server_load": sum(e["num_requests_waiting"] + e["num_requests_running"]
                                                for e in engines)})


class ServerInfo:
    """GET /get_server_info and /server_info: what a router or a tool reads to know the replica
    (SGLang's names where SGLang has one, vLLM's beside them). Behind --api-key like the API."""

    def __init__(self, ctx: ServerContext, options: AppOptions):
        self._ctx, self._options = ctx, options

    async def on_get(self, req, resp) -> None:
        ctx, o = self._ctx, self._options
        cache = o.cache_config()
        engines = len(o.engine_snapshots())
        block_size = blocks = total = None  # no engine connected: unknown
        if cache is not None:
            block_size, blocks = cache.block_size, cache.num_gpu_blocks
            total = blocks * block_size * engines
        json_response(resp, {
            "model": ctx.model_name, "served_model_name": ctx.model_name,
            "served_model_names": ctx.served_model_names,
            "model_path": o.model_root, "tokenizer_path": o.model_root,
            "version": _pkg_version("ringserve"),
            "max_model_len": ctx.max_model_len, "context_length": ctx.max_model_len,
            "block_size": block_size, "page_size": block_size,
            "num_gpu_blocks": blocks,  # per engine
            "max_total_num_tokens": total,
            "num_engines_alive": engines, "dp_size": o.server_info.get("engines", engines),
            **o.server_info})


class KVEventSources:
    """GET /kv_event_sources: where each engine publishes its KV-cache events, keyed by its
    data-parallel rank as vllm-router's kv_aware discovery reads it ({"0": {"endpoint", "replay_endpoint",
    "topic", ...}}); {} when events are off. Behind --api-key like /get_server_info."""

    def __init__(self, options: AppOptions):
        self._options = options

    async def on_get(self, req, resp) -> None:
        json_response(resp, self._options.kv_event_sources)


# --- assembly --------------------------------------------------------------------------------

def create_app(ctx: ServerContext, options: AppOptions | None = None):
    """The ASGI callable: the Falcon app, wrapped so that handlers can watch for disconnects."""
    options = options or AppOptions()
    router = CompiledRouter()
    middleware: list[Any] = [_Lifespan(options)]
    cors = bool(options.allowed_origins)
    if options.allowed_origins:  # server/cors.py: the headers, and preflights answered
        middleware.append(CORS(options.allowed_origins, options.allowed_methods, options.allowed_headers,
                               options.allow_credentials))
    app = falcon.asgi.App(middleware=middleware, router=router)
    app.req_options.strip_url_path_trailing_slash = True
    app.add_error_handler(Exception, _unexpected)
    app.add_error_handler(falcon.HTTPError, _http_error)
    app.add_error_handler(APIError, _api_error)
    app.add_route("/v1/completions", Completions(ctx, options))
    app.add_route("/v1/chat/completions", ChatCompletions(ctx, options))
    app.add_route("/v1/responses", Responses(ctx, options))
    models = Models(ctx, options)
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model_id:path}", models, suffix="one")  # ids may hold a "/"
    app.add_route("/tokenize", Tokenize(ctx, options))
    app.add_route("/detokenize", Detokenize(ctx, options))
    app.add_route("/health", Health(options))
    app.add_route("/version", Version())
    app.add_route("/metrics", Metrics(ctx, options))
    load = Load(options)
    app.add_route("/get_load", load)
    app.add_route("/load", load, suffix="vllm")
    info = ServerInfo(ctx, options)
    app.add_route("/get_server_info", info)
    app.add_route("/server_info", info)
    app.add_route("/kv_event_sources", KVEventSources(options))
    if options.debug_engines is not None:
        from ringserve.server.debug import add_debug_routes
        add_debug_routes(app, options.debug_engines)

    auth = _Auth(options.api_key, router) if options.api_key else None

    root = options.root_path

    async def asgi(scope, receive, send):
        if scope["type"] == "http":
            if options.log_requests:
                send = _AccessLine(scope, send)
            path = scope["path"]
            if root and (path == root or path.startswith(root + "/")):
                # NOTE: before the key check, which must see the path Falcon routes.
                scope = {**scope, "path": path[len(root):] or "/", "root_path": root}
            if auth is not None and not (cors and _preflight(scope)) and not auth.allows(scope):
                await auth.refuse(scope, send)
                return
            if scope["method"] == "HEAD":  # answered as GET; the server sends no body for HEAD
                scope = {**scope, "method": "GET"}
            scope[RECEIVE_KEY] = receive
        await app(scope, receive, send)

    return asgi


class _AccessLine:
    """The ASGI `send` of one request, logging its access line once the response's last byte
    is sent (a stream's whole duration): client, method, path, status, seconds, request id
    (a generation's public id, else the client's X-Request-Id, else -)."""

    def __init__(self, scope: dict, send: Callable[[dict], Awaitable[None]]):
        self._scope, self._send = scope, send
        self._start = time.monotonic()
        self._status = 0

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self._status = message["status"]
        await self._send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            scope = self._scope
            client = scope.get("client") or ("-", 0)
            rid = scope.get(REQUEST_ID_KEY) or next(
                (v.decode(errors="replace") for k, v in scope["headers"] if k == b"x-request-id"), "-")
            access_log.info('%s "%s %s" %d %.3f s %s', client[0], scope["method"], scope["path"],
                            self._status, time.monotonic() - self._start, rid)
