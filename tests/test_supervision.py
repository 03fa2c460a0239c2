"""Liveness, signals and supervision of a real `ringserve serve` (launcher, engine, Gunicorn):
long steps are not hangs, a hung engine is killed and replaced, group signals drain, and a
launcher killed by SIGKILL takes its tree with it and is cleaned up after."""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import ServeProcess, cmdline, descendants, engine_pids, start_serve
from ringserve.engine.config import EngineConfig
from ringserve.engine.process import run_engine
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.ipc.shm import SHM_DIR
from ringserve.server.engine_client import EngineClient
from ringserve.server.supervision import RUNTIME_PREFIX

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_segment_left_behind")]


# -- helpers -------------------------------------------------------------------------------


def _running(pid: int) -> bool:
    """Exists and is not a zombie (an orphan's zombie waits for a reaper we do not control)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _runtime_dirs(launcher_pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"{RUNTIME_PREFIX}{launcher_pid}-*"))


@pytest.fixture
def launch(tmp_path):
    """Start `ringserve serve --model M FLAGS` as a process-group leader (start_new_session,
    as a shell starts a job) and wait for /health 200. Whatever is still running at the end is
    killed with its whole tree."""
    started: list[ServeProcess] = []

    def start(model_dir: Path, *flags: str, timeout: float = 180.0) -> ServeProcess:
        log = tmp_path / f"serve-{len(started)}.log"
        return start_serve(model_dir, flags, log, started, timeout, start_new_session=True)

    yield start
    for server in started:
        if server.proc.poll() is None:
            tree = descendants(server.proc.pid)
            for pid in tree:  # a test may have stopped one
                if _running(pid):
                    os.kill(pid, signal.SIGCONT)
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(60)
            except subprocess.TimeoutExpired:
                for pid in [server.proc.pid, *tree]:
                    if _running(pid):
                        os.kill(pid, signal.SIGKILL)
                server.proc.wait()


class Streams:
    """`count` streaming completions in threads; each records its SSE events."""

    def __init__(self, url: str, count: int, **body):
        self.events: list[list[dict | str]] = [[] for _ in range(count)]
        self.started = [threading.Event() for _ in range(count)]
        self.threads = [threading.Thread(target=self._run, args=(url, i, body), daemon=True)
                        for i in range(count)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, i: int, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=300,
                              json={"stream": True, **body}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events[i].append(data if data == "[DONE]" else json.loads(data))
                        self.started[i].set()
        except httpx.HTTPError as exc:
            self.events[i].append(f"transport error: {exc!r}")
        finally:
            self.started[i].set()

    def wait_started(self, timeout: float = 120) -> None:
        for e in self.started:
            assert e.wait(timeout), "a stream sent nothing"

    def join(self, timeout: float = 300) -> list[list[dict | str]]:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a stream did not end"
        return self.events


def _finish(events: list[dict | str]) -> tuple[str | None, str | None]:
    """(finish_reason of the last choice event, error message if an error event came)."""
    finish, error = None, None
    for e in events:
        if isinstance(e, dict):
            if "error" in e:
                error = e["error"].get("message", str(e["error"]))
            for c in e.get("choices", []):
                finish = c.get("finish_reason") or finish
        elif e != "[DONE]":
            error = e
    return finish, error


# -- liveness ------------------------------------------------------------------------------


def test_heartbeat_goes_on_during_a_long_step_of_the_default_model(tmp_path, default_model_dir):
    """The heartbeat thread beats while the main thread runs a multi-second prefill step of the
    real default model: what the launcher sees is a long step, never a silent engine."""
    path = str(tmp_path / "engine.sock")
    config = EngineConfig.create(model=str(default_model_dir), device="cpu", max_model_len=2048,
                                 max_num_batched_tokens=2048, num_gpu_blocks_override=256)
    p = mp.get_context("spawn").Process(target=run_engine, args=(config, path))
    p.start()

    async def main() -> tuple[float, float]:
        client = EngineClient([path])
        await client.start()
        await client.wait_ready(timeout=300)
        stats = client.engines[0].stats
        stream = await client.submit("long", list(range(1000, 3000)), SamplingParams(max_tokens=1))
        longest_step = worst_beat = 0.0
        done = asyncio.ensure_future(_drain(stream))
        while not done.done():  # the engine's own process: reading its words costs it nothing
            longest_step = max(longest_step, stats.step_age())
            if stats.step_age() > 0:
                worst_beat = max(worst_beat, stats.heartbeat_age())
            await asyncio.sleep(0.05)
        assert (await done)[-1].finish_reason == "length"
        await client.close()
        return longest_step, worst_beat

    try:
        longest_step, worst_beat = asyncio.run(main())
    finally:
        p.terminate()
        p.join(60)
    assert p.exitcode == 0
    assert longest_step > 2.0, f"the step took only {longest_step:.1f} s: not a long step"
    assert worst_beat < 2.0, f"no heartbeat for {worst_beat:.1f} s during a {longest_step:.1f} s step"


async def _drain(stream) -> list:
    return [out async for out in stream]


def test_long_prompt_under_default_flags_fails_no_stream(launch, default_model_dir):
    """An 8,000-token prompt under default flags arrives while 8 streams are open: every request
    completes, the engine is never declared dead or restarted, and (CPU: the prompt is chunked
    into short steps) the open streams keep getting tokens during its prefill, so they end
    before it does. With one step for the whole prompt they would end after it."""
    server = launch(default_model_dir, timeout=300)
    (engine,) = engine_pids(server.proc.pid)
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "word " * 9000}, timeout=60).json()
    prompt = tok["tokens"][:8000]
    ended: dict[str, float] = {}

    def long_request() -> None:
        r = httpx.post(server.url + "/v1/completions", timeout=900,
                       json={"prompt": prompt, "max_tokens": 2})
        ended["long"] = time.monotonic()
        ended["response"] = r

    streams = Streams(server.url, 8, prompt="Count to ten:", max_tokens=12, ignore_eos=True)
    streams.wait_started()  # running: each step gives them a token before the prompt's chunk
    long = threading.Thread(target=long_request)
    long.start()
    for events in streams.join(900):
        assert _finish(events) == ("length", None), events
        assert events[-1] == "[DONE]"
    streams_ended = time.monotonic()
    long.join(900)
    r = ended["response"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["prompt_tokens"] == 8000
    assert streams_ended < ended["long"], "the open streams waited for the whole prompt"
    assert engine_pids(server.proc.pid) == [engine]
    text = server.stop()
    assert "died" not in text and "hung" not in text, text


def test_stopped_engine_is_killed_restarted_and_its_streams_fail_clearly(launch, default_model_dir):
    """SIGSTOP an engine past --engine-hang-timeout: the launcher kills it (SIGKILL) and starts
    a new one; the streams open on it end with an error event; then the server serves again."""
    server = launch(default_model_dir, "--workers", "2", "--max-model-len", "512",
                    "--engine-hang-timeout", "3")
    (engine,) = engine_pids(server.proc.pid)
    streams = Streams(server.url, 3, prompt="Count:", max_tokens=400, ignore_eos=True)
    streams.wait_started()
    os.kill(engine, signal.SIGSTOP)
    stopped = time.monotonic()
    for events in streams.join(120):
        finish, error = _finish(events)
        assert error is not None and "engine 0 died" in error, events
        assert events[-1] == "[DONE]"
    assert time.monotonic() - stopped < 60
    assert not _running(engine)
    deadline = time.monotonic() + 180
    while True:  # every worker answers again (a new connection may reach either)
        codes = [httpx.post(server.url + "/v1/completions", timeout=120,
                            json={"prompt": "Hi", "max_tokens": 2}).status_code for _ in range(4)]
        if codes == [200] * 4:
            break
        assert set(codes) <= {200, 503}, codes
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.5)
    new = engine_pids(server.proc.pid)
    assert len(new) == 1 and new != [engine]
    assert httpx.get(server.url + "/health").status_code == 200
    text = server.stop()
    assert f"(pid {engine}) is hung: no heartbeat" in text, text


# -- signals and supervision ---------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_the_whole_group_drains_open_streams(launch, default_model_dir, sig):
    """`kill -INT -- -PGID` (Ctrl-C in a terminal) or SIGTERM to the whole group: every open
    stream completes normally, then everything exits 0 and cleans up after itself."""
    server = launch(default_model_dir, "--workers", "2", "--max-model-len", "512",
                    "--drain-timeout", "120")
    tree = descendants(server.proc.pid)
    (runtime,) = _runtime_dirs(server.proc.pid)
    streams = Streams(server.url, 4, prompt="Count:", max_tokens=40, ignore_eos=True)
    streams.wait_started()
    os.killpg(server.proc.pid, sig)
    for events in streams.join(300):
        assert _finish(events) == ("length", None), events
        assert events[-1] == "[DONE]"
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events if isinstance(e, dict)) > 1
    assert server.proc.wait(120) == 0, server.log.read_text()
    assert "Traceback" not in server.log.read_text()
    deadline = time.monotonic() + 10
    while any(_running(p) for p in tree):
        assert time.monotonic() < deadline, [p for p in tree if _running(p)]
        time.sleep(0.1)
    assert not runtime.exists()


def _segments_of(pids: list[int]) -> list:
    return sorted(p for p in SHM_DIR.glob("ringserve-*") if int(p.name.split("-")[1]) in pids)


@pytest.mark.serial  # its left-behind segments must outlive other workers' server starts
def test_killed_launcher_takes_its_tree_and_the_next_start_cleans_up(launch, tiny_model_dir):
    """SIGKILL the launcher: the engine, the Gunicorn master and its workers exit within
    seconds; its runtime folder and segments stay behind until the next start removes them."""
    flags = ("--workers", "2", "--max-model-len", "256", "--device", "cpu")
    first = launch(tiny_model_dir, *flags)
    deadline = time.monotonic() + 60  # NOTE: /health answers once one worker is up
    while len(tree := descendants(first.proc.pid)) < 4:  # engine, master, 2 workers
        assert time.monotonic() < deadline, {p: cmdline(p) for p in tree}
        time.sleep(0.1)
    engines = engine_pids(first.proc.pid)
    assert len(engines) == 1
    (runtime,) = _runtime_dirs(first.proc.pid)
    # NOTE: a slot's segment is unlinked once its worker has attached (ipc/control.py): wait
    # until the engine's segments hold still, or one a worker was still attaching to vanishes
    segments, deadline = _segments_of(engines), time.monotonic() + 10
    while True:
        time.sleep(0.5)
        now = _segments_of(engines)
        if now == segments:
            break
        assert time.monotonic() < deadline, "the engine's segments never settled"
        segments = now
    assert segments  # the engine's stats segment at least
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    deadline = time.monotonic() + 10
    while any(_running(p) for p in tree):
        assert time.monotonic() < deadline, {p: cmdline(p) for p in tree if _running(p)}
        time.sleep(0.1)
    assert runtime.exists() and all(p.exists() for p in segments)  # left behind

    second = launch(tiny_model_dir, *flags)
    assert not runtime.exists()
    assert not any(p.exists() for p in segments)
    r = httpx.post(second.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    second.stop()
    assert _runtime_dirs(second.proc.pid) == []
