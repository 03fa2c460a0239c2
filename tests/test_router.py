"""vLLM's router (PyPI vllm-router, the `test` extra) in front of two real ringserve servers on
the tiny model: round_robin spreads; power_of_two follows the load each replica reports at
GET /get_load; kv_aware, fed by each replica's KV-cache events (--kv-events-config), sends a
request to the replica that holds its prefix (issue 18)."""
from __future__ import annotations

import json
import random
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


def _kv_events(port: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{port}"})


@pytest.fixture(scope="module")
def kv_ports() -> list[int]:
    return [free_port() for _ in range(2)]


@pytest.fixture(scope="module")
def replicas(serve, tiny_model_dir, kv_ports, no_segment_left_behind) -> list[str]:
    return [serve(tiny_model_dir, *FLAGS, "--kv-events-config", _kv_events(port)).url
            for port in kv_ports]


@pytest.fixture(scope="module")
def start_router(replicas, tmp_path_factory):
    """Start vllm-router with a policy (and its extra flags) in front of both replicas; get its
    URL. Stopped after the module."""
    procs: list[subprocess.Popen] = []

    def start(policy: str, *extra: str) -> str:
        port = free_port()
        log = tmp_path_factory.mktemp("router") / "router.log"
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--policy", policy, "--worker-startup-check-interval", "1",
               "--prometheus-port", str(free_port()), "--worker-urls", *replicas, *extra]
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


def test_kv_aware_sends_a_prefix_to_the_replica_that_holds_it(replicas, kv_ports, start_router):
    # vllm-router 0.1.17 subscribes to HTTP workers' events given as static sources (its
    # --kv-event-source WORKER=ENDPOINT; docs/scale-out.md says why not by discovery). It asks
    # the replica's /tokenize for a prompt's ids and hashes them per block as it hashed the
    # token ids of each BlockStored.
    sources = [arg for url, port in zip(replicas, kv_ports, strict=True)
               for arg in ("--kv-event-source", f"{url}=tcp://127.0.0.1:{port}")]
    model = httpx.get(replicas[0] + "/v1/models").json()["data"][0]["id"]
    router = start_router("kv_aware", *sources, "--kv-event-block-size", "16",
                          "--kv-event-model", model)
    time.sleep(1.0)  # the router's subscribers connect (PUB/SUB: it sees what is sent after)
    rng = random.Random(18)
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
    prefixes = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(2)]
    for url, prefix in zip(replicas, prefixes, strict=True):  # prefix i cached on replica i only
        r = httpx.post(url + "/v1/completions", json={"prompt": prefix, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
    time.sleep(1.0)  # their BlockStored reach the router's index
    before = [_successes(u) for u in replicas]
    for i in range(4):
        for which in (1, 0):  # replica 1's prefix first: not the router's default pick
            r = httpx.post(router + "/v1/completions", json={
                "model": model, "prompt": f"{prefixes[which]} question {i}", "max_tokens": 2},
                timeout=60)
            assert r.status_code == 200, r.text
            got = [_successes(u) - b for u, b in zip(replicas, before, strict=True)]
            assert got[which] == i + 1, (which, got)  # it went to the replica with its prefix
    assert [_successes(u) - b for u, b in zip(replicas, before, strict=True)] == [4, 4]
