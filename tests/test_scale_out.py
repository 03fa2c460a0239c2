"""What routers read of a replica (issue 18): the load endpoints (/get_load, /load), the server
info (/get_server_info, /server_info) and vLLM's metric names (--metrics-prefix vllm), against a
real `ringserve serve` on the tiny model."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from test_http_server import metric_samples

# One running request at a time, so the others wait; long generations (ignore_eos) so they are
# still in the engine while the test looks.
FLAGS = ("--max-num-seqs", "1", "--max-model-len", "2048", "--served-model-name", "tiny",
         "--metrics-prefix", "vllm")


@pytest.fixture(scope="module")
def url(serve, tiny_model_dir, no_segment_left_behind) -> str:
    return serve(tiny_model_dir, "--workers", "1", "--device", "cpu", "--drain-timeout", "2",
                 *FLAGS).url


def _load(url: str) -> dict:
    r = httpx.get(url + "/get_load", timeout=10)
    assert r.status_code == 200
    return r.json()


def _wait_load(url: str, want, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        load = _load(url)
        if want(load):
            return load
        assert time.monotonic() < deadline, load
        time.sleep(0.02)


def test_load_follows_the_engine(url):
    idle = _wait_load(url, lambda d: d["load"] == 0)
    assert idle == {"load": 0, "num_requests_waiting": 0, "num_requests_running": 0,
                    "engines": [{"engine": 0, "num_requests_waiting": 0, "num_requests_running": 0,
                                 "kv_cache_usage_perc": 0.0}]}
    assert httpx.get(url + "/load").json() == {"server_load": 0}

    body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        done = [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=120)
                for _ in range(3)]
        # --max-num-seqs 1: one runs while two wait (each runs ~1.5 s here on an idle machine)
        busy = _wait_load(url, lambda d: d["num_requests_running"] == 1
                          and d["num_requests_waiting"] == 2)
        vllm = httpx.get(url + "/load").json()
        metrics = httpx.get(url + "/metrics").text
        assert [f.result().status_code for f in done] == [200] * 3
    assert busy["load"] == 3 and busy["engines"][0]["kv_cache_usage_perc"] > 0
    assert 1 <= vllm["server_load"] <= 3  # read a moment later: one may have finished
    # the vllm: gauges read the same engine stats (one path: what the engines publish)
    running = metric_samples(metrics, "vllm:num_requests_running")[0][1]
    waiting = metric_samples(metrics, "vllm:num_requests_waiting")[0][1]
    assert running == 1 and 0 <= waiting <= 2
    assert _wait_load(url, lambda d: d["load"] == 0)["engines"][0]["kv_cache_usage_perc"] == 0


def test_server_info(url):
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(url + path).json()
        assert info["model"] == info["served_model_name"] == "tiny"
        assert (Path(info["model_path"]) / "config.json").is_file()
        assert info["block_size"] == info["page_size"] == 16
        assert info["num_gpu_blocks"] > 0
        assert info["max_total_num_tokens"] == info["num_gpu_blocks"] * 16
        assert info["max_model_len"] == info["context_length"] == 2048
        assert info["max_num_seqs"] == info["max_running_requests"] == 1
        assert info["dp_size"] == info["engines"] == 1 and info["device"] == "cpu"
        assert len(info["instance_id"]) == 32 and info["enable_prefix_caching"] is True
    # one server, one id: every worker hands out the launcher's
    assert httpx.get(url + "/server_info").json()["instance_id"] == info["instance_id"]
    card = httpx.get(url + "/v1/models/tiny").json()
    assert card["id"] == "tiny" and card["max_model_len"] == 2048
    assert httpx.get(url + "/v1/models/other").status_code == 404


def test_vllm_metric_names(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello hello hello", "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200
    text = httpx.get(url + "/metrics").text
    assert "ringserve:" not in text
    (labels, value), = metric_samples(text, "vllm:cache_config_info")
    assert 'block_size="16"' in labels and "num_gpu_blocks=" in labels and value == 1.0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        (labels, _), = metric_samples(text, f"vllm:{gauge}")
        assert 'engine="0"' in labels and 'model_name="tiny"' in labels
    for counter in ("prefix_cache_queries_total", "prefix_cache_hits_total",
                    "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total"):
        assert metric_samples(text, f"vllm:{counter}"), counter
    assert metric_samples(text, "vllm:prefix_cache_queries_total")[0][1] >= 3
    assert metric_samples(text, "vllm:generation_tokens_total")[0][1] >= 4
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"):
        assert metric_samples(text, f"vllm:{hist}_count")[0][1] >= 1, hist
        assert metric_samples(text, f"vllm:{hist}_bucket"), hist
