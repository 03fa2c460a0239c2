"""Connection-level limits against a real server: header-read, body-read and idle
timeouts, the head-size bound, framing RFC 9112 refuses (request smuggling), versions other than
HTTP/1.x, HEAD, the error JSON of every refusal, streams whose client does not read,
SO_REUSEPORT spreading.

Raw sockets stand in for hostile clients; small limits (flags) keep the module quick."""
from __future__ import annotations

import json
import os
import re
import socket
import time

import httpx
import pytest

HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
KEEP_ALIVE_S = 2
MAX_HEAD = 4096
BACKLOG = 256       # more than a ring drain brings at once unless the worker is far behind
SMALL_BACKLOG = 16  # so small that such bursts reach it (test_a_slow_reader_completes)
MAX_LEN = 16384
WAIT_S = 120.0  # generous: the machine may be loaded; no assertion is on timing


@pytest.fixture(scope="module")
def long_tiny_model_dir(tmp_path_factory):
    """The tiny random Llama with room for streams longer than the kernel's socket buffers."""
    from ringserve.tools.tiny_llama import make_tiny_llama
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=MAX_LEN)


def _start(serve, model_dir, backlog: int):
    return serve(model_dir, "--workers", "2", "--device", "cpu",
                 "--max-model-len", str(MAX_LEN), "--num-gpu-blocks-override", str(MAX_LEN // 16),
                 "--drain-timeout", "2",
                 "--timeout-header-read", str(HEADER_TIMEOUT_S),
                 "--timeout-body-read", str(BODY_TIMEOUT_S),
                 "--timeout-keep-alive", str(KEEP_ALIVE_S),
                 "--h11-max-incomplete-event-size", str(MAX_HEAD),
                 "--max-stream-backlog", str(backlog))


@pytest.fixture(scope="module")
def server(serve, long_tiny_model_dir, no_segment_left_behind):
    return _start(serve, long_tiny_model_dir, BACKLOG)


@pytest.fixture(scope="module")
def small_backlog_server(serve, long_tiny_model_dir, no_segment_left_behind):
    return _start(serve, long_tiny_model_dir, SMALL_BACKLOG)


def _connect(server, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:  # set before connecting: the window the server may fill
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", server.port))
    s.settimeout(WAIT_S)
    return s


def _read_to_eof(s: socket.socket) -> bytes:
    """Everything until the server closes (socket.timeout, failing the test, if it never does)."""
    chunks = []
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def _post(path: str, body: dict, close: bool = False) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{'Connection: close' + chr(13) + chr(10) if close else ''}"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def _metrics(server) -> dict[str, float]:
    """running, kv_cache_usage_perc (summed over engines) and requests finished by "abort"."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {"running": 0.0, "kv": 0.0, "aborted": 0.0}
    for name, labels, value in re.findall(r"^ringserve:(\w+)(\{[^}]*\})?\s+(\S+)$", text, re.M):
        if name == "num_requests_running":
            out["running"] += float(value)
        elif name == "kv_cache_usage_perc":
            out["kv"] += float(value)
        elif name == "request_success_total" and 'finished_reason="abort"' in labels:
            out["aborted"] += float(value)
    return out


def _wait_for(what, condition, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _completes(server) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=WAIT_S,
                   json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def _assert_refusal(reply: bytes, status: int, code: str) -> dict:
    """One response, `status` with OpenAI's error JSON, and then the connection closed (the
    reply was read to EOF): nothing else was answered on it."""
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), reply
    assert reply.count(b"HTTP/1.1 ") == 1, reply
    assert b"content-type: application/json" in head.lower(), reply
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] == code, err
    return err


def _exchange(server, data: bytes) -> bytes:
    with _connect(server) as s:
        s.sendall(data)
        return _read_to_eof(s)


# --- slowloris and idle connections --------------------------------------------------------

def test_partial_headers_are_cut_after_the_header_timeout(server):
    """Half a head, then one byte at a time (each byte would reset an inactivity timer): the
    server answers 408 and closes, and serves others meanwhile."""
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    _completes(server)  # another client is served while this head is pending
    deadline = time.monotonic() + 10 * HEADER_TIMEOUT_S
    with s:
        try:
            while time.monotonic() < deadline:
                s.sendall(b"a")
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = _read_to_eof(s)
    _assert_refusal(reply, 408, "request_timeout")
    _completes(server)


def test_a_connection_that_sends_nothing_is_closed(server):
    with _connect(server) as s:
        assert _read_to_eof(s) == b""
    _completes(server)


def test_an_idle_keep_alive_connection_is_closed(server):
    with _connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = _read_to_eof(s)  # the response, then the close once idle
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"{}"), reply
    assert b"connection: close" not in reply.lower()  # kept alive, then closed as idle


def test_a_head_larger_than_the_limit_is_refused(server):
    """Sent whole in one write (h11 alone bounds only a head still incomplete): 431."""
    def get(header_bytes: int) -> bytes:
        with _connect(server) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * header_bytes
                      + b"\r\nConnection: close\r\n\r\n")
            return _read_to_eof(s)
    assert get(MAX_HEAD - 200).startswith(b"HTTP/1.1 200 ")
    _assert_refusal(get(4 * MAX_HEAD), 431, "headers_too_large")
    _completes(server)


# --- request bodies, framing and versions ---------------------------------------------------

SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("head", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 4\r\n\r\n",
    b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
], ids=["CL-TE", "TE-CL", "TE-in-1.0"])
def test_ambiguous_framing_is_refused_and_the_connection_closed(server, head):
    """RFC 9112 §6.1: Content-Length beside Transfer-Encoding (and Transfer-Encoding in
    HTTP/1.0) is a 400 and the connection closes: the request smuggled behind it, in the same
    bytes, is never answered."""
    _assert_refusal(_exchange(server, head + b"0\r\n\r\n" + SMUGGLED), 400, "invalid_http_request")
    _completes(server)


@pytest.mark.parametrize("version", [b"2.0", b"3.0", b"0.9", b"1.2"])
def test_an_unsupported_http_version_is_505(server, version):
    """Never a 500 with a traceback (the module's server.stop() finds none in the log)."""
    err = _assert_refusal(_exchange(server, b"GET /health HTTP/" + version + b"\r\nHost: x\r\n\r\n"),
                          505, "http_version_not_supported")
    assert version.decode() in err["message"]


@pytest.mark.parametrize("data", [
    b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",                         # no colon
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",                                     # no Host
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",                 # a TLS hello
], ids=["header-line", "two-lengths", "no-host", "tls"])
def test_an_unparsable_request_is_400_json(server, data):
    _assert_refusal(_exchange(server, data), 400, "invalid_http_request")


def test_a_body_that_does_not_arrive_is_408(server):
    """A head that declares a body, then part of it (or none, or a trickle of chunks): 408
    once --timeout-body-read has passed since the head, however the bytes trickle, and the
    connection closes; a handful at once are all released on time."""
    heads = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",
             b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt',
             b"POST /tokenize HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
             b"Content-Length: 100\r\n\r\n"] * 4
    socks = [_connect(server) for _ in heads]
    started = time.monotonic()
    for s, head in zip(socks, heads, strict=True):
        s.sendall(head)
    trickled = _connect(server)
    trickled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    try:
        while time.monotonic() < started + 10 * BODY_TIMEOUT_S:
            trickled.sendall(b"1\r\n \r\n")  # one byte of body at a time
            time.sleep(0.2)
    except (BrokenPipeError, ConnectionResetError):
        pass
    replies = [_read_to_eof(s) for s in [*socks, trickled]]
    elapsed = time.monotonic() - started
    for s in [*socks, trickled]:
        s.close()
    for reply in replies:
        if reply.startswith(b"HTTP/1.1 100 "):  # Expect: 100-continue is answered, then 408
            reply = reply.partition(b"\r\n\r\n")[2]
        _assert_refusal(reply, 408, "request_timeout")
    assert elapsed < 10 * BODY_TIMEOUT_S  # the trickle was cut, not waited out
    _completes(server)


def test_an_oversized_body_is_413_and_the_connection_closed(server):
    """Declared larger than --max-body-bytes: 413 at once, and the connection closes rather
    than take in the rest (here never sent)."""
    reply = _exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Length: 2000000\r\n\r\n{\"prompt\": \"")
    _assert_refusal(reply, 413, "body_too_large")


def test_head_is_answered_as_get_and_errors_are_json(server):
    """HEAD: GET's status and headers, no body. Falcon's 404 and 405 are OpenAI error JSON."""
    for path in ("/health", "/v1/models", "/version", "/metrics"):
        get = httpx.get(server.url + path, timeout=WAIT_S)
        head = httpx.head(server.url + path, timeout=WAIT_S)
        assert head.status_code == get.status_code == 200, (path, head)
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    for method, path, status in (("GET", "/v1/nothing", 404), ("HEAD", "/v1/nothing", 404),
                                 ("DELETE", "/v1/models", 405), ("HEAD", "/v1/completions", 405),
                                 ("PUT", "/health", 405)):
        reply = _exchange(server, f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                  "\r\n".encode())
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d " % status), (method, path, reply)
        if method != "HEAD":
            assert json.loads(body)["error"]["message"], reply


def test_a_port_in_use_is_refused(tiny_model_dir):
    """The workers bind with SO_REUSEPORT, which would share a port silently with another
    server of the same user: `serve` checks first that nothing listens there."""
    import subprocess
    import sys
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "serve", "--model",
                            str(tiny_model_dir), "--device", "cpu", "--port", str(port)],
                           capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 1, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr


# --- streams whose client does not read ----------------------------------------------------

@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_nobody_reads_is_aborted_and_its_blocks_freed(server, n):
    """A long stream to a client with a small receive window that never reads: once the kernel's
    buffers (up to tcp_wmem's 4 MiB) and the transport's are full and BACKLOG outputs wait
    unsent, every choice is aborted in the engine (its blocks come back), the connection is
    closed, and others are served throughout. (20 logprobs a token: ~1.5 KB events, so
    12,000 tokens are far more than the kernel holds.)"""
    max_tokens = 12000
    before = _metrics(server)["aborted"]
    s = _connect(server, rcvbuf=4096)
    with s:
        s.sendall(_post("/v1/completions", {"prompt": "hello", "max_tokens": max_tokens, "n": n,
                                            "ignore_eos": True, "stream": True, "logprobs": 20}))
        _completes(server)
        _wait_for("the stream's abort", lambda: _metrics(server)["aborted"] >= before + n)
        _wait_for("the blocks back", lambda: (m := _metrics(server))["running"] == 0 and m["kv"] == 0)
        _completes(server)
        got = _read_to_eof(s)  # what the kernel had buffered, then the close
    assert got.startswith(b"HTTP/1.1 200 ")
    assert b"data: [DONE]" not in got
    assert got.count(b"data: ") < n * max_tokens


def test_a_slow_reader_completes(small_backlog_server):
    """A client that reads 16 KiB every 50 ms (slower than the engine writes), for longer than
    every connection timeout, is neither aborted nor cut: the kernel's buffers take what it has
    not read yet, and the limit is on outputs stuck behind them, not on time. (A burst of
    outputs from one ring drain while the worker was busy is no stall either: the limit here is
    small enough for such bursts to pass it.)"""
    server = small_backlog_server
    max_tokens = 1500
    before = _metrics(server)["aborted"]
    s = _connect(server)
    polls = 0
    with s:
        s.sendall(_post("/v1/completions", {"prompt": "hello", "max_tokens": max_tokens,
                                            "ignore_eos": True, "stream": True, "logprobs": 5},
                        close=True))
        chunks = []
        while True:
            time.sleep(0.05)
            polls += 1
            try:
                data = s.recv(16384, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if not data:
                break  # the server closed: the response is complete
            chunks.append(data)
    got = b"".join(chunks)
    assert b"data: [DONE]" in got, got[-300:]
    events = [json.loads(line[6:]) for line in got.split(b"\n") if line.startswith(b"data: {")]
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events) == max_tokens
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert _metrics(server)["aborted"] == before
    if polls * 0.05 < max(HEADER_TIMEOUT_S, KEEP_ALIVE_S):
        pytest.skip(f"the stream took {polls} polls only: nothing shown about time")


def test_a_response_nobody_reads_is_cut(server):
    """A finished (non-streaming) response larger than the kernel's buffers, never read: once
    none of it moved for the keep-alive timeout, the worker lets the connection go (a graceful
    close would wait forever for the flush)."""
    before = _metrics(server)
    s = _connect(server, rcvbuf=4096)
    # n=2 x a 12,000-token prompt echoed with 20 logprobs a token: ~8 MB of JSON, twice what the
    # kernel holds. PERF: the prompt's logprobs come from one prefill, where 12,000 generated
    # tokens took ~30 s of decode steps
    with s:
        s.sendall(_post("/v1/completions", {"prompt": [7] * 12000, "max_tokens": 1, "n": 2,
                                            "echo": True, "logprobs": 20}))
        workers = _descendants(server.proc.pid)
        _wait_for("the worker to hold it", lambda: sum(_connections_per_process(
            server.port, workers).values()) >= 1)
        _wait_for("the worker to let it go", lambda: sum(_connections_per_process(
            server.port, workers).values()) == 0, timeout=10 * WAIT_S)
        head = _read_to_eof(s)  # what the kernel had buffered before the cut
    assert head.startswith(b"HTTP/1.1 200 "), head[:300]
    length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
    assert length > 4 * 2**20 > len(head), (length, len(head))  # more than the kernel holds, cut
    assert _metrics(server)["aborted"] == before["aborted"]  # it was answered in full
    _completes(server)


# --- SO_REUSEPORT ----------------------------------------------------------------------------

def _descendants(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = open(f"/proc/{pid}/task/{task}/children").read().split()
        except OSError:
            continue
        for kid in map(int, kids):
            out += [kid, *_descendants(kid)]
    return out


def _connections_per_process(port: int, pids: list[int]) -> dict[int, int]:
    """Established TCP connections on the server's port that each process holds (/proc)."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # ESTABLISHED
                inodes.add(f"socket:[{fields[9]}]")
    counts = {}
    for pid in pids:
        n = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                n += os.readlink(f"/proc/{pid}/fd/{fd}") in inodes
            except OSError:
                pass
        counts[pid] = n
    return counts


def test_new_connections_spread_over_the_workers(server):
    """64 clients connect at once: each of the 2 workers (its own SO_REUSEPORT socket) takes a
    fair share. With one shared socket, the first worker to wake accepts nearly all."""
    socks = [_connect(server) for _ in range(64)]
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        for s in socks:
            assert s.recv(4096).startswith(b"HTTP/1.1 200 ")  # accepted and answered
        counts = _connections_per_process(server.port, _descendants(server.proc.pid))
    finally:
        for s in socks:
            s.close()
    holding = sorted(n for n in counts.values() if n)  # (idle ones may have been closed since)
    assert len(holding) == 2 and holding[0] >= sum(holding) / 4, counts
