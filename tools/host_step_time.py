"""The engine's host work per decode step outside the runner, on the CPU backend: what a CUDA
device idles through between step N's finish and step N+1's submit. engine/process.py overlaps
only the delivery of step N-1's outputs (and reading the rings) with the device's step N; the
schedule, build_batch and sampling metadata of N+1 (launch_step before runner.submit) and the
update of N (finish_step after its tokens are back) run while the device waits.

    python -m ringserve.tools.host_step_time --model DIR [--batch 256] [--prompt 128] [--steps 30]

B requests of `prompt` tokens (temperature 0.8, top-p 0.9: the sampling metadata a chat load
builds) are prefilled, then each of `steps` decode steps is timed: launch_step less the
runner's submit (whose CPU forward is not host overhead), and finish_step (on the CPU the
tokens are already there: its update alone). Medians in ms.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.ipc.sampling_params import SamplingParams


def host_times(model: str, batch: int, prompt: int, steps: int) -> tuple[float, float]:
    """(launch_step less submit, finish_step), medians over `steps` decode steps, seconds."""
    core = EngineCore(EngineConfig.create(model=model, device="cpu", max_model_len=prompt + steps + 16,
                                          max_num_seqs=batch, max_num_batched_tokens=max(2048, batch)))
    for i in range(batch):
        core.add_request(str(i), list(range(3, 3 + prompt)), SamplingParams(
            temperature=0.8, top_p=0.9, seed=i, max_tokens=steps + 8, ignore_eos=True))
    submitted: list[float] = []
    submit = core.runner.submit

    def timed_submit(*args, **kwargs):
        t = time.perf_counter()
        handle = submit(*args, **kwargs)
        submitted.append(time.perf_counter() - t)
        return handle

    core.runner.submit = timed_submit
    while core.scheduler.waiting or any(r.num_computed_tokens < prompt for r in core.scheduler.running):
        core.step()  # the prefills
    prep, finish = [], []
    for _ in range(steps):
        submitted.clear()
        t0 = time.perf_counter()
        step = core.launch_step()
        t1 = time.perf_counter()
        core.finish_step(step)
        prep.append(t1 - t0 - sum(submitted))
        finish.append(time.perf_counter() - t1)
    return statistics.median(prep), statistics.median(finish)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    prep, finish = host_times(args.model, args.batch, args.prompt, args.steps)
    print(f"host_step_time: batch {args.batch}: launch_step before submit {prep * 1e3:.2f} ms, "
          f"finish_step {finish * 1e3:.2f} ms (medians of {args.steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
