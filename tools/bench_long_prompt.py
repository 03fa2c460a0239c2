"""In process, one long prompt through EngineCore: its time to first token, then the decode per
token after it (wall and this process's CPU time: a busy shared machine stretches wall time, hardly
CPU time).

    python -m ringserve.tools.bench_long_prompt --model default --prompt-len 2000 --output-len 48 \
        cpu_threads=1 kv_cache_dtype=float16 max_num_batched_tokens=15

Trailing NAME=VALUE pairs are engine settings (EngineConfig's flat names). max_num_batched_tokens=15
prefills in chunks of 15 tokens, below gpu/cpu/prefill_attention.py's SERVED_MIN_TOKENS: the prompt's
attention then runs on the per-token loop, the same tree's baseline for the tiled path.
"""
from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.gpu.loader.model_store import resolve_model
from ringserve.ipc.sampling_params import SamplingParams


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="a model folder, .gguf or name (default: ours)")
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("settings", nargs="*", metavar="NAME=VALUE", help="engine settings")
    args = p.parse_args(argv)
    settings = dict(s.split("=", 1) for s in args.settings)
    engine_args = {k: int(v) if v.isdigit() else v for k, v in settings.items()}
    model = str(resolve_model(None if args.model == "default" else args.model))
    core = EngineCore(EngineConfig.create(model=model, max_model_len=args.prompt_len + args.output_len + 16,
                                          **engine_args))
    ids = np.random.default_rng(int(time.time())).integers(1000, 20000, args.prompt_len).tolist()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    core.add_request("long", ids, params)
    t0, c0 = time.perf_counter(), cpu_seconds()
    times, cpus = [], []
    while core.has_unfinished_requests():
        for _ in core.step():
            times.append(time.perf_counter())
            cpus.append(cpu_seconds())
    gaps = np.diff(times) * 1e3
    per_token = (cpus[-1] - cpus[0]) / len(gaps) * 1e3
    print(f"prompt {args.prompt_len}: TTFT {times[0] - t0:.2f} s wall, {cpus[0] - c0:.1f} s CPU; "
          f"decode after it: p50 {np.median(gaps):.1f} ms wall, {per_token:.1f} ms CPU per token "
          f"over {len(gaps)} tokens", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
