"""`ringserve loadgen` against a real `ringserve serve` (tiny model, one engine, one Gunicorn
worker) on 127.0.0.1: ring mode through the engines' rings, HTTP mode through /v1/completions
and /v1/chat/completions, then --compare and --plot on what they wrote."""
from __future__ import annotations

import json

import pytest

from ringserve.tools.cli import main

INPUT_LEN, OUTPUT_LEN = 24, 8


@pytest.fixture(scope="module")
def server_url(serve, tiny_model_dir):
    return serve(tiny_model_dir, "--workers", "1", "--max-model-len", "256",
                 "--drain-timeout", "5").url


def _loadgen(tmp_path, name, *args) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["loadgen", *args, "--json", str(out), "--no-progress", "--seed", "3"]) == 0
    return json.loads(out.read_text())


def _check_exact(doc, n_points, n, input_len=INPUT_LEN):
    assert len(doc["points"]) == n_points
    for p in doc["points"]:
        s = p["summary"]
        assert (s["completed"], s["failed"]) == (n, 0), s["errors"]
        assert s["total_input_tokens"] == n * input_len
        assert s["total_output_tokens"] == n * OUTPUT_LEN   # ignore_eos: as long as asked
        assert 0 < s["ttft"]["median"] <= s["e2el"]["median"]
        assert s["tpot"]["median"] > 0 and s["output_throughput"] > 0


def test_ring_mode_sweep(server_url, tmp_path, capsys):
    doc = _loadgen(tmp_path, "ring", "--mode", "ring", "--base-url", server_url,
                   "--concurrency", "1,4", "--num-prompts", "8", "--input-len", str(INPUT_LEN),
                   "--output-len", str(OUTPUT_LEN), "--goodput", "ttft:600000", "e2el:0.001")
    _check_exact(doc, 2, 8)
    assert doc["backend"]["mode"] == "ring" and doc["backend"]["engines"] == 1
    assert [p["summary"]["max_concurrency"] for p in doc["points"]] == [1, 4]
    # ttft met by all, e2el by none
    assert all(p["summary"]["goodput"] == 0.0 for p in doc["points"])
    text = capsys.readouterr().out
    assert "Successful requests:" in text and "| concurrency 4 |" in text


def test_ring_mode_prefix_jsonl_and_rate(server_url, tmp_path):
    doc = _loadgen(tmp_path, "prefix", "--mode", "ring", "--base-url", server_url,
                   "--dataset", "prefix", "--prefix-len", "32", "--num-prefixes", "2",
                   "--request-rate", "inf,200", "--num-prompts", "6", "--input-len", "8",
                   "--output-len", str(OUTPUT_LEN))
    _check_exact(doc, 2, 6, input_len=40)
    assert doc["points"][0]["summary"]["max_concurrency"] == 6   # inf: all at once
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello, world!"}\n{"prompt": [5, 6, 7, 8], "output_len": 3}\n')
    doc = _loadgen(tmp_path, "jsonl", "--mode", "ring", "--base-url", server_url,
                   "--dataset", "jsonl", "--dataset-path", str(path), "--num-prompts", "4",
                   "--concurrency", "2", "--output-len", str(OUTPUT_LEN))
    s = doc["points"][0]["summary"]
    assert (s["completed"], s["total_output_tokens"]) == (4, 2 * OUTPUT_LEN + 2 * 3)


def test_http_mode_completions_and_chat(server_url, tmp_path, tiny_model_dir):
    common = ["--mode", "http", "--base-url", server_url, "--tokenizer", str(tiny_model_dir),
              "--num-prompts", "8", "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN)]
    doc = _loadgen(tmp_path, "http", *common, "--concurrency", "1,4")
    assert doc["backend"]["prompt_format"] == "ids"   # ringserve takes token-id prompts
    _check_exact(doc, 2, 8)
    doc = _loadgen(tmp_path, "chat", *common, "--endpoint", "/v1/chat/completions",
                   "--concurrency", "4")
    s = doc["points"][0]["summary"]
    assert doc["backend"]["prompt_format"] == "text"
    assert (s["completed"], s["total_output_tokens"]) == (8, 8 * OUTPUT_LEN)
    assert s["total_input_tokens"] > 8 * 4          # counted by the server (template included)
    # Bounded by time: keeps issuing for the duration, then lets the open ones finish.
    doc = _loadgen(tmp_path, "timed", *common[:-6], "--duration", "0.5", "--concurrency", "2",
                   "--input-len", "8", "--output-len", "4")
    s = doc["points"][0]["summary"]
    assert s["completed"] >= 2 and s["failed"] == 0 and s["duration"] >= 0.5


def test_compare_and_plot(server_url, tmp_path, capsys):
    args = ["--base-url", server_url, "--concurrency", "2", "--num-prompts", "4",
            "--input-len", "8", "--output-len", "4"]
    _loadgen(tmp_path, "a", "--mode", "ring", *args)
    _loadgen(tmp_path, "b", "--mode", "ring", *args)
    capsys.readouterr()
    argv = ["loadgen", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    if _has_matplotlib():
        argv += ["--plot", str(tmp_path / "ab.png")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "concurrency 2" in text and "TTFT median (ms)" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith("completed")}
    assert rows["completed"] == ["4", "4", "1.00x"]
    if _has_matplotlib():
        assert (tmp_path / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


def test_errors_are_one_line(capsys, tmp_path, unused_port):
    assert main(["loadgen", "--mode", "ring", "--server-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["loadgen", "--mode", "http", "--base-url", f"http://127.0.0.1:{unused_port}",
                 "--dataset", "jsonl", "--dataset-path", "/nonexistent.jsonl",
                 "--prompt-format", "text"]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["loadgen", "--goodput", "itl:5"]) == 1
    assert "goodput" in capsys.readouterr().err


def test_long_prompt_among_decoding_streams(server_url, tmp_path, capsys, tiny_model_dir):
    """--long-prompt: two streams decode, one 200-token prompt arrives; the streams' gaps before
    it, during its prefill and during its decode, and its own, are reported."""
    doc = _loadgen(tmp_path, "long", "--mode", "http", "--base-url", server_url,
                   "--tokenizer", str(tiny_model_dir), "--concurrency", "2",
                   "--input-len", "8", "--output-len", "16", "--long-prompt", "200",
                   "--long-output-len", "8", "--baseline", "0.5")
    m = doc["long_prompt"]
    assert (m["streams"], m["long_prompt_len"]) == (2, 200) and m["long_ttft_ms"] > 0
    assert m["long_itl_ms"]["count"] <= 7  # a chunk may hold several tokens
    assert m["streams_itl_baseline_ms"]["count"] > 0
    assert m["streams_itl_baseline_ms"]["p50"] <= m["streams_itl_baseline_ms"]["p99"]
    assert "| streams, during its prefill |" in capsys.readouterr().out


def test_gaps_are_placed_by_when_they_end():
    from ringserve.tools.loadgen.interference import gaps_ending_in
    from ringserve.tools.loadgen.stats import RequestResult
    # events at 10.5, 11.0, 12.0, 14.0 and, for the second, 11.5 and 11.75
    a = RequestResult(prompt_len=1, ttft=0.5, itl=[0.5, 1.0, 2.0], sent_at=10.0, success=True)
    b = RequestResult(prompt_len=1, ttft=1.5, itl=[0.25], sent_at=10.0, success=True)
    failed = RequestResult(prompt_len=1, ttft=0.1, itl=[0.1], sent_at=11.0)
    assert sorted(gaps_ending_in([a, b, failed], 11.0, 12.0)) == [0.25, 0.5]
    assert gaps_ending_in([a, b], 12.0, 14.0) == [1.0]
    assert gaps_ending_in([a, b], 14.5, 20.0) == []
