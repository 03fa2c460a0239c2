"""vLLM's `serve` flags (issue 31 items 2-3): one real server on the default model with TLS, CORS,
a root path, an API key, --chat-template and "auto" tool choice through the openai client; and
every flag or KV pool that cannot be served refused at start in one line (exit 1; 2 for usage)."""
from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import free_port

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).parent.parent / "examples" / "tool_chat_template_smollm2.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def serve(*flags: str, model: str | None = None) -> subprocess.CompletedProcess:
    """A `ringserve serve` that must exit at start."""
    return subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "serve",
                           *(["--model", model] if model else []), "--device", "cpu", "--workers", "1",
                           "--port", str(free_port()), *flags], capture_output=True, text=True, timeout=120)


def errors(done: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if "error:" in line]


@pytest.mark.parametrize("flags, message", [
    (("--tensor-parallel-size", "2"), "--tensor-parallel-size 2: this build runs each engine on one "
                                      "device, a whole model per GPU; scale out with --engines N"),
    (("-pp", "4"), "--pipeline-parallel-size 4"),
    (("--quantization", "fp8"), "--quantization fp8: the checkpoint is gguf-quantized"),
    (("--enable-auto-tool-choice",), "--enable-auto-tool-choice needs --tool-call-parser"),
    (("--chat-template", "no-such.jinja"), "--chat-template no-such.jinja: No such file or directory"),
    (("--ssl-certfile", str(TEMPLATE)), "--ssl-keyfile and --ssl-certfile go together"),
    (("--tokenizer", "./no-such-folder"), "--tokenizer ./no-such-folder: not found"),
    (("--generation-config", "no-such-folder"), "--generation-config no-such-folder: no such folder"),
    (("--allow-credentials",), "--allow-credentials needs --allowed-origins: without it there is no CORS"),
    (("--long-prefill-token-threshold", "-1"), "long_prefill_token_threshold must be at least 0 (0: no "
                                               "cap), got -1."),
    (("--kv-cache-memory-bytes", "1000"), "the KV cache holds no block: 0 blocks of 737280 bytes; give "
                                          "--kv-cache-memory-bytes at least 737280"),
    (("--kv-cache-memory-bytes", "2000000", "--max-model-len", "2000"),
     "the KV pool holds 32 tokens, less than one request of --max-model-len 2000: give a smaller "
     "--max-model-len, or a larger pool (--kv-cache-memory-bytes on cpu"),
])
def test_what_cannot_be_served_is_one_line_at_start(flags, message):
    done = serve(*flags)
    lines = errors(done)
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert message in lines[0], done.stderr


def test_usage_errors_exit_2_and_version():
    for argv in (["serve", "--metrics"], ["serve", "a/b", "--model", "c/d"], ["--bogus"]):
        done = subprocess.run([sys.executable, "-m", "ringserve.tools.cli", *argv], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr  # no abbreviations
    done = subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("ringserve "), done
    # a refused flag is told before the model is looked for (no download first)
    done = subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "serve", "nobody/nothing",
                           "-tp", "2"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 1 and done.stderr.startswith("error: --tensor-parallel-size 2:"), done.stderr


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return key, cert


def test_one_server_with_vllm_flags(default_model_dir, tls, tmp_path):
    key, cert = tls
    port = free_port()
    generation = tmp_path / "generation"
    generation.mkdir()
    (generation / "generation_config.json").write_text(
        '{"temperature": 0.0, "top_k": 5, "max_new_tokens": 9, "eos_token_id": 2}')
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringserve.tools.cli", "serve", str(default_model_dir),
             "--port", str(port), "--device", "cpu", "--workers", "1", "--max-model-len", "2048",
             "--drain-timeout", "2",
             "--served-model-name", "smol", "--api-key", "k", "--ssl-keyfile", str(key),
             "--ssl-certfile", str(cert), "--allowed-origins", '["https://a.example"]', "--root-path",
             "/api", "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser",
             "hermes", "-tp", "1", "--trust-remote-code", "--uvicorn-log-level", "warning",
             "--generation-config", str(generation), "--disable-log-requests",
             "--tokenizer", str(default_model_dir)],
            stdout=f, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    http = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if http.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        key_header = {"Authorization": "Bearer k"}
        # --root-path: with the prefix (a proxy that keeps it) or without (one that strips it)
        for prefix in ("/api", ""):
            r = http.get(f"{url}{prefix}/v1/models", headers={**key_header, "Origin": "https://a.example"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "smol"
            assert r.headers["access-control-allow-origin"] == "https://a.example"
        assert http.get(url + "/api/v1/models").status_code == 401  # the prefix does not skip the key
        other = http.get(url + "/v1/models", headers={**key_header, "Origin": "https://b.example"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
        preflight = http.options(url + "/api/v1/chat/completions", headers={
            "Origin": "https://a.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200, preflight.text  # a browser sends no key here
        assert preflight.headers["access-control-allow-origin"] == "https://a.example"
        assert "POST" in preflight.headers["access-control-allow-methods"]

        # --chat-template renders the tools; "auto" is served (--enable-auto-tool-choice)
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        shown = http.post(url + "/tokenize", headers=key_header,
                          json={"model": "smol", "messages": ask, "tools": [WEATHER]}).json()
        plain = http.post(url + "/tokenize", headers=key_header,
                          json={"model": "smol", "messages": ask}).json()
        assert shown["count"] > plain["count"] + 20
        client = openai.OpenAI(base_url=url + "/api/v1", api_key="k", http_client=http)
        r = client.chat.completions.create(model="smol", messages=ask, tools=[WEATHER], tool_choice="auto",
                                           max_tokens=40, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert r.usage.prompt_tokens == shown["count"]

        # --generation-config: a request without temperature takes the folder's 0 (greedy)
        texts = [client.completions.create(model="smol", prompt="Once upon a time", max_tokens=12,
                                           **extra).choices[0].text
                 for extra in ({}, {}, {"temperature": 0})]
        assert texts[0] == texts[1] == texts[2], texts
        # ... and its max_new_tokens caps every request's max_tokens, asked for or not (vLLM's rule)
        for asked in ({"max_tokens": 40}, {}):
            done = client.completions.create(model="smol", prompt="Once upon a time", **asked,
                                             extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == 9 and done.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model="smol", messages=ask, max_completion_tokens=3,
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3  # a smaller ask stands
    finally:
        http.close()
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text and f"on https://127.0.0.1:{port}/api" in text, text
    assert "default sampling parameters from " in text
    assert "{'temperature': 0.0, 'top_k': 5, 'max_tokens': 9}" in text


def test_cors_methods_headers_and_credentials(tiny_server):
    """--allowed-methods / --allowed-headers bound what a preflight may ask for (another is a 400
    JSON without the CORS headers a browser needs); --allow-credentials with the "*" origin echoes
    the origin (the CORS spec forbids "*" beside credentials) and says Vary: Origin."""
    url = tiny_server("--allowed-origins", "*", "--allow-credentials", "--allowed-methods", '["POST"]',
                      "--allowed-headers", "X-Custom", "authorization")
    origin = {"Origin": "https://a.example"}
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.get("/v1/models", headers=origin)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://a.example"
        assert r.headers["access-control-allow-credentials"] == "true" and r.headers["vary"] == "Origin"

        def preflight(method: str, headers: str) -> httpx.Response:
            return http.options("/v1/chat/completions", headers={
                **origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers})

        ok = preflight("POST", "X-Custom, Authorization, Content-Type")  # content-type: safelisted
        assert ok.status_code == 200, ok.text
        assert ok.headers["access-control-allow-methods"] == "POST"  # the route's GET-less, bounded
        assert ok.headers["access-control-allow-origin"] == "https://a.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        for method, headers, named in (("DELETE", "", "method DELETE"), ("POST", "x-other, x-custom",
                                                                         "header x-other not allowed")):
            r = preflight(method, headers)
            assert r.status_code == 400 and named in r.json()["error"]["message"], r.text
            assert "access-control-allow-methods" not in r.headers
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
