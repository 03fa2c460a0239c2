"""Where a served run's engine time goes, by the kind of step.

    ringserve serve --model M --enable-debug-endpoints &
    python -m ringserve.tools.step_mix --base-url http://127.0.0.1:8000 --duration 120 &
    ringserve loadgen --mode http --base-url http://127.0.0.1:8000 --concurrency 16 --warmup 0 ...

Polls the server's GET /debug/engines (each engine's last steps, their sizes and times:
engine/trace.py) while a load runs elsewhere, then prints the steps grouped by what they held
(decodes alone, or prompt tokens of a size, with the decodes that rode along), each group's
count, mean step, time per token row and share of the engines' time, and the time between
steps. It answered where a c=16 run against llama-server spends its time (docs/bench_quant.md,
the eighth session): in the rows' compute, not between steps. A poll must come before an engine
runs DEBUG_STEPS more steps (engine/process.py), or steps are missed: the tool counts the step
numbers it did not see and shows the time around them apart ("around steps not seen"). Only
the steps after its first poll count: those an engine kept from before are another run's (start
the tool first; loadgen's warm-up request, alone in the engine, is left out with --warmup 0).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

from ringserve.tools.bench_report import markdown_table

# Prompt tokens a step held, by group: (label, lowest, highest); 0: decodes alone
GROUPS = (("decodes only", 0, 0), ("prompt tokens 1-63", 1, 63), ("prompt tokens 64-255", 64, 255),
          ("prompt tokens 256-1023", 256, 1023), ("prompt tokens 1024+", 1024, 1 << 62))


def poll(url: str, duration: float, every: float, api_key: str | None = None
         ) -> tuple[dict[tuple[int, int], dict], int]:
    """Every engine's steps seen in `duration` seconds, by (engine pid, step), and the polls made:
    the steps that ran after the first poll (an engine first seen later: all of its steps).
    Ctrl-C ends it early; a server that refuses or cannot be reached ends it with one line."""
    steps: dict[tuple[int, int], dict] = {}
    before: dict[int, int] = {}  # engine pid -> its last step number at the first poll
    polls = 0
    end = time.monotonic() + duration
    where = url.rstrip("/") + "/debug/engines"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=30, headers=headers) as client:
        try:
            while True:
                try:
                    r = client.get(where)
                except httpx.HTTPError as e:
                    raise SystemExit(f"GET {where}: {e}") from None
                if r.status_code != 200:
                    hint = {404: "serve with --enable-debug-endpoints",
                            401: "give the server's key (--api-key)"}.get(r.status_code, r.text[:200])
                    raise SystemExit(f"GET {where}: {r.status_code}; {hint}")
                polls += 1
                steps.update(_new_steps(r.json()["engines"], before, first=polls == 1))
                if time.monotonic() + every > end:
                    break
                time.sleep(every)
        except KeyboardInterrupt:
            pass
    return steps, polls


def _new_steps(engines: list[dict], before: dict[int, int], first: bool
               ) -> Iterator[tuple[tuple[int, int], dict]]:
    """((engine pid, step), step) of each engine's snapshot past its mark in `before`; first: the
    first poll's, which sets the marks. NOTE: a snapshot keeps an engine's last steps whenever they
    ran: those the first poll sees came before the tool (a client's warm-up request, an earlier
    run), and counted, a warm-up's 64 one-row steps read as a c=16 run's decodes at 10 rows a step."""
    for engine in engines:
        snapshot = engine.get("snapshot")
        if not snapshot:  # an engine that has not published one yet
            continue
        pid, seen = int(snapshot["pid"]), snapshot.get("steps") or ()
        if first:
            before[pid] = max((s["step"] for s in seen), default=-1)
        for s in seen:
            if s["step"] > before.get(pid, -1):
                yield (pid, s["step"]), s


def summarize(steps: dict[tuple[int, int], dict]) -> dict[str, Any]:
    """The groups (GROUPS' order, empty ones left out) and the totals over all engines: busy
    seconds (in steps), idle (between an engine's consecutive steps), unseen (around step numbers
    the polls missed) and the count of those."""
    by_engine: dict[int, list[dict]] = {}
    for (pid, _), s in steps.items():
        by_engine.setdefault(pid, []).append(s)
    busy = sum(s["end"] - s["start"] for s in steps.values())
    idle = unseen = 0.0
    missed = 0
    for ss in by_engine.values():
        ss.sort(key=lambda s: s["step"])
        for a, b in pairwise(ss):
            if b["step"] == a["step"] + 1:
                idle += b["start"] - a["end"]
            else:
                unseen += b["start"] - a["end"]
                missed += b["step"] - a["step"] - 1
    span = busy + idle + unseen
    groups = []
    for label, lo, hi in GROUPS:
        members = [s for s in steps.values() if lo <= s["num_prefill_tokens"] <= hi]
        if not members:
            continue
        seconds = sum(s["end"] - s["start"] for s in members)
        decode = sum(s["num_decode_tokens"] for s in members)
        prompt = sum(s["num_prefill_tokens"] for s in members)
        groups.append({"group": label, "steps": len(members), "decode_rows": decode, "prompt_rows": prompt,
                       "seconds": seconds, "mean_step_ms": 1e3 * seconds / len(members),
                       "ms_per_row": 1e3 * seconds / max(decode + prompt, 1),
                       "share": seconds / span if span > 0 else 0.0})
    return {"engines": len(by_engine), "steps": len(steps), "missed_steps": missed, "span_s": span,
            "busy_s": busy, "idle_s": idle, "unseen_s": unseen, "groups": groups}


def render(summary: dict[str, Any]) -> str:
    rows = [[g["group"], str(g["steps"]), f"{g['decode_rows'] / g['steps']:.1f}",
             f"{g['prompt_rows'] / g['steps']:.1f}", f"{g['mean_step_ms']:.1f}", f"{g['ms_per_row']:.2f}",
             f"{g['seconds']:.2f}", f"{100 * g['share']:.0f} %"] for g in summary["groups"]]
    span = summary["span_s"]
    for label, key in (("between steps", "idle_s"), ("around steps not seen", "unseen_s")):
        if key == "idle_s" or summary[key] > 0:
            rows.append([label, "", "", "", "", "", f"{summary[key]:.2f}",
                         f"{100 * summary[key] / span:.0f} %" if span > 0 else "-"])
    head = ["steps holding", "steps", "decodes a step", "prompt tokens a step", "mean step ms",
            "ms a token row", "seconds", "of the time"]
    return (markdown_table(head, rows, ["<"] + [">"] * 7) +
            f"\n\n{summary['steps']} steps of {summary['engines']} engine(s) over {span:.1f} s of engine time"
            f" ({summary['missed_steps']} step numbers not seen: poll more often if that is not 0)")


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="step_mix", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--duration", type=float, default=60.0, help="seconds to poll (Ctrl-C ends it early)")
    p.add_argument("--every", type=float, default=2.0, help="seconds between polls")
    p.add_argument("--json", type=Path, help="also write the summary here")
    p.add_argument("--api-key", help="the server's --api-key, if it has one",
                   default=os.environ.get("RINGSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    args = p.parse_args(None if argv is None else list(argv))
    for name in ("duration", "every"):
        value = getattr(args, name)
        if not value > 0 or value == float("inf"):  # NOTE: `not > 0` is also true of NaN
            p.error(f"--{name} must be a positive number of seconds, got {value}")
    return args


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    steps, polls = poll(args.base_url, args.duration, args.every, args.api_key)
    if not steps:
        print(f"no steps in {polls} poll(s): was the server under load? (the steps before the first poll "
              "are not counted: start the tool, then the load)", file=sys.stderr)
        return 1
    summary = summarize(steps)
    print(render(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
