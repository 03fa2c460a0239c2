"""How one request is sent and timed.

RingBackend: attaches to a running ringserve's engines exactly as a Gunicorn worker does (the
control-socket handshake, a ring pair per engine, least-loaded routing: the server's own
EngineClient) and submits token ids straight into the rings — engine capacity without HTTP.

HttpBackend: any OpenAI-compatible server, /v1/completions or /v1/chat/completions with
``stream: true``, through httpx. A chunk that carries text or a finish_reason is one output event
(its arrival is TTFT or one ITL; a token that adds no text, such as a skipped special token,
sends no chunk of its own); the token count is the server's ``usage`` when it sends one, else the
number of such chunks. Token-id prompts go as they are when the server takes them (``prompt_format``
"ids"), otherwise as the text they decode to ("text").
"""
from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ringserve.tools.loadgen.discover import ServerInfo
from ringserve.tools.loadgen.stats import RequestResult
from ringserve.tools.loadgen.workload import RequestSpec

if TYPE_CHECKING:
    import httpx

    from ringserve.server.engine_client import EngineClient
    from ringserve.server.tokenizer import Tokenizer


class Backend(Protocol):
    async def start(self) -> None: ...
    async def send(self, spec: RequestSpec) -> RequestResult: ...
    async def close(self) -> None: ...
    def describe(self) -> dict[str, Any]: ...


class _Timer:
    """Arrival times of output events for one request."""

    def __init__(self, result: RequestResult):
        self.r = result
        self.start = self.last = result.sent_at = time.perf_counter()
        self.events = 0

    def event(self) -> None:
        now = time.perf_counter()
        if self.events == 0:
            self.r.ttft = now - self.start
        else:
            self.r.itl.append(now - self.last)
        self.last = now
        self.events += 1

    def finish(self) -> None:
        self.r.latency = time.perf_counter() - self.start


def _load_tokenizer(model_dir: str | Path) -> Tokenizer:
    from ringserve.server.tokenizer import Tokenizer
    return Tokenizer.from_dir(model_dir)


class RingBackend:
    def __init__(self, server: ServerInfo, *, temperature: float = 0.0):
        self.server = server
        self.temperature = temperature
        self.client: EngineClient | None = None
        self._tokenizer: Tokenizer | None = None
        self._ids = itertools.count()

    def _started(self) -> EngineClient:
        if self.client is None:
            raise RuntimeError("the backend is not started")
        return self.client

    async def start(self) -> None:
        from ringserve.server.engine_client import EngineClient, EngineUnavailable
        self.client = client = EngineClient(self.server.control_paths)
        await client.start()
        try:
            await client.wait_ready(timeout=30.0)
        except EngineUnavailable as exc:
            raise RuntimeError(f"cannot attach to the engines of {self.server.url}: {exc}") from None

    def _prompt_ids(self, spec: RequestSpec) -> list[int]:
        if isinstance(spec.prompt, list):
            return spec.prompt
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self.server.tokenizer_dir)
        return self._tokenizer.encode(spec.prompt)

    async def send(self, spec: RequestSpec) -> RequestResult:
        from ringserve.ipc.sampling_params import SamplingParams
        from ringserve.server.engine_client import EngineUnavailable
        ids = self._prompt_ids(spec)
        r = RequestResult(prompt_len=len(ids))
        params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=self.temperature)
        timer = _Timer(r)
        try:
            stream = await self._started().submit(f"loadgen-{os.getpid()}-{next(self._ids)}", ids, params)
        except EngineUnavailable as exc:
            r.error = str(exc)
            return r
        async for out in stream:
            if out.new_token_ids:
                timer.event()
                r.output_len += len(out.new_token_ids)
            if out.finish_reason in ("error", "abort"):
                r.error = out.error or f"request ended with {out.finish_reason}"
            elif out.finished:
                r.success = True
        timer.finish()
        return r

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def describe(self) -> dict[str, Any]:
        return {"mode": "ring", "server": self.server.url, "model": self.server.model_dir,
                "engines": len(self.server.control_paths)}


class HttpBackend:
    def __init__(self, base_url: str, *, endpoint: str = "/v1/completions", model: str | None = None,
                 api_key: str | None = None, temperature: float = 0.0, prompt_format: str = "auto",
                 tokenizer_dir: str | Path | None = None, pool=None):
        self.base_url = base_url.rstrip("/")
        self.endpoint = endpoint
        self.chat = endpoint.rstrip("/").endswith("chat/completions")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.temperature = temperature
        self.prompt_format = "text" if self.chat else prompt_format
        self.tokenizer_dir = tokenizer_dir
        self.pool = pool                 # ordinary token ids, for the "auto" probe
        self.client: httpx.AsyncClient | None = None
        self._tokenizer: Tokenizer | None = None

    def _started(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("the backend is not started")
        return self.client

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.tokenizer_dir is None:
                raise ValueError("text prompts from token ids need --tokenizer (the model folder)")
            self._tokenizer = _load_tokenizer(self.tokenizer_dir)
        return self._tokenizer

    async def start(self) -> None:
        import httpx
        self.client = client = httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers,
            timeout=httpx.Timeout(None, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024))
        try:
            if self.model is None:
                r = await client.get("/v1/models")
                r.raise_for_status()
                self.model = r.json()["data"][0]["id"]
            if self.prompt_format == "auto":
                self.prompt_format = await self._probe_ids()
        except httpx.HTTPError as exc:
            raise RuntimeError(f"cannot use {self.base_url}: {exc}") from None

    async def _probe_ids(self) -> str:
        """"ids" if the server answers a token-id prompt, else "text"."""
        ids = [int(i) for i in self.pool[:4]] if self.pool is not None else [100, 200, 300, 400]
        r = await self._started().post(self.endpoint, json={"model": self.model, "prompt": ids,
                                                        "max_tokens": 1, "temperature": 0})
        return "ids" if r.status_code == 200 else "text"

    def _payload(self, spec: RequestSpec) -> tuple[dict[str, Any], int]:
        prompt = spec.prompt
        if self.prompt_format == "text" and isinstance(prompt, list):
            prompt = self.tokenizer.decode(prompt)
        local_len = len(prompt) if isinstance(prompt, list) else None
        body: dict[str, Any] = {"model": self.model, "max_tokens": spec.output_len,
                                "temperature": self.temperature, "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if local_len is None and not self.chat:
            local_len = len(self.tokenizer.encode(prompt)) if self.tokenizer_dir else 0
        return body, local_len or 0

    async def send(self, spec: RequestSpec) -> RequestResult:
        import httpx
        body, local_len = self._payload(spec)
        r = RequestResult(prompt_len=local_len)
        timer = _Timer(r)
        try:
            async with self._started().stream("POST", self.endpoint, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    r.error = f"HTTP {resp.status_code}: {text[:200]}"
                    return r
                chunks, usage, finished = await self._read_stream(resp, r, timer)
        except (httpx.HTTPError, ValueError) as exc:
            r.error = f"{type(exc).__name__}: {exc}"
            return r
        timer.finish()
        if usage:
            r.output_len = int(usage.get("completion_tokens") or chunks)
            r.prompt_len = int(usage.get("prompt_tokens") or r.prompt_len)
        else:
            r.output_len = chunks
        if not r.error:
            r.success = finished
            if not finished:
                r.error = "the stream ended without a finish_reason or [DONE]"
        return r

    async def _read_stream(self, resp, r: RequestResult,
                           timer: _Timer) -> tuple[int, dict[str, Any] | None, bool]:
        """The SSE events up to [DONE] or an error event: (chunks that carried text or a finish
        reason, the last usage seen, whether the stream finished); an error event goes into r."""
        chunks, usage, finished = 0, None, False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return chunks, usage, True
            obj = json.loads(data)
            if "error" in obj:
                r.error = str(obj["error"].get("message", obj["error"]))
                break
            usage = obj.get("usage") or usage
            for choice in obj.get("choices") or []:
                piece = choice.get("delta", {}).get("content") if self.chat else choice.get("text")
                if piece or choice.get("finish_reason"):
                    timer.event()
                    chunks += 1
                finished = finished or bool(choice.get("finish_reason"))
        return chunks, usage, finished

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def describe(self) -> dict[str, Any]:
        return {"mode": "http", "server": self.base_url, "endpoint": self.endpoint,
                "model": self.model, "prompt_format": self.prompt_format}
