"""Engine CPU overhead per step: schedule, input preparation, update (sampling + stops).

The runner here returns random logits instead of running a model, so that only the engine's
own work is timed. Steady decode with N running requests:

    .venv/bin/python -m ringserve.tools.bench_engine --running 64 256 1024
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.engine.inputs import build_batch
from ringserve.engine.sampling_params import SamplingParams
from ringserve.gpu.runner import sample_on_host


class RandomLogitsRunner:
    """The ModelRunner face (config, block_size, num_blocks, execute) without a model."""

    def __init__(self, vocab_size: int, num_blocks: int, block_size: int = 16):
        self.config = SimpleNamespace(vocab_size=vocab_size, eos_token_ids=(),
                                      max_position_embeddings=1 << 20)
        self.block_size, self.num_blocks = block_size, num_blocks
        self._logits = np.random.default_rng(0).normal(size=(4096, vocab_size)).astype(np.float32)
        self._row = 0

    def execute(self, batch) -> np.ndarray:
        self._row = (self._row + 1) % 64
        return self._logits[self._row:self._row + batch.num_reqs]

    def submit(self, batch, rows, metadata, prompt_logprobs=None):  # no prompt logprobs asked here
        return sample_on_host(self.execute(batch), rows, metadata)


def bench(num_running: int, steps: int, vocab: int, prompt_len: int = 32) -> dict[str, float]:
    num_blocks = num_running * ((prompt_len + steps + 64) // 16 + 1)
    engine = EngineCore(EngineConfig(max_num_seqs=num_running, max_num_batched_tokens=1 << 20),
                        runner=RandomLogitsRunner(vocab, num_blocks))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    rng = np.random.default_rng(1)
    for i in range(num_running):
        engine.add_request(str(i), rng.integers(0, vocab, prompt_len).tolist(), params)
    engine.step()                                  # every prompt prefilled: now steady decode
    t = dict(schedule=0.0, prepare=0.0, execute=0.0, update=0.0)
    for _ in range(steps):
        t0 = time.perf_counter()
        sched = engine.scheduler.schedule()
        t1 = time.perf_counter()
        batch = build_batch(sched, engine.kv)
        t2 = time.perf_counter()
        logits = engine.runner.execute(batch)
        t3 = time.perf_counter()
        reqs = [s.request for s in sched.scheduled]  # steady decode: every row is sampled
        result = sample_on_host(logits, np.arange(len(reqs)), engine._sampling_metadata(reqs)).result()
        engine.scheduler.update_after_step(sched)
        engine.update(reqs, result)
        t4 = time.perf_counter()
        assert len(sched.scheduled) == num_running
        for k, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            t[k] += dt
    return {k: v / steps * 1e3 for k, v in t.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=1024,
                    help="logits width (sampling cost grows with it; 49152 for SmolLM2)")
    args = ap.parse_args()
    print(f"{'running':>8} {'schedule':>9} {'prepare':>9} {'update':>9} {'engine ms/step':>15}")
    for n in args.running:
        r = bench(n, args.steps, args.vocab)
        total = r["schedule"] + r["prepare"] + r["update"]
        print(f"{n:>8} {r['schedule']:>9.3f} {r['prepare']:>9.3f} {r['update']:>9.3f} {total:>15.3f}")


if __name__ == "__main__":
    main()
