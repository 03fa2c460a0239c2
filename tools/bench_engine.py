"""Engine CPU overhead per step: schedule, input preparation, update (stops, outputs).

The runner here returns random logits instead of running a model, so that only the engine's
own work is timed. Steady decode with N running requests (greedy, ignore_eos, 32-token prompts
all prefilled before the timed steps), the real EngineCore.launch_step / finish_step:

    .venv/bin/python -m ringserve.tools.bench_engine --running 64 256 1024 [--json FILE]

Per step: `schedule` is Scheduler.schedule; `prepare` the rest of launch_step before the
runner (build the Batch, sampling rows and metadata); `update` finish_step (tokens appended,
stop checks, blocks, outputs, stats). `sample` is the runner's time (logits + host sampling
over --vocab columns): on CUDA it is the device's, so it is shown but not counted as engine
overhead. Each phase is the mean over --steps steps; of --rounds fresh engines, the round with
the median engine total is reported. --kv-events: KV-cache events on (engine/kv_events.py), the
step's events taken and handed to a real ZMQ publisher in `update`, as the engine process does.
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.gpu.sampling.sampler import sample_on_host
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.tools.bench_report import BenchRun, Column, add_json_argument, table

PHASES = ("schedule", "prepare", "update")


class RandomLogitsRunner:
    """The ModelRunner face (config, block_size, num_blocks, execute, submit) without a
    model. `seconds` adds up the time spent in submit (the runner's share of a step)."""

    def __init__(self, vocab_size: int, num_blocks: int, block_size: int = 16, max_num_reqs: int = 4096):
        self.config = SimpleNamespace(vocab_size=vocab_size, eos_token_ids=(), uniform_window=0,
                                      max_position_embeddings=1 << 20)
        self.block_size, self.num_blocks = block_size, num_blocks
        # Rows for the largest batch at any of 64 offsets (so that steps see different logits).
        self._logits = np.random.default_rng(0).standard_normal((max_num_reqs + 64, vocab_size), np.float32)
        self._row = 0
        self.seconds = 0.0

    def execute(self, batch) -> np.ndarray:
        self._row = (self._row + 1) % 64
        return self._logits[self._row:self._row + batch.num_reqs]

    def submit(self, batch, rows, metadata, prompt_logprobs=None):  # no prompt logprobs asked here
        t0 = time.perf_counter()
        step = sample_on_host(self.execute(batch), rows, metadata)
        self.seconds += time.perf_counter() - t0
        return step


KV_EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*"}'  # any free port


def decode_engine(num_running: int, steps: int, vocab: int, prompt_len: int = 32,
                  traced: int = 0, kv_events: bool = False) -> EngineCore:
    """An engine with num_running greedy requests, every prompt prefilled (the first `traced`
    of them traced): the next steps are steady decode, enough blocks for steps + 64 more."""
    num_blocks = num_running * ((prompt_len + steps + 64) // 16 + 1)
    config = EngineConfig.create(max_num_seqs=num_running, max_num_batched_tokens=1 << 20,
                                 kv_events_config=KV_EVENTS if kv_events else None)
    engine = EngineCore(config, runner=RandomLogitsRunner(vocab, num_blocks, max_num_reqs=num_running))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    rng = np.random.default_rng(1)
    for i in range(num_running):
        engine.add_request(str(i), rng.integers(0, vocab, prompt_len).tolist(), params,
                           trace=i < traced)
    engine.step()
    return engine


def bench(num_running: int, steps: int, vocab: int, kv_events: bool = False) -> dict[str, float]:
    """Mean milliseconds per decode step of each phase, and `sample` (the runner's)."""
    engine = decode_engine(num_running, steps, vocab, kv_events=kv_events)
    publisher = None
    if kv_events:
        from ringserve.engine.kv_events import ZmqEventPublisher
        publisher = ZmqEventPublisher(engine.config.kv_events, 0)  # type: ignore[arg-type]
        engine.kv.enable_events()  # (after the prefill: only decode steps are timed)
    runner, scheduler = engine.runner, engine.scheduler
    schedule_s = 0.0
    schedule = scheduler.schedule

    def timed_schedule():  # the instance attribute shadows the method for this engine only
        nonlocal schedule_s
        t0 = time.perf_counter()
        out = schedule()
        schedule_s += time.perf_counter() - t0
        return out

    scheduler.schedule = timed_schedule  # type: ignore[method-assign]  # on purpose, see above
    runner.seconds = 0.0
    launch = finish = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        step = engine.launch_step()
        t1 = time.perf_counter()
        outputs = engine.finish_step(step)
        if publisher is not None and (events := engine.kv.take_events()):  # EngineProcess._complete
            publisher.publish(events)
        launch += t1 - t0
        finish += time.perf_counter() - t1
        assert len(outputs) == num_running and not any(o.finished for o in outputs)
    if publisher is not None:
        publisher.shutdown()
    ms = 1e3 / steps
    return {"schedule": schedule_s * ms, "prepare": (launch - schedule_s - runner.seconds) * ms,
            "update": finish * ms, "sample": runner.seconds * ms}


COLUMNS = [Column("running", "running", "d"), Column("schedule_ms", "schedule ms", ".3f"),
           Column("prepare_ms", "prepare ms", ".3f"), Column("update_ms", "update ms", ".3f"),
           Column("engine_ms", "engine ms/step", ".3f"), Column("engine_us_per_req", "us/request", ".2f"),
           Column("sample_ms", "sample ms (runner)", ".3f")]


def measure(num_running: int, steps: int, vocab: int, rounds: int,
            kv_events: bool = False) -> dict[str, Any]:
    """The table row of num_running: the round with the median engine total."""
    results = []
    for _ in range(rounds):
        r = bench(num_running, steps, vocab, kv_events)
        results.append((sum(r[p] for p in PHASES), r))
    results.sort(key=lambda x: x[0])
    total, r = results[(len(results) - 1) // 2]
    return {"running": num_running, **{f"{p}_ms": r[p] for p in PHASES}, "engine_ms": total,
            "engine_us_per_req": total * 1e3 / num_running, "sample_ms": r["sample"],
            "engine_ms_rounds": [t for t, _ in results]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=1024,
                    help="logits width (sampling cost grows with it; 49152 for SmolLM2)")
    ap.add_argument("--kv-events", action="store_true",
                    help="KV-cache events on, published per step (engine/kv_events.py)")
    add_json_argument(ap)
    args = ap.parse_args(argv)
    run = BenchRun.start("bench_engine", args)
    rows = [measure(n, args.steps, args.vocab, args.rounds, args.kv_events) for n in args.running]
    run.finish()
    print(run.header())
    print(f"steady decode, mean per step over {args.steps} steps, median of {args.rounds} rounds; "
          f"engine = schedule + prepare + update; sample over {args.vocab} logits is the runner's"
          + ("; KV-cache events on" if args.kv_events else ""))
    print(table(rows, COLUMNS))
    run.write(args.json, rows)


if __name__ == "__main__":
    main()
