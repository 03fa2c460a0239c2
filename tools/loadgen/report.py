"""Reports: vLLM `bench serve`-style text for one load point, a markdown table for a sweep,
the JSON document of a run (``--json``), and two runs side by side (``--compare``)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ringserve.tools.bench_report import markdown_table
from ringserve.tools.loadgen.stats import LATENCY_METRICS, Summary

FORMAT = "ringserve-loadgen/1"
_TITLES = {"ttft": ("Time to First Token", "TTFT"),
           "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_point(label: str, s: dict[str, Any]) -> str:
    """One load point, laid out as vLLM's `bench serve` prints it."""
    w = 50
    lines = [f" {label} ".center(w, "="),
             f"{'Successful requests:':<40}{s['completed']:<10}",
             f"{'Failed requests:':<40}{s['failed']:<10}",
             f"{'Maximum request concurrency:':<40}{s['max_concurrency']:<10}",
             f"{'Benchmark duration (s):':<40}{s['duration']:<10.2f}",
             f"{'Total input tokens:':<40}{s['total_input_tokens']:<10}",
             f"{'Total generated tokens:':<40}{s['total_output_tokens']:<10}",
             f"{'Request throughput (req/s):':<40}{s['request_throughput']:<10.2f}"]
    if s.get("goodput") is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{s['goodput']:<10.2f}")
    lines += [f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:<10.2f}",
              f"{'Total Token throughput (tok/s):':<40}{s['total_token_throughput']:<10.2f}"]
    for key in LATENCY_METRICS:
        title, short = _TITLES[key]
        d = s[key]
        lines.append(f"{title}".center(w, "-"))
        lines += [f"{f'Mean {short} (ms):':<40}{_f(d['mean']):<10}",
                  f"{f'Median {short} (ms):':<40}{_f(d['median']):<10}",
                  f"{f'P90 {short} (ms):':<40}{_f(d['p90']):<10}",
                  f"{f'P99 {short} (ms):':<40}{_f(d['p99']):<10}"]
    for err in s.get("errors") or []:
        lines.append(f"error: {err}")
    lines.append("=" * w)
    return "\n".join(lines)


def sweep_table(points: list[dict[str, Any]]) -> str:
    """A markdown table, one row per load point."""
    goodput = any(p["summary"].get("goodput") is not None for p in points)
    head = ["load", "ok", "failed", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
            "TPOT p99", "ITL p50", "E2E p50"] + (["goodput req/s"] if goodput else [])
    rows = []
    for p in points:
        s = p["summary"]
        row = [p["label"], str(s["completed"]), str(s["failed"]), _f(s["request_throughput"]),
               _f(s["output_throughput"], 1), _f(s["ttft"]["median"], 1), _f(s["ttft"]["p99"], 1),
               _f(s["tpot"]["median"], 1), _f(s["tpot"]["p99"], 1), _f(s["itl"]["median"], 1),
               _f(s["e2el"]["median"], 1)]
        rows.append(row + ([_f(s.get("goodput"))] if goodput else []))
    return markdown_table(head, rows) + "\n(latencies in ms)"


def document(config: dict[str, Any], points: list[tuple[str, dict[str, Any], Summary]]) -> dict[str, Any]:
    """The JSON of a run: its configuration and each load point's summary."""
    return {"format": FORMAT, **config,
            "points": [{"label": label, "load": load, "summary": asdict(s)} for label, load, s in points]}


def load_document(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a `ringserve loadgen --json` file")
    return doc


_COMPARE_ROWS = [
    ("completed", lambda s: s["completed"], 0), ("failed", lambda s: s["failed"], 0),
    ("req/s", lambda s: s["request_throughput"], 2), ("out tok/s", lambda s: s["output_throughput"], 1),
    ("total tok/s", lambda s: s["total_token_throughput"], 1),
    ("goodput req/s", lambda s: s.get("goodput"), 2),
] + [(f"{_TITLES[k][1]} {stat} (ms)", (lambda s, k=k, stat=stat: s[k][stat]), 1)
     for k in LATENCY_METRICS for stat in ("mean", "median", "p99")]


def _describe(doc: dict[str, Any]) -> str:
    b = doc.get("backend", {})
    return f"{b.get('mode', '?')} {b.get('server', '')} {b.get('endpoint', '')}".strip()


def compare(docs: list[dict[str, Any]], names: list[str]) -> str:
    """Runs side by side, load point by load point (matched by label), with each run's ratio to
    the first."""
    out = [f"{n}: {_describe(d)}" for n, d in zip(names, docs, strict=True)]
    w = max(12, *(len(n) + 2 for n in names))
    ratio_heads = [f"{n}/{names[0]}" for n in names[1:]]
    rw = [max(10, len(h) + 2) for h in ratio_heads]
    labels = list(dict.fromkeys(p["label"] for d in docs for p in d["points"]))
    by_label = [{p["label"]: p["summary"] for p in d["points"]} for d in docs]
    for label in labels:
        summaries = [b.get(label) for b in by_label]
        out.append("")
        out.append(f"{label:<26}" + "".join(f"{n:>{w}}" for n in names)
                   + "".join(f"{h:>{x}}" for h, x in zip(ratio_heads, rw, strict=True)))
        for title, get, digits in _COMPARE_ROWS:
            values = [get(s) if s is not None else None for s in summaries]
            if all(v is None for v in values):
                continue
            ratios = [f"{v / values[0]:.2f}x" if values[0] and v is not None else "-" for v in values[1:]]
            out.append(f"{title:<26}" + "".join(f"{_f(v, digits):>{w}}" for v in values)
                       + "".join(f"{r:>{x}}" for r, x in zip(ratios, rw, strict=True)))
    return "\n".join(out)
