"""Speculative decoding, with and without, in the same run (docs/speculative.md).

For each workload and concurrency c, c requests are generated together by the offline LLM
(the real engine and model, in this process), once without and once with --speculative-config;
output tokens per second (all c requests' tokens over the wall time) and, with speculation,
the acceptance rate (accepted / draft tokens) and the mean tokens per verify step:

    .venv/bin/python -m ringserve.tools.bench_spec --concurrency 1 4 16 [--model M]
    python -m ringserve.tools.bench_spec --device cuda --sweep-shape 1B --concurrency 1   # a GPU

    python -m ringserve.tools.bench_spec --draft-model DRAFT.gguf [--num-speculative-tokens K]
    python -m ringserve.tools.bench_spec --device cuda --sweep-shape 1B --draft-sweep-shape tiny --with-ngram

--draft-model speculates with a draft model ({"model": DRAFT, "num_speculative_tokens": K}) in
place of --speculative-config's n-gram default; --with-ngram measures both, a row each (the
table's first column). --draft-sweep-shape: the serve sweep's random model of that shape as the
draft (tools/serve_sweep.py's shapes share one vocabulary; random weights are almost never
right, so that row is what a cheap draft's forwards cost). On CUDA every engine gets an equal
share of --gpu-memory-utilization (they live in one process).

Workloads: `copy` ("repeat this code with one change": greedy, the output mostly copies the
prompt, where n-gram drafts are accepted) and `random` (a prompt of random token ids, sampled
at temperature 0.8: drafts are rarely right, so this is what failed drafts cost). The two
engines are built once each and warmed up on one request first (Numba's compile is not timed).
--sweep-shape: the serve sweep's random-weight model of that shape (tools/serve_sweep.py
model_dir, written on first use) in --dtype, as tools/device_run.py measures a GPU.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ringserve.ipc.sampling_params import SamplingParams
from ringserve.server.llm import LLM

FUNCS = ["add", "sub", "mul", "div", "mod", "pow", "max", "min", "avg", "neg", "inc", "dec",
         "sq", "cube", "half", "twice"]


def copy_prompts(c: int) -> list[str]:
    """c code-editing prompts, each its own code (no prefix-cache help between them)."""
    out = []
    for i in range(c):
        names = [FUNCS[(i + j) % len(FUNCS)] for j in range(4)]
        code = "".join(f"def {n}_{i}(a, b):\n    \"\"\"{n} of a and b.\"\"\"\n    result = a + b * {j}\n"
                       f"    return result\n\n\n" for j, n in enumerate(names))
        out.append(f"<|im_start|>user\nRepeat this code exactly, but rename {names[0]}_{i} to "
                   f"first_{i}:\n\n{code}<|im_end|>\n<|im_start|>assistant\n")
    return out


def random_prompts(c: int, vocab: int, rng: np.random.Generator) -> list[list[int]]:
    return [rng.integers(100, vocab - 100, 64).tolist() for _ in range(c)]


def run(llm: LLM, prompts, params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sweep-shape", default=None, help="the serve sweep's random model of this shape")
    ap.add_argument("--dtype", default="bfloat16", help="--sweep-shape's weights (default bfloat16)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculative-config", default=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
         "disable_by_batch_size": 64}))
    ap.add_argument("--draft-model", default=None,
                    help="speculate with this draft model (a folder, a GGUF or an id) instead")
    ap.add_argument("--draft-sweep-shape", default=None,
                    help="the serve sweep's random model of this shape (in --dtype) as --draft-model")
    ap.add_argument("--with-ngram", action="store_true",
                    help="with a draft model, also --speculative-config's n-gram: a row each")
    ap.add_argument("--num-speculative-tokens", type=int, default=3, help="K with --draft-model")
    ap.add_argument("--workloads", nargs="+", default=["copy", "random"])
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="threads per step (default: the engine's); 1 on a machine others load")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="cuda: the share of the device all the engines together take")
    args = ap.parse_args(argv)
    from ringserve.tools.serve_sweep import model_dir
    if args.sweep_shape:
        args.model = str(model_dir(args.sweep_shape, args.dtype))
    if args.draft_sweep_shape:
        args.draft_model = str(model_dir(args.draft_sweep_shape, args.dtype))
    configs = {"ngram": args.speculative_config}
    if args.draft_model is not None:
        draft = {"draft": json.dumps({"model": args.draft_model, "disable_by_batch_size": 64,
                                      "num_speculative_tokens": args.num_speculative_tokens})}
        configs = {**configs, **draft} if args.with_ngram else draft
    # max_num_seqs: the largest concurrency (on CUDA: graphs captured for no more)
    common = dict(device=args.device, max_model_len=1024, max_num_seqs=max(args.concurrency),
                  cpu_threads=args.cpu_threads)
    if args.device == "cuda":  # NOTE: one process, 1 + len(configs) engines: each its share
        common["gpu_memory_utilization"] = args.gpu_memory_utilization / (1 + len(configs))
    plain = LLM(args.model, **common)
    specs = {name: LLM(args.model, **common, speculative_config=config) for name, config in configs.items()}
    warm = SamplingParams(temperature=0, max_tokens=8)
    for llm in (plain, *specs.values()):
        llm.generate(copy_prompts(1), warm)
    rng = np.random.default_rng(0)
    print(f"{args.model or 'the default model'} on {args.device}; speculative configs: {configs}")
    print("| speculation | workload | concurrency | tok/s off | tok/s on | speed-up | acceptance "
          "| tokens/verify |")
    print("|---|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        for c in args.concurrency:
            if workload == "copy":
                prompts: list = copy_prompts(c)
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
            else:
                prompts = random_prompts(c, plain.engine.vocab_size, rng)
                params = SamplingParams(temperature=0.8, seed=1, max_tokens=args.max_tokens, ignore_eos=True)
            for name, spec in specs.items():
                print(f"| {name} | {workload} | {c} | " + _row(plain, spec, prompts, params), flush=True)


def _row(plain: LLM, spec: LLM, prompts, params: SamplingParams) -> str:
    """One table row's measured columns: off and on alternate in the same run."""
    stats = spec.engine.scheduler.speculation.stats  # type: ignore[union-attr]
    t_off, n_off = run(plain, prompts, params)
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    t_on, n_on = run(spec, prompts, params)
    drafts = stats.num_drafts - before[0]
    draft_tokens = stats.num_draft_tokens - before[1]
    accepted = stats.num_accepted_tokens - before[2]
    rate = f"{accepted / draft_tokens:.0%}" if draft_tokens else "no drafts"
    per_verify = f"{1 + accepted / drafts:.2f}" if drafts else "-"
    return (f"{n_off / t_off:.1f} | {n_on / t_on:.1f} | {(n_on / t_on) / (n_off / t_off):.2f}x | "
            f"{rate} | {per_verify} |")

if __name__ == "__main__":
    main()
