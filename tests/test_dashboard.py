"""/dashboard rendered by headless Chromium against a real server under load: the page shows
every engine, its block counts as /debug/engines reports them, and one stacked bar per recent
step. Chromium is Debian's `chromium` package (the Makefile's test target installs it)."""
from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NUM_BLOCKS = 64
BLOCK_SIZE = 4

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed "
                                "(apt-get install -y chromium; `make test` does it)")


def chromium(url: str, profile: Path, *action: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
           "--virtual-time-budget=4000", *action, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


class Load:
    """Streams of long greedy requests from a few threads until stopped (keeps blocks held)."""

    def __init__(self, url: str, threads: int = 8, max_tokens: int = 200):
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, i, max_tokens), daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, url: str, i: int, max_tokens: int) -> None:
        # 8 x ~230 tokens do not fit a pool of 64 x 4: requests wait, and some are preempted.
        body = {"prompt": f"request {i} " * 6, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                assert client.post(url + "/v1/completions", json=body).status_code == 200

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def test_dashboard_draws_engines_pool_and_steps(tiny_server, tmp_path):
    url = tiny_server("--engines", "2", "--enable-debug-endpoints", "--block-size", str(BLOCK_SIZE),
                      "--num-gpu-blocks-override", str(NUM_BLOCKS))
    load = Load(url)
    try:
        shot = chromium(url + "/dashboard", tmp_path / "profile-shot",
                        f"--screenshot={tmp_path / 'dashboard.png'}", "--window-size=1300,900")
        assert shot.returncode == 0, shot.stderr
        # Kept for a person to look at (pytest keeps the last few tmp dirs).
        assert (tmp_path / "dashboard.png").stat().st_size > 5000
    finally:
        load.stop()
    # Idle now: the DOM must match what /debug/engines says.
    engines = httpx.get(url + "/debug/engines").json()["engines"]
    dom = chromium(url + "/dashboard", tmp_path / "profile-dom", "--dump-dom")
    assert dom.returncode == 0, dom.stderr
    html = dom.stdout
    sections = re.findall(r'<section class="engine" id="engine-(\d)"[^>]*data-used-blocks="(\d+)" '
                          r'data-free-blocks="(\d+)" data-num-blocks="(\d+)"', html)
    assert [int(s[0]) for s in sections] == [0, 1], html[:2000]
    for (_, used, free, total), e in zip(sections, engines, strict=True):
        snap = e["snapshot"]
        assert int(total) == snap["num_blocks"] == NUM_BLOCKS
        assert int(used) + int(free) == NUM_BLOCKS and int(free) == snap["num_free_blocks"]
        assert f"of {NUM_BLOCKS} × {BLOCK_SIZE} tokens" in html
    assert html.count("<h2>Engine ") == 2 and 'class="pool"' in html
    # One prefill and one decode rect per recent step, their token counts as the engines report.
    prefill = [int(t) for t in re.findall(r'class="bar-prefill"[^>]*data-tokens="(\d+)"', html)]
    decode = [int(t) for t in re.findall(r'class="bar-decode"[^>]*data-tokens="(\d+)"', html)]
    steps = [t for e in engines for t in e["snapshot"]["steps"]]
    assert len(prefill) == len(decode) == len(steps) > 0
    assert sum(prefill) == sum(t["num_prefill_tokens"] for t in steps) > 0
    assert sum(decode) == sum(t["num_decode_tokens"] for t in steps) > 0


def test_dashboard_says_when_a_queue_table_is_cut(tiny_server, tmp_path):
    """16 requests running on one engine, 12 rows a table: the table says it shows 12 of them."""
    url = tiny_server("--enable-debug-endpoints", "--max-num-seqs", "64", "--max-model-len", "2048")
    # NOTE: requests that outlast the test: streams of 200 tokens ended together every ~0.6 s,
    # and the engine's snapshot (what the page reads) then showed an idle engine
    load = Load(url, threads=16, max_tokens=1900)
    try:
        # the page reads the snapshot at once (virtual time): wait until it holds more than 12
        deadline = time.monotonic() + 30
        while (httpx.get(url + "/debug/engines").json()["engines"][0]["snapshot"] or
               {"num_running": 0})["num_running"] <= 12:
            assert time.monotonic() < deadline, "16 streams never ran at once"
            time.sleep(0.05)
        dom = chromium(url + "/dashboard", tmp_path / "profile-cut", "--dump-dom")
    finally:
        load.stop()
    assert dom.returncode == 0, dom.stderr
    shown = re.search(r"showing 12 of (\d+) running", dom.stdout)
    assert shown and int(shown.group(1)) > 12, dom.stdout[:3000]
