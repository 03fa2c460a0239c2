"""Shared fixtures. Other test files may add fixtures here."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ringserve.tools.tiny_llama import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, hidden 64, GQA 4/2, vocab 384) in an HF-layout folder."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), converted once into the cache folder
    (`make test` fetches it before pytest runs)."""
    from ringserve.gpu.model_store import resolve_model
    return resolve_model(None)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    """Start a real `ringserve serve` on the tiny model (1 worker, CPU): call it with extra serve
    flags, get its base URL. Every server it started is stopped (SIGTERM) after the module,
    and must exit 0 with no traceback in its log."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start(*extra: str) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = tmp_path_factory.mktemp("tiny-serve") / "serve.log"
        cmd = [sys.executable, "-m", "ringserve.server.cli", "serve", "--model", str(tiny_model_dir),
               "--port", str(port), "--workers", "1", "--max-model-len", "256", "--device", "cpu",
               "--drain-timeout", "2", *extra]
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        started.append((proc, log))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
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
    for proc, log in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, log in started:
        assert proc.wait(60) == 0, log.read_text()
        assert "Traceback" not in log.read_text(), log.read_text()
