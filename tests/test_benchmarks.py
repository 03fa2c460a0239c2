"""Every benchmark under tools/ runs at a tiny size, prints the shared table and writes its
--json document with the rows it promises (tools/bench_report.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ringserve.tools import (
    bench_engine,
    bench_forward,
    bench_ipc,
    bench_llamacpp,
    bench_structured,
    bench_trace,
)
from ringserve.tools.bench_report import FORMAT, BenchRun, Column, markdown_table, table


def _doc(path, tool: str) -> dict:
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT and doc["tool"] == tool
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu_model"]
    assert len(doc["load_average_before"]) == 3 and len(doc["load_average_after"]) == 3
    return doc


def _table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of the markdown table whose header starts with first_cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| " + first_cell))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_markdown_table_aligns_and_formats():
    text = table([{"name": "ab", "v": 1.5}, {"name": "c", "v": None}],
                 [Column("name", "name", align="<"), Column("v", "value ms", ".2f")])
    assert text.splitlines() == ["| name | value ms |",
                                 "|:-----|---------:|",
                                 "| ab   |     1.50 |",
                                 "| c    |        - |"]
    assert markdown_table(["a"], [["123"]]).splitlines()[1] == "|----:|"


def test_bench_run_document(tmp_path):
    import argparse
    run = BenchRun.start("bench_x", argparse.Namespace(n=3, json=tmp_path / "x.json", api_key="sk-1"))
    run.write(tmp_path / "x.json", [{"n": 3}], extra=1)
    doc = _doc(tmp_path / "x.json", "bench_x")
    assert doc["args"] == {"n": 3, "json": str(tmp_path / "x.json"), "api_key": "<withheld>"}
    assert doc["rows"] == [{"n": 3}] and "sk-1" not in (tmp_path / "x.json").read_text()
    assert doc["extra"] == 1 and doc["date"][:2] == "20"


def test_bench_structured(tmp_path, tiny_model_dir, capsys):
    bench_structured.main(["--model", str(tiny_model_dir), "--concurrency", "1", "3",
                           "--max-tokens", "12", "--rounds", "1", "--json", str(tmp_path / "s.json")])
    rows = _doc(tmp_path / "s.json", "bench_structured")["rows"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["tokens"] == 12 * r["concurrency"]  # constrained, and never done early
        assert r["plain_tok_s"] > 0 and r["json_tok_s"] > 0 and r["mask_us"] > 0
        assert r["ratio"] == r["json_tok_s"] / r["plain_tok_s"]
    assert "json / plain" in capsys.readouterr().out


def test_bench_engine(tmp_path, capsys):
    bench_engine.main(["--running", "4", "16", "--steps", "5", "--rounds", "3",
                       "--json", str(tmp_path / "e.json")])
    rows = _doc(tmp_path / "e.json", "bench_engine")["rows"]
    assert [r["running"] for r in rows] == [4, 16]
    for r in rows:
        phases = [r["schedule_ms"], r["prepare_ms"], r["update_ms"]]
        assert all(p > 0 for p in phases) and r["sample_ms"] > 0
        assert r["engine_ms"] == pytest.approx(sum(phases))
        assert len(r["engine_ms_rounds"]) == 3 and r["engine_ms"] == sorted(r["engine_ms_rounds"])[1]
    printed = _table_rows(capsys.readouterr().out, "running")
    assert [c[0] for c in printed] == ["4", "16"]
    assert printed[1][4] == f"{rows[1]['engine_ms']:.3f}"


def test_bench_trace(tmp_path, capsys):
    bench_trace.main(["--running", "4", "--steps", "5", "--rounds", "1", "--vocab", "512",
                      "--json", str(tmp_path / "t.json")])
    [row] = _doc(tmp_path / "t.json", "bench_trace")["rows"]
    assert row["running"] == 4
    for mode in bench_trace.MODES:
        assert row[mode.replace(" ", "_") + "_ms"] > 0
    assert row["off_vs_bare"] == pytest.approx(row["off_ms"] / row["bare_ms"])
    assert row["all_vs_off"] == pytest.approx(row["all_traced_ms"] / row["off_ms"])
    assert [c[0] for c in _table_rows(capsys.readouterr().out, "running")] == ["4"]


def test_bench_http(tiny_model_dir, tmp_path):
    """A real engine and Gunicorn worker on the tiny model: both paths stream every token."""
    cmd = [sys.executable, "-m", "ringserve.tools.bench_http", "--model", str(tiny_model_dir),
           "--device", "cpu", "--max-model-len", "256", "--concurrency", "4", "--max-tokens", "8",
           "--prompt-tokens", "8", "--idle-s", "0.2", "--json", str(tmp_path / "h.json")]
    # Its own session: on a timeout the engine and Gunicorn it started go down with it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"bench_http did not finish in 90 s:\n{stdout}\n{stderr}")
    assert proc.returncode == 0, stderr
    doc = _doc(tmp_path / "h.json", "bench_http")
    rows = {r["metric"]: r for r in doc["rows"]}
    assert list(rows) == ["TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms", "CPU us/token"]
    assert doc["tokens"] == 4 * 8 and doc["stream_events"]["engine_client"] == 4 * 8
    assert 4 <= doc["stream_events"]["http"] <= 4 * 8   # a token may wait for the next one's text
    assert doc["idle_worker_cpu_us_per_s"] >= 0
    for r in rows.values():
        assert r["engine_client"] > 0 and r["http"] >= 0
    assert rows["CPU us/token"]["http"] > 0
    assert rows["TTFT p50 ms"]["ratio"] == pytest.approx(rows["TTFT p50 ms"]["http"]
                                                         / rows["TTFT p50 ms"]["engine_client"])
    assert doc["device"] == "cpu"
    printed = _table_rows(stdout, "metric")
    assert [c[0] for c in printed] == list(rows)


def test_bench_forward(tiny_model_dir, tmp_path, capsys):
    bench_forward.main(["--model", str(tiny_model_dir), "--batch", "1", "4", "--steps", "2",
                        "--context", "16", "--prefill-tokens", "32", "--prefill-reps", "1",
                        "--no-peer", "--json", str(tmp_path / "f.json")])
    doc = _doc(tmp_path / "f.json", "bench_forward")
    assert [r["batch"] for r in doc["rows"]] == [1, 4] and doc["peer"] is None
    for r in doc["rows"]:
        assert r["ours_float32_tok_s"] == pytest.approx(r["batch"] / r["ours_float32_ms"] * 1e3)
    assert doc["prefill"]["tokens"] == 32 and doc["prefill"]["ours_float32_s"] > 0
    assert [c[0] for c in _table_rows(capsys.readouterr().out, "batch")] == ["1", "4"]
    # one side per weight dtype and activation type (--cpu-activation-dtype), named by both
    bench_forward.main(["--model", str(tiny_model_dir), "--batch", "1", "--steps", "1", "--context", "16",
                        "--prefill-tokens", "16", "--prefill-reps", "1", "--no-peer",
                        "--activations", "auto", "float32", "--op-times", "--json", str(tmp_path / "g.json")])
    row = _doc(tmp_path / "g.json", "bench_forward")["rows"][0]
    assert row["ours_float32_auto_ms"] > 0 and row["ours_float32_float32_ms"] > 0
    # --op-times: each side's ms per step by op, the step's every op and the Python between them
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("op times")]
    assert [ln.split(",")[0] for ln in lines] == ["op times float32_auto", "op times float32_float32"]
    for ln in lines:
        assert all(f" {op} " in ln for op in ("linear", "attention", "add_rms_norm", "(between ops)"))


def test_bench_ipc(tmp_path, capsys):
    pytest.importorskip("zmq")
    bench_ipc.main(["--quick", "--repeats", "1", "--json", str(tmp_path / "i.json")])
    doc = _doc(tmp_path / "i.json", "bench_ipc")
    kinds = ["ring", "os.pipe", "mp.Queue", "zmq+msgspec"]
    assert [(r["transport"], r["tokens"]) for r in doc["rows"]] == [(k, n) for n in (16, 4096) for k in kinds]
    for n in (16, 4096):
        rows = {r["transport"]: r for r in doc["rows"] if r["tokens"] == n}
        zmq = rows["zmq+msgspec"]
        assert zmq["throughput_vs_zmq"] == 1.0 and zmq["rtt_p50_zmq_over"] == 1.0
        ring = rows["ring"]
        assert ring["msgs_per_s"] > 0 and 0 < ring["rtt_p50_us"] <= ring["rtt_p99_us"]
        assert ring["throughput_vs_zmq"] == pytest.approx(ring["msgs_per_s"] / zmq["msgs_per_s"])
        assert ring["rtt_p50_zmq_over"] == pytest.approx(zmq["rtt_p50_us"] / ring["rtt_p50_us"])
    assert [(c["codec"], c["tokens"]) for c in doc["codec"]] == [
        (c, n) for n in (16, 4096) for c in ("ring wire", "msgspec", "pickle")]
    assert 0 < doc["wakeup_us"]["p50"] <= doc["wakeup_us"]["p99"]
    out = capsys.readouterr().out
    assert [c[0] for c in _table_rows(out, "transport")] == kinds * 2
    assert [c[0] for c in _table_rows(out, "codec")] == ["ring wire", "msgspec", "pickle"] * 2


@pytest.mark.parametrize("flag", ["--steps", "--prefill-reps", "--prefill-tokens"])
def test_bench_forward_refuses_zero_runs_in_one_line(flag, capsys):
    with pytest.raises(SystemExit) as e:
        bench_forward.main([flag, "0"])
    assert e.value.code == 2 and f"{flag} must be at least 1" in capsys.readouterr().err


def _served(tok_s: float, peak: float) -> dict:
    summary = {"output_throughput": tok_s, "ttft": {"median": 1e4 / tok_s}, "tpot": {"median": 1e3 / tok_s}}
    return {"points": [{"load": {"concurrency": 1}, "summary": summary}], "memory": {"peak_pss_bytes": peak}}


def test_bench_llamacpp_rounds_give_each_ratio_and_their_median():
    """--rounds: each round's ratio and the median of them; the peak memory is each server's most."""
    rounds = [{"ringserve": _served(a, 1.2e9), "llama-server": _served(b, m)}
              for a, b, m in ((30.0, 24.0, 1.3e9), (26.0, 26.0, 1.1e9), (33.0, 22.0, 1.0e9))]
    text = bench_llamacpp.rounds_table(rounds)
    assert _table_rows(text, "concurrency") == [
        ["1", "30.0 / 26.0 / 33.0", "24.0 / 26.0 / 22.0", "1.25 / 1.00 / 1.50", "**1.25**"]]
    assert _table_rows(text, "concurrency | TTFT") == [[
        "1", "333 vs 417 / 385 vs 385 / 303 vs 455", "33 vs 42 / 38 vs 38 / 30 vs 45"]]
    assert "ringserve 1.20 GB, llama-server 1.30 GB (ratio 0.92)" in text


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_bench_llamacpp_refuses_no_rounds(rounds, capsys):
    with pytest.raises(SystemExit) as e:
        bench_llamacpp.main(["--gguf", "m.gguf", "--rounds", rounds])
    assert e.value.code == 2 and "--rounds must be at least 1" in capsys.readouterr().err
