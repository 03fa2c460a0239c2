"""The load generator's statistics, workloads and reports on known inputs (numbers by hand)."""
from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from ringserve.tools.loadgen.report import compare, document, format_point, sweep_table
from ringserve.tools.loadgen.stats import Distribution, RequestResult, parse_slos, summarize
from ringserve.tools.loadgen.workload import jsonl_requests, prefix_requests, random_requests, read_jsonl

RESULTS = [
    # TPOT (0.2 - 0.1) / 4 = 25 ms
    RequestResult(prompt_len=10, output_len=5, ttft=0.1, itl=[0.02, 0.02, 0.03, 0.03], latency=0.2,
                  success=True),
    # TPOT (0.4 - 0.3) / 2 = 50 ms
    RequestResult(prompt_len=20, output_len=3, ttft=0.3, itl=[0.05, 0.05], latency=0.4, success=True),
    # one token: no TPOT
    RequestResult(prompt_len=30, output_len=1, ttft=0.2, itl=[], latency=0.2, success=True),
    RequestResult(prompt_len=40, error="HTTP 400: too long"),
]


def test_throughput_and_counts():
    s = summarize(RESULTS, duration=2.0, max_concurrency=3)
    assert (s.completed, s.failed, s.max_concurrency) == (3, 1, 3)
    assert (s.total_input_tokens, s.total_output_tokens) == (60, 9)   # failed request not counted
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(4.5)
    assert s.total_token_throughput == pytest.approx(34.5)
    assert s.goodput is None
    assert s.errors == ["HTTP 400: too long"]


def test_latency_distributions():
    s = summarize(RESULTS, duration=2.0)
    # TTFT 100, 300, 200 ms: p90 at rank 1.8 of [100, 200, 300] -> 280; p99 at 1.98 -> 298
    assert (s.ttft.mean, s.ttft.median, s.ttft.p90, s.ttft.p99) == pytest.approx((200, 200, 280, 298))
    # TPOT 25, 50 ms
    assert (s.tpot.mean, s.tpot.median, s.tpot.p90, s.tpot.p99) == pytest.approx((37.5, 37.5, 47.5, 49.75))
    # ITL pooled: 20 20 30 30 50 50 ms
    assert (s.itl.mean, s.itl.median, s.itl.p90, s.itl.p99) == pytest.approx((200 / 6, 30, 50, 50))
    # E2E 200, 400, 200 ms: sorted [200, 200, 400]
    assert (s.e2el.mean, s.e2el.median, s.e2el.p90, s.e2el.p99) == pytest.approx((800 / 3, 200, 360, 396))


def test_goodput():
    # ttft <= 250 and tpot <= 40: request 1 (100, 25) and request 3 (200, none = 0) -> 2 in 2 s
    assert summarize(RESULTS, 2.0, parse_slos(["ttft:250", "tpot:40"])).goodput == pytest.approx(1.0)
    assert summarize(RESULTS, 2.0, parse_slos(["ttft:150"])).goodput == pytest.approx(0.5)
    assert summarize(RESULTS, 2.0, parse_slos(["e2el:400"])).goodput == pytest.approx(1.5)
    assert summarize(RESULTS, 2.0, parse_slos(["e2e:399.9"])).goodput == pytest.approx(1.0)
    assert summarize(RESULTS, 2.0, parse_slos(["tpot:49"])).goodput == pytest.approx(1.0)


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "itl:5", "ttft:abc", "tpot:0", "tpot:-3"])
def test_bad_slos(bad):
    with pytest.raises(ValueError, match="goodput"):
        parse_slos([bad])


def test_nothing_completed():
    s = summarize([RequestResult(prompt_len=5, error="x")], duration=1.0, slos={"ttft": 10})
    assert (s.completed, s.failed, s.goodput) == (0, 1, 0.0)
    assert s.ttft == Distribution(None, None, None, None, None)
    assert "-" in format_point("empty", asdict(s))


def test_random_and_prefix_workloads_are_exact_and_seeded():
    pool = np.arange(17, 1000)
    a = [next(g) for g in [random_requests(pool, 64, 32, np.random.default_rng(7))] for _ in range(5)]
    b = [next(g) for g in [random_requests(pool, 64, 32, np.random.default_rng(7))] for _ in range(5)]
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert all(len(s.prompt) == 64 and s.output_len == 32 and min(s.prompt) >= 17 for s in a)
    assert len({tuple(s.prompt) for s in a}) == 5
    gen = prefix_requests(pool, 16, 2, 8, 4, np.random.default_rng(0))
    specs = [next(gen) for _ in range(4)]
    assert all(len(s.prompt) == 24 for s in specs)
    assert specs[0].prompt[:16] == specs[2].prompt[:16] != specs[1].prompt[:16] == specs[3].prompt[:16]


def test_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "Hello there", "output_len": 3}\n\n{"prompt": [5, 6, 7]}\n'
                    '{"prompt": "x", "max_tokens": 9}\n')
    specs = read_jsonl(path, output_len=11)
    assert [(s.prompt, s.output_len) for s in specs] == [("Hello there", 3), ([5, 6, 7], 11), ("x", 9)]
    order = [next(g) for g in [jsonl_requests(specs, np.random.default_rng(0))] for _ in range(6)]
    assert sorted(map(str, order[:3])) == sorted(map(str, specs)) == sorted(map(str, order[3:]))
    path.write_text('{"prompt": []}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        read_jsonl(path, 4)


def _doc(label, ttft_s, n):
    results = [RequestResult(8, 4, ttft_s, [0.01] * 3, ttft_s + 0.03, True) for _ in range(n)]
    return document({"backend": {"mode": "ring", "server": "x"}},
                    [(label, {"concurrency": 1, "request_rate": None}, summarize(results, 1.0))])


def test_sweep_table_and_compare():
    a, b = _doc("concurrency 1", 0.1, 4), _doc("concurrency 1", 0.2, 2)
    table = sweep_table(a["points"] + b["points"]).splitlines()
    assert table[0].split("|")[1].strip() == "load" and len(table) == 5
    cells = [c.strip() for c in table[2].split("|")[1:-1]]
    assert cells == ["concurrency 1", "4", "0", "4.00", "16.0", "100.0", "100.0", "10.0", "10.0",
                     "10.0", "130.0"]
    text = compare([a, b], ["A", "B"])
    rows = {line[:26].strip(): line[26:].split() for line in text.splitlines() if line[:26].strip()}
    assert rows["req/s"] == ["4.00", "2.00", "0.50x"]
    assert rows["TTFT median (ms)"] == ["100.0", "200.0", "2.00x"]
    assert rows["TPOT median (ms)"] == ["10.0", "10.0", "1.00x"]


def test_compare_three_runs_and_a_point_only_one_has():
    a, b = _doc("concurrency 1", 0.1, 4), _doc("concurrency 1", 0.2, 2)
    c = _doc("concurrency 8", 0.4, 8)
    text = compare([a, b, c], ["A", "B", "C"])
    rows = [line.split() for line in text.splitlines() if line.startswith("req/s")]
    assert rows == [["req/s", "4.00", "2.00", "-", "0.50x", "-"],
                    ["req/s", "-", "-", "8.00", "-", "-"]]
