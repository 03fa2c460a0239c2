"""What a person reads on a real server's stderr (issue 31 item 5): the real listen address, the
dashboard URL, the kernels line, a throughput line every interval while there is traffic and none
while idle, one access line per request unless --disable-log-requests, no stray lines."""
from __future__ import annotations

import os
import re
import time

import httpx
import pytest

from conftest import child_pids, cmdline, engine_pids, start_serve

pytestmark = pytest.mark.slow

THROUGHPUT = re.compile(r"engine 0: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
                        r"[\d.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: "
                        r"[\d.]+%, Prefix cache hit rate: [\d.]+%")
# A logger's line: the launcher's and engines' (time name LEVEL), or Gunicorn's ([time] [pid] [LEVEL]).
LOGGED = re.compile(r"\d{4}-\d\d-\d\d [\d:,]+ [\w.]+ [A-Z]+ "
                    r"|\[\d{4}-\d\d-\d\d [\d: +]+\] \[\d+\] \[[A-Z]+\] ")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, no_segment_left_behind):
    """start(*flags) -> ServeProcess on the tiny model, its throughput interval 0.3 s."""
    started = []
    tiny = None

    def start(*flags: str):
        nonlocal tiny
        if tiny is None:
            from ringserve.tools.tiny_llama import make_tiny_llama
            tiny = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
        log = tmp_path_factory.mktemp("serve") / "serve.log"
        return start_serve(tiny, ("--workers", "1", "--device", "cpu", "--max-model-len", "256",
                                  "--drain-timeout", "2", *flags), log, started, 120.0,
                           env=dict(os.environ, RINGSERVE_LOG_STATS_INTERVAL="0.3"))
    yield start
    for s in started:
        s.terminate()
    for s in started:
        s.stop()


def _traffic(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(3):
            r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8},
                       headers={"X-Request-Id": f"log-{i}"})
            assert r.status_code == 200, r.text
        assert c.get("/v1/models").status_code == 200


def test_a_served_request_and_its_lines(servers):
    server = servers("--enable-debug-endpoints")
    _traffic(server.url)
    time.sleep(1.0)  # a throughput line for the traffic, then idle intervals
    lines = THROUGHPUT.findall(server.log.read_text())
    time.sleep(1.0)  # three more intervals, all idle
    assert THROUGHPUT.findall(server.log.read_text()) == lines, "a throughput line while idle"
    text = server.stop()
    assert lines and any("Avg generation throughput: 0.0" not in line for line in lines), text
    assert f"Listening at: http://127.0.0.1:{server.port} (" in text
    assert f"dashboard: http://127.0.0.1:{server.port}/dashboard" in text
    assert re.search(r"kernels (loaded|compiled) in [\d.]+ s", text)
    for i in range(3):
        assert re.search(rf'127\.0\.0\.1 "POST /v1/completions" 200 [\d.]+ s cmpl-log-{i}\n', text), text
    assert re.search(r'"GET /v1/models" 200 [\d.]+ s -\n', text)
    # no stray lines: every line is one of the loggers' (time, name or pid, level), none bare
    assert "the engine client closed" not in text and "worker in slot" not in text
    bare = [line for line in text.splitlines() if not LOGGED.match(line)]
    assert bare == [], bare


def test_disable_log_requests_drops_the_access_lines(servers):
    server = servers("--disable-log-requests")
    _traffic(server.url)
    text = server.stop()
    assert "/v1/completions" not in text and "Listening at: http://" in text


def test_the_first_start_compiles_apart_and_the_engine_loads(tmp_path, tiny_model_dir):
    """An empty Numba cache: the server says it compiles before it does, in a process of its own
    (the engine's child, gone once the server is up: the compiler's modules go with it), and the
    engine loads the kernels from the cache that filled; then it serves (LLVM's code paged out
    of the engine by then: gpu/cpu/memory.py). The launcher has imported no numpy."""
    started: list = []
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    try:
        # NOTE: 128 tokens at most: no chunk reaches the tiled prefill attention, whose compile
        # (~8 s of CPU) the warm-up then skips
        server = start_serve(tiny_model_dir, ("--workers", "1", "--device", "cpu", "--max-model-len",
                                              "128"), tmp_path / "serve.log", started, 300.0, env=env)
        engines = engine_pids(server.proc.pid)
        assert len(engines) == 1 and not [c for c in child_pids(engines[0]) if cmdline(c)]
        # the launcher lives as long as the server and holds no numpy (tools/cli.py, launch.py)
        with open(f"/proc/{server.proc.pid}/maps") as maps:
            assert "_multiarray_umath" not in maps.read()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
    finally:
        for s in started:
            text = s.stop()
    said = [line.split(" INFO ", 1)[1] for line in text.splitlines()
            if "ringserve.gpu.cpu.runner INFO" in line]
    assert [m.split(" (")[0].split(" in ")[0] for m in said] == [
        "compiling kernels", "kernels compiled", "kernels loaded"], said
    assert said[0].startswith("compiling kernels (first start only, ~")

