"""--api-key against a real server: every protected route, however its path is spelled and
whatever the method (OPTIONS, HEAD too), is 401 without the key and served with it; the 401 is
decided from the head, before any body is read (and before any `100 Continue`); /health,
/version, /metrics and the load stay open; the key given as RINGSERVE_API_KEY appears on no
command line of the server's processes."""
from __future__ import annotations

import http.client
import json
import os
import socket
import time
from pathlib import Path

import pytest

from ringserve.server.memory import process_tree

KEY = "sesame-7f3a1c"
AUTH = {"Authorization": f"Bearer {KEY}"}

# (method, path, body): a valid request to every route the key protects.
PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/debug/engines", None),
    ("GET", "/dashboard", None),
    ("GET", "/get_server_info", None),
    ("GET", "/server_info", None),
]
OPEN = ["/health", "/version", "/metrics", "/get_load", "/load"]  # routers poll the load keyless


def spellings(path: str) -> list[str]:
    """Ways to write `path` that Falcon's router resolves to the same route."""
    first, _, rest = path[1:].partition("/")
    out = [path, "/" + path, "/%2F" + path[1:], "/%2f" + path[1:], "/." + path, path + "/",
           path.replace("/", "//"), "/./" + path.replace("/", "/./")[3:]]
    if rest:
        out += [f"/{first}//{rest}", f"/{first}/./{rest}", f"/{first}%2F{rest}"]
    return out


@pytest.fixture(scope="module")
def server(serve, tiny_model_dir, no_segment_left_behind):
    """A server whose key comes from the environment, not from its command line."""
    os.environ["RINGSERVE_API_KEY"] = KEY
    try:
        return serve(tiny_model_dir, "--workers", "1", "--max-model-len", "256", "--device", "cpu",
                     "--drain-timeout", "2", "--enable-debug-endpoints")
    finally:
        del os.environ["RINGSERVE_API_KEY"]


def request(port: int, method: str, path: str, body=None, headers=None) -> tuple[int, bytes]:
    """The path exactly as written: no client-side normalization of `//`, `.` or `%2F`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        hdrs = dict(headers or {})
        if data is not None:
            hdrs["Content-Type"] = "application/json"
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_every_spelling_of_a_protected_route_needs_the_key(server, method, path, body):
    served = []
    for spelled in spellings(path):
        with_key, data = request(server.port, method, spelled, body, AUTH)
        assert with_key in (200, 404), (spelled, with_key, data[:200])
        status, data = request(server.port, method, spelled, body)
        if with_key == 404:  # a spelling the router does not resolve: nothing to guard
            assert status == 404, (spelled, status, data[:200])
            continue
        served.append(spelled)
        assert status == 401, (spelled, status, data[:200])
        err = json.loads(data)["error"]
        assert err["code"] == "invalid_api_key" and err["message"], spelled
        status, _ = request(server.port, method, spelled, body, {"Authorization": "Bearer wrong"})
        assert status == 401, spelled
    # The spellings the router resolves today (the leading empty segment is ignored, %2F is
    # decoded before routing): each was once served without the key.
    assert {path, "/" + path, "/%2F" + path[1:], path + "/"} <= set(served), served


def test_health_version_metrics_stay_open(server):
    for path in OPEN:
        status, _ = request(server.port, "GET", path)
        assert status == 200, path


def test_an_unknown_path_is_404_with_or_without_the_key(server):
    for headers in ({}, AUTH):
        status, data = request(server.port, "GET", "/v1/nothing", headers=headers)
        assert status == 404 and json.loads(data)["error"]["message"]


def test_the_key_is_on_no_command_line(server):
    pids = process_tree(server.proc.pid)
    assert len(pids) >= 4  # launcher, engine, gunicorn master, a worker (at least)
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        assert KEY.encode() not in cmdline, (pid, cmdline)


def _raw(port: int, data: bytes, then: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send `data`, wait for the first bytes of an answer, send `then`, read until the server
    closes (socket.timeout, failing the test, if it does not within `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        reply = s.recv(65536)
        if then:
            s.sendall(then)
        while chunk := s.recv(65536):
            reply += chunk
        return reply


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


@pytest.mark.parametrize("expect", [False, True], ids=["body-never-sent", "expect-100"])
def test_an_unauthorized_request_is_refused_from_its_head(server, expect):
    """A POST that declares 100 bytes of body and sends none: 401 at once (the body timeout is
    30 s; the socket gives up after 10), never a `100 Continue`, and the connection is closed
    without waiting for the body."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n" + (b"Expect: 100-continue\r\n" if expect else b"") + b"\r\n")
    for auth in (b"", b"Authorization: Bearer wrong\r\n", b"Authorization: Basic x\r\n"):
        started = time.monotonic()
        reply = _raw(server.port, head.replace(b"\r\n\r\n", b"\r\n" + auth + b"\r\n"))
        assert time.monotonic() - started < 10
        assert reply.startswith(b"HTTP/1.1 401 "), reply
        assert b"100 Continue" not in reply and reply.count(b"HTTP/1.1") == 1, reply
        err = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
        assert err["code"] == "invalid_api_key", err


def test_expect_100_continue_is_answered_for_an_authorized_request(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nExpect: 100-continue\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    reply = _raw(server.port, head, then=body, timeout=60)
    assert reply.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 "), reply
    assert json.loads(reply.rpartition(b"\r\n\r\n")[2])["choices"], reply


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_options_and_head_need_the_key_too(server, method, path, body):
    """OPTIONS would answer 200 with an Allow header (what the route serves) and HEAD a GET's
    headers: both are behind the route's key."""
    for probe in ("OPTIONS", "HEAD"):
        status, data = request(server.port, probe, path)
        assert status == 401, (probe, path, status, data)
    status, _ = request(server.port, "OPTIONS", path, headers=AUTH)
    assert status == 200
    if method == "GET":
        status, data = request(server.port, "HEAD", path, headers=AUTH)
        assert status == 200 and data == b"", (path, status, data[:100])


def test_open_routes_answer_options_and_head_without_the_key(server):
    for path in OPEN:
        for method in ("OPTIONS", "HEAD"):
            status, data = request(server.port, method, path)
            assert status == 200 and (method == "OPTIONS" or data == b""), (method, path, status)
