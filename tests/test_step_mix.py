"""tools/step_mix.py: the steps of a served run grouped by what they held, from a real server's
/debug/engines under load, and its arithmetic on known steps."""
from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import free_port
from ringserve.tools import step_mix


@contextlib.contextmanager
def _streams(url: str, bodies: list[dict]) -> Iterator[None]:
    """A thread per body posting it to /v1/completions again and again while the block runs."""
    stop = threading.Event()

    def stream(body: dict) -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                assert client.post(url + "/v1/completions", json=body).status_code == 200

    threads = [threading.Thread(target=stream, args=(body,), daemon=True) for body in bodies]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def _step(n: int, start: float, seconds: float, decode: int, prompt: int) -> dict:
    return {"step": n, "start": start, "end": start + seconds, "num_decode_tokens": decode,
            "num_prefill_tokens": prompt}


def test_steps_are_grouped_by_their_prompt_tokens_with_the_time_between_them():
    # engine 7: steps 1-4 (step 3 not seen), 0.1 s apart; engine 9: one step
    steps = {(7, 1): _step(1, 0.0, 0.5, 0, 300), (7, 2): _step(2, 0.6, 0.2, 16, 0),
             (7, 4): _step(4, 1.0, 0.3, 15, 64), (9, 5): _step(5, 3.0, 0.4, 16, 0)}
    s = step_mix.summarize(steps)
    assert (s["engines"], s["steps"], s["missed_steps"]) == (2, 4, 1)
    # engine 7: 0.1 s between steps 1 and 2, 0.2 s from step 2 to step 4 (3 not seen)
    assert s["busy_s"] == pytest.approx(1.4) and s["idle_s"] == pytest.approx(0.1)
    assert s["unseen_s"] == pytest.approx(0.2) and s["span_s"] == pytest.approx(1.7)
    got = {g["group"]: g for g in s["groups"]}
    assert list(got) == ["decodes only", "prompt tokens 64-255", "prompt tokens 256-1023"]
    only = got["decodes only"]
    assert (only["steps"], only["decode_rows"], only["prompt_rows"]) == (2, 32, 0)
    assert only["seconds"] == pytest.approx(0.6) and only["mean_step_ms"] == pytest.approx(300)
    assert only["ms_per_row"] == pytest.approx(600 / 32) and only["share"] == pytest.approx(0.6 / 1.7)
    assert got["prompt tokens 64-255"]["ms_per_row"] == pytest.approx(300 / 79)
    text = step_mix.render(s)
    assert "| between steps" in text and "| around steps not seen" in text
    assert "4 steps of 2 engine(s)" in text and "1 step numbers not seen" in text


@pytest.mark.parametrize("flag", ["--duration", "--every"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "x"])
def test_a_bad_duration_or_interval_is_refused_in_one_line(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        step_mix.main([flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_a_real_server_under_load(tiny_server, tmp_path, capsys):
    """Prompts of ~100 bytes (the tiny model's tokens are bytes) and decodes from four streams: every step the
    polls saw lands in one group, and the groups' rows are the steps'."""
    url = tiny_server("--enable-debug-endpoints")
    bodies = [{"prompt": f"s{i} " * 25, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
              for i in range(4)]
    out = tmp_path / "mix.json"
    with _streams(url, bodies):
        args = ["--base-url", url, "--duration", "3", "--every", "0.2", "--json", str(out)]
        assert step_mix.main(args) == 0
    s = json.loads(out.read_text())
    groups = {g["group"]: g for g in s["groups"]}
    assert s["steps"] == sum(g["steps"] for g in groups.values()) > 0
    assert "decodes only" in groups and any(g["prompt_rows"] > 0 for g in groups.values())
    assert math.isclose(s["busy_s"], sum(g["seconds"] for g in groups.values()))
    assert math.isclose(s["span_s"], s["busy_s"] + s["idle_s"] + s["unseen_s"]) and s["idle_s"] >= 0
    assert "| decodes only" in capsys.readouterr().out


def test_the_steps_an_engine_kept_from_before_the_first_poll_are_not_counted(tiny_server, capsys):
    """An engine's snapshot holds its last steps whenever they ran (a client's warm-up request, an
    earlier run): those the first poll sees are left out, the ones after it counted."""
    url = tiny_server("--enable-debug-endpoints")
    body = {"prompt": "a b c d e f", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        for _ in range(2):
            assert client.post(url + "/v1/completions", json=body).status_code == 200
        deadline, snapshot = time.monotonic() + 30, {}
        # NOTE: the engine publishes every 0.2 s while busy and once more when idle: wait for that one
        while not (snapshot and snapshot["num_running"] == snapshot["num_waiting"] == 0):
            assert time.monotonic() < deadline, "the engine's idle snapshot never came"
            time.sleep(0.1)
            snapshot = client.get(url + "/debug/engines").json()["engines"][0].get("snapshot") or {}
        kept = [s["step"] for s in snapshot["steps"]]
    assert kept  # the requests' steps, on record before the tool starts
    assert step_mix.main(["--base-url", url, "--duration", "0.6", "--every", "0.2"]) == 1
    assert "not counted" in capsys.readouterr().err

    with _streams(url, [body]):
        steps, polls = step_mix.poll(url, 2.0, 0.2)
    assert polls >= 2 and steps and min(step for _, step in steps) > max(kept)


def test_a_server_without_debug_endpoints_is_told_how_to_serve(tiny_server):
    url = tiny_server()
    with pytest.raises(SystemExit, match="--enable-debug-endpoints"):
        step_mix.main(["--base-url", url, "--duration", "1"])


def test_a_server_that_is_not_there_is_one_line():
    port = free_port()  # nothing listens on it
    with pytest.raises(SystemExit, match=f"GET http://127.0.0.1:{port}/debug/engines: "):
        step_mix.main(["--base-url", f"http://127.0.0.1:{port}", "--duration", "1"])


def test_a_server_with_a_key_needs_it(tiny_server):
    url = tiny_server("--enable-debug-endpoints", "--api-key", "k3y")
    with pytest.raises(SystemExit, match="401; give the server's key"):
        step_mix.main(["--base-url", url, "--duration", "1", "--api-key", ""])
    assert step_mix.main(["--base-url", url, "--duration", "0.5", "--api-key", "k3y"]) == 1  # idle: no steps
