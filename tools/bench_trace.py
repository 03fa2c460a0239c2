"""What request tracing costs the engine loop (figures in docs/trace.md).

Steady decode with N running requests on a runner that returns random logits (no model: only
the engine's own work is timed, where any overhead shows most). Four ways of stepping, taken in
turn for several rounds, median per-step time of each:

- bare:       schedule, build the batch, submit, update: EngineCore.step with no tracer code;
- off:        EngineCore.step, no traced request (what every untraced server pays);
- one traced: EngineCore.step with one of the N requests traced;
- all traced: every request traced.

    .venv/bin/python -m ringserve.tools.bench_trace --running 8 64 256 [--json FILE]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ringserve.engine.core import EngineCore
from ringserve.engine.inputs import build_batch
from ringserve.engine.sampling_metadata import build_sampling_metadata
from ringserve.tools.bench_engine import decode_engine
from ringserve.tools.bench_report import BenchRun, Column, add_json_argument, table

MODES = ("bare", "off", "one traced", "all traced")


def _bare_step(engine: EngineCore) -> None:
    """EngineCore.step (launch_step + finish_step) as it would be without any tracing code,
    for steady greedy decode (no aborts, refusals or prompt logprobs to carry)."""
    sched = engine.scheduler.schedule()
    if sched.scheduled:
        batch = build_batch(sched, engine.kv)
        rows = [i for i, s in enumerate(sched.scheduled) if s.samples_token]
        reqs = [sched.scheduled[i].request for i in rows]
        handle = engine.runner.submit(batch, np.asarray(rows, np.int64),
                                      build_sampling_metadata(reqs) if reqs else None)
        result = handle.result()
        engine.scheduler.update_after_step(sched)
        engine.update(reqs, result)
    engine._record_stats(sched)
    engine.num_steps += 1


def run_mode(mode: str, num_running: int, steps: int, vocab: int) -> float:
    """Median milliseconds per step."""
    traced = {"bare": 0, "off": 0, "one traced": 1, "all traced": num_running}[mode]
    engine = decode_engine(num_running, steps, vocab, traced=traced)
    step = (lambda: _bare_step(engine)) if mode == "bare" else engine.step
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    assert engine.num_running == num_running  # still steady decode: nothing finished
    return statistics.median(times) * 1e3


def _key(mode: str) -> str:
    return mode.replace(" ", "_") + "_ms"


COLUMNS = ([Column("running", "running", "d")] + [Column(_key(m), f"{m} ms", ".3f") for m in MODES]
           + [Column("off_vs_bare", "off / bare", ".3f"), Column("one_vs_off", "one / off", ".3f"),
              Column("all_vs_off", "all / off", ".3f")])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--vocab", type=int, default=49152)
    add_json_argument(p)
    a = p.parse_args(argv)
    run = BenchRun.start("bench_trace", a)
    rows = []
    for n in a.running:
        per_mode: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(a.rounds):
            for m in MODES:                        # interleaved, so drift hits every mode alike
                per_mode[m].append(run_mode(m, n, a.steps, a.vocab))
        med = {m: statistics.median(v) for m, v in per_mode.items()}
        rows.append({"running": n, **{_key(m): med[m] for m in MODES},
                     "off_vs_bare": med["off"] / med["bare"], "one_vs_off": med["one traced"] / med["off"],
                     "all_vs_off": med["all traced"] / med["off"],
                     "rounds_ms": {m: per_mode[m] for m in MODES}})
    run.finish()
    print(run.header())
    print(f"median ms per decode step (median of {a.rounds} rounds of {a.steps} steps), vocab {a.vocab}")
    print(table(rows, COLUMNS))
    run.write(a.json, rows)


if __name__ == "__main__":
    main()
