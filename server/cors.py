"""CORS as vLLM's flags set it (--allowed-origins, --allowed-methods, --allowed-headers,
--allow-credentials): Falcon's CORSMiddleware adds the headers and answers a preflight; this adds
what it lacks, a preflight that asks for a method or a header not allowed is refused (a 400, as
Starlette's middleware under vLLM refuses it), and `Vary: Origin` where the answer names one."""
from __future__ import annotations

import falcon

from ringserve.server.errors import APIError

# Request headers a browser sends without asking (the Fetch standard's CORS-safelisted ones).
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})


class CORS(falcon.CORSMiddleware):
    def __init__(self, origins: list[str], methods: list[str], headers: list[str], credentials: bool):
        # NOTE: with credentials Falcon echoes the origin, never "*" (which the CORS spec forbids
        # beside Access-Control-Allow-Credentials), "*" origins included.
        super().__init__(allow_origins="*" if "*" in origins else origins,
                         allow_credentials="*" if credentials else None)
        self._methods = None if "*" in methods else frozenset(m.upper() for m in methods)
        self._headers = None if "*" in headers else SAFELISTED_HEADERS | {h.lower() for h in headers}

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        method = req.get_header("Access-Control-Request-Method")
        origin = req.get_header("Origin")
        if req.method != "OPTIONS" or method is None or origin is None or not self._allows(origin):
            return  # not a preflight, or one that gets no CORS headers: the browser refuses it
        if self._methods is not None and method.upper() not in self._methods:
            raise APIError(400, f"CORS preflight: method {method} is not allowed (--allowed-methods: "
                                f"{', '.join(sorted(self._methods))})", code="cors_not_allowed")
        asked = req.get_header("Access-Control-Request-Headers") or ""
        refused = [h for h in (h.strip().lower() for h in asked.split(",")) if h]
        refused = [h for h in refused if self._headers is not None and h not in self._headers]
        if refused:
            raise APIError(400, f"CORS preflight: header {', '.join(refused)} not allowed "
                                f"(--allowed-headers: {', '.join(sorted(self._headers or ()))})",
                           code="cors_not_allowed")

    def process_response(self, req, resp, resource, req_succeeded: bool) -> None:
        super().process_response(req, resp, resource, req_succeeded)
        allowed = resp.get_header("Access-Control-Allow-Methods")
        if allowed is not None and self._methods is not None:  # the route's methods, bounded
            resp.set_header("Access-Control-Allow-Methods", ", ".join(
                m for m in (m.strip() for m in allowed.split(",")) if m in self._methods))
        if resp.get_header("Access-Control-Allow-Origin") not in (None, "*"):
            resp.append_header("Vary", "Origin")  # the answer depends on the origin: caches must know

    def _allows(self, origin: str) -> bool:
        return self.allow_origins == "*" or origin in self.allow_origins
