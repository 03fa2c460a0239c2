"""What request tracing costs the engine loop (issue 8; figures in docs/trace.md).

Steady decode with N running requests on a runner that returns random logits (no model: only
the engine's own work is timed, where any overhead shows most). Four ways of stepping, taken in
turn for several rounds, median per-step time of each:

- bare:       schedule, build the batch, execute, update: EngineCore.step with no tracer code;
- off:        EngineCore.step, no traced request (what every untraced server pays);
- one traced: EngineCore.step with one of the N requests traced;
- all traced: every request traced.

    .venv/bin/python -m ringserve.tools.bench_trace --running 8 64 256
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.engine.inputs import build_batch
from ringserve.engine.sampling_params import SamplingParams
from ringserve.tools.bench_engine import RandomLogitsRunner

MODES = ("bare", "off", "one traced", "all traced")


def _engine(num_running: int, steps: int, vocab: int, traced: int, prompt_len: int = 32) -> EngineCore:
    num_blocks = num_running * ((prompt_len + steps + 64) // 16 + 1)
    engine = EngineCore(EngineConfig(max_num_seqs=num_running, max_num_batched_tokens=1 << 20),
                        runner=RandomLogitsRunner(vocab, num_blocks))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    rng = np.random.default_rng(1)
    for i in range(num_running):
        engine.add_request(str(i), rng.integers(0, vocab, prompt_len).tolist(), params,
                           trace=i < traced)
    engine.step()                                  # every prompt prefilled: now steady decode
    return engine


def _bare_step(engine: EngineCore) -> None:
    """EngineCore.step as it would be without any tracing code."""
    sched = engine.scheduler.schedule()
    if sched.scheduled:
        logits = engine.runner.execute(build_batch(sched, engine.kv))
        engine.update(sched, logits)
    engine._record_stats(sched)


def run_mode(mode: str, num_running: int, steps: int, vocab: int) -> float:
    """Median milliseconds per step."""
    traced = {"bare": 0, "off": 0, "one traced": 1, "all traced": num_running}[mode]
    engine = _engine(num_running, steps, vocab, traced)
    step = (lambda: _bare_step(engine)) if mode == "bare" else engine.step
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--vocab", type=int, default=49152)
    a = p.parse_args(argv)
    print(f"median ms per decode step (median of {a.rounds} rounds of {a.steps} steps)")
    print(f"{'running':>8} " + " ".join(f"{m:>11}" for m in MODES) + "   off vs bare")
    for n in a.running:
        per_mode: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(a.rounds):
            for m in MODES:                        # interleaved, so drift hits every mode alike
                per_mode[m].append(run_mode(m, n, a.steps, a.vocab))
        med = {m: statistics.median(v) for m, v in per_mode.items()}
        delta = (med["off"] - med["bare"]) / med["bare"] * 100
        print(f"{n:>8} " + " ".join(f"{med[m]:>11.3f}" for m in MODES) + f"   {delta:+.1f}%")


if __name__ == "__main__":
    main()
