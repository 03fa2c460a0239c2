"""vLLM's router (PyPI vllm-router, the `test` extra) in front of two real ringserve servers on
the tiny model: round_robin spreads; power_of_two follows the load each replica reports at
GET /get_load (issue 18)."""
from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import free_port

pytest.importorskip("vllm_router", reason="vllm-router is in the `test` extra (make test installs it)")

FLAGS = ("--workers", "1", "--device", "cpu", "--drain-timeout", "2", "--max-num-seqs", "1",
         "--max-model-len", "2048")
HELD = 10


def _successes(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ringserve:request_success_total{"))


@pytest.fixture(scope="module")
def replicas(serve, tiny_model_dir, no_segment_left_behind) -> list[str]:
    return [serve(tiny_model_dir, *FLAGS).url for _ in range(2)]


@pytest.fixture(scope="module")
def start_router(replicas, tmp_path_factory):
    """Start vllm-router with a policy in front of both replicas; get its URL. Stopped after
    the module."""
    procs: list[subprocess.Popen] = []

    def start(policy: str) -> str:
        port = free_port()
        log = tmp_path_factory.mktemp("router") / "router.log"
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--policy", policy, "--worker-startup-check-interval", "1",
               "--prometheus-port", str(free_port()), "--worker-urls", *replicas]
        with open(log, "wb") as f:
            procs.append(proc := subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(30)


def test_round_robin_spreads(replicas, start_router):
    router = start_router("round_robin")
    before = [_successes(u) for u in replicas]
    for _ in range(8):
        r = httpx.post(router + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
    assert [_successes(u) - b for u, b in zip(replicas, before, strict=True)] == [4, 4]


def test_power_of_two_follows_get_load(replicas, start_router):
    router = start_router("power_of_two")
    busy, idle = replicas
    body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True}
    with ThreadPoolExecutor(HELD) as pool:
        # Long requests straight to one replica (--max-num-seqs 1: they run one after another,
        # ~1 s each here): its /get_load reads HELD, then less, for many seconds.
        held = [pool.submit(httpx.post, busy + "/v1/completions", json=body, timeout=300)
                for _ in range(HELD)]
        deadline = time.monotonic() + 60
        while httpx.get(busy + "/load").json()["server_load"] < HELD:  # the router reads /get_load
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(2.5)  # the router polls every second: let it see the load
        before = _successes(idle)
        for _ in range(8):
            r = httpx.post(router + "/v1/completions",
                           json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
        after = _successes(idle)
        still_busy = httpx.get(busy + "/load").json()["server_load"]
        assert [f.result().status_code for f in held] == [200] * HELD
    # power_of_two compares the two replicas' loads: every request went to the idle one (one
    # sent to the busy replica would have queued behind its long requests)
    assert after - before == 8, (before, after)
    assert still_busy > 0  # and the busy replica was busy all along
