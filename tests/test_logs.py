"""What a person reads on a real server's stderr (issue 31 item 5): the real listen address, the
dashboard URL, the kernels line, a throughput line every interval while there is traffic and none
while idle, one access line per request unless --disable-log-requests, no stray lines."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from conftest import start_serve

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


def test_the_first_start_says_it_compiles(tmp_path, tiny_model_dir):
    """An empty Numba cache: the runner says it compiles before it does; the next start loads."""
    code = ("import logging; logging.basicConfig(level=logging.INFO, format='%(message)s');"
            "from ringserve.gpu.cpu.runner import CpuModelRunner;"
            "from ringserve.gpu.settings import CacheConfig, DeviceConfig;"
            f"CpuModelRunner({str(tiny_model_dir)!r}, DeviceConfig(device='cpu', cpu_threads=1), "
            "CacheConfig(num_gpu_blocks_override=4))")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))

    def start() -> list[str]:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stderr.splitlines()
    first = start()
    assert first[0].startswith("compiling kernels (first start only, ~") and first[1].startswith(
        "kernels compiled in"), first
    assert start()[0].startswith("kernels loaded in")
