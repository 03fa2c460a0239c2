"""Hugging Face model ids (gpu/loader/hub.py) against a hub on 127.0.0.1 (tests/hub_server.py),
never the internet: `ringserve download ORG/NAME[:QUANT]`, `serve MODEL`, `LLM(model=ORG/NAME)`,
the cache looked in first, and each way a repository can fail as one error line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import ServeProcess, free_port
from hub_server import HubServer
from ringserve.gpu.errors import ModelError
from ringserve.gpu.loader.hub import HubModel
from ringserve.gpu.loader.model_store import served_model_name
from ringserve.tools.tiny_gguf import make_tiny_gguf

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_REPO = "ringserve-test/tiny-GGUF"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, default_model_dir):
    """A hub with the default model's checkpoint (plus files serving never reads), a GGUF-only
    repository of two tiny quants and a vision projector, and a gated repository."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / REPO
    repo.mkdir(parents=True)
    for f in default_model_dir.iterdir():
        (repo / f.name).symlink_to(f)
    (repo / "README.md").write_text("# SmolLM2\n")
    (repo / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    ggufs = root / GGUF_REPO
    ggufs.mkdir(parents=True)
    for quant in ("Q8_0", "Q4_K_M"):
        make_tiny_gguf(ggufs / f"tiny-{quant}.gguf", num_layers=1)
    (ggufs / "mmproj-tiny-F16.gguf").write_bytes(b"GGUF")
    with HubServer(root, gated=frozenset({"ringserve-test/gated"})) as server:
        yield server


def env_for(hub: HubServer, home: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(home / "hf"),
                RINGSERVE_CACHE=str(home / "ringserve"), HF_HUB_DISABLE_TELEMETRY="1", **extra)


def download(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "download", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def printed(done: subprocess.CompletedProcess) -> Path:
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip())


def one_error_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert all(w in done.stderr for w in words), done.stderr


def test_which_file_a_model_id_means():
    checkpoint = ["config.json", "model.safetensors", "tokenizer.json", "model-Q4_K_M.gguf"]
    assert HubModel.parse("org/name").choose(checkpoint) is None  # safetensors first
    assert HubModel.parse("org/name:q4_k_m").choose(checkpoint) == "model-Q4_K_M.gguf"
    shelf = ["m-Q8_0.gguf", "m.Q4_K_M.gguf", "mmproj-m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "README.md"]
    assert HubModel.parse("org/name").choose(shelf) == "m.Q4_K_M.gguf"  # llama.cpp: Q4_K_M, Q8_0
    assert HubModel.parse("org/name").choose(shelf[:1] + shelf[3:]) == "m-Q8_0.gguf"
    assert HubModel.parse("org/name").choose(["b-F16.gguf", "a-Q2_K.gguf"]) == "a-Q2_K.gguf"
    assert HubModel.parse("org/name:Q4_K_S").choose(shelf) == "m-Q4_K_S.gguf"
    assert HubModel.parse("org/name:Q4_K").choose(["m-Q4_K.gguf", "m-Q4_K_M.gguf"]) == "m-Q4_K.gguf"
    for model, files, why in (
            ("org/name:Q5_K_M", shelf, "no GGUF of quant Q5_K_M; its GGUF files: m-Q4_K_S.gguf, "
                                       "m-Q8_0.gguf, m.Q4_K_M.gguf"),
            ("org/name:Q8_0", ["a/m-Q8_0.gguf", "b/m-Q8_0.gguf"], "org/name:Q8_0 is ambiguous"),
            ("org/name:Q8_0", ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"],
             "split GGUF"),
            ("org/name", ["README.md", "model.bin"], "neither a safetensors checkpoint")):
        with pytest.raises(ModelError, match=why):
            HubModel.parse(model).choose(files)
    for not_an_id in ("name", "a/b/c", "org/name:", "/abs/path"):
        assert HubModel.parse(not_an_id) is None
    assert served_model_name(REPO, Path("/cache/snapshots/abc")) == REPO  # as vLLM serves --model
    assert served_model_name("/x/q.gguf", Path("/cache/gguf/1234/q")) == "q"  # a GGUF's stem


def test_download_a_checkpoint_then_serve_it_from_the_cache_offline(hub, tmp_path):
    env = env_for(hub, tmp_path)
    folder = printed(download(env, REPO))
    assert folder.is_relative_to(tmp_path / "hf" / "hub")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json",
                                                        "model.safetensors", "tokenizer.json",
                                                        "tokenizer_config.json"]  # no README, no .bin
    hub.requests.clear()
    offline = dict(env, HF_HUB_OFFLINE="1")
    assert printed(download(offline, REPO)) == folder and hub.requests == []  # the cache first
    assert printed(download(offline, REPO, "--revision", folder.name)) == folder  # a commit
    one_error_line(download(offline, "ringserve-test/elsewhere"), "not in the Hugging Face cache",
                   "HF_HUB_OFFLINE")
    elsewhere = tmp_path / "models"
    moved = printed(download(env, REPO, "--download-dir", str(elsewhere)))
    assert moved.is_relative_to(elsewhere) and moved.name == folder.name
    one_error_line(download(env, REPO, "--revision", "v9"), REPO, "no revision 'v9'")

    # LLM(model=ORG/NAME, tokenizer=ORG/NAME), offline from that cache
    script = (f"from ringserve.server.llm import LLM; from ringserve.ipc.sampling_params import "
              f"SamplingParams; llm = LLM(model={REPO!r}, tokenizer={REPO!r}, device='cpu'); "
              f"print(len(llm.generate('Hello', SamplingParams(max_tokens=3))[0].outputs[0].token_ids))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=offline,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "3", done.stderr

    # `ringserve serve ORG/NAME` (positional, as vLLM), offline, with a KV pool of 2 blocks:
    # max_model_len was not given, so it is clamped to the 32 tokens the pool holds
    log = tmp_path / "serve.log"
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ringserve.tools.cli", "serve", REPO, "--port",
                                 str(port), "--workers", "1", "--device", "cpu", "--drain-timeout", "2",
                                 "--kv-cache-memory-bytes", "2000000"],
                                stdout=f, stderr=subprocess.STDOUT, env=offline)
    server = ServeProcess(proc, port, log)
    try:
        wait_healthy(server)
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [REPO] and models[0]["max_model_len"] == 32
        ok = httpx.post(server.url + "/v1/completions",
                        json={"model": REPO, "prompt": "Hello", "max_tokens": 4}).json()
        assert ok["usage"]["completion_tokens"] == 4, ok
        too_long = httpx.post(server.url + "/v1/completions",
                              json={"model": REPO, "prompt": "Hello", "max_tokens": 40})
        assert too_long.status_code == 400
        assert "maximum context length is 32 tokens" in too_long.json()["error"]["message"]
    finally:
        text = server.stop()
    assert "max_model_len clamped from the model's 8192 to 32 tokens" in text, text


def wait_healthy(server: ServeProcess, timeout: float = 120.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while True:
        assert server.proc.poll() is None, server.log.read_text()
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.3)


def test_a_gguf_repository_gives_one_quant(hub, tmp_path):
    env = env_for(hub, tmp_path)
    default = printed(download(env, GGUF_REPO))
    assert default.name == "tiny-Q4_K_M"  # llama.cpp's pick; its stem is the served name
    assert printed(download(env, f"{GGUF_REPO}:q8_0")).name == "tiny-Q8_0"
    one_error_line(download(env, f"{GGUF_REPO}:Q5_K_M"), "no GGUF of quant Q5_K_M",
                   "tiny-Q4_K_M.gguf, tiny-Q8_0.gguf")
    snapshots = tmp_path / "hf" / "hub" / f"models--{GGUF_REPO.replace('/', '--')}" / "snapshots"
    fetched = sorted(p.name for p in snapshots.glob("*/*"))
    assert fetched == ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"]  # one file each, no projector


def test_repositories_that_cannot_be_had(hub, tmp_path):
    env = env_for(hub, tmp_path)
    one_error_line(download(env, "nobody/nothing"), "nobody/nothing: not a local path, and no such "
                                                    f"repository on {hub.url}")
    one_error_line(download(env, "ringserve-test/gated"), "ringserve-test/gated: a gated repository",
                   "HF_TOKEN")
