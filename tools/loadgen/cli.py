"""`ringserve loadgen`: the arguments and the command.

    ringserve loadgen --mode ring --concurrency 1,4,16,64 --input-len 64 --output-len 32 \
        --num-prompts 64 --json ring.json --plot ring.png
    ringserve loadgen --mode http --base-url http://127.0.0.1:8080 --request-rate 1,2,4
    ringserve loadgen --compare ring.json http.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

DATASETS = ("random", "prefix", "jsonl")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("every concurrency must be at least 1")
    return values


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers (or inf) separated by commas, "
                                         f"got {text!r}") from None
    if any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError("every request rate must be positive (inf: all at once)")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--mode", choices=("ring", "http"), default="http",
                   help="ring: attach to a local ringserve's engines as a worker does (no HTTP); "
                        "http: any OpenAI-compatible server (default)")
    g.add_argument("--base-url", "--url", dest="base_url", default="http://127.0.0.1:8000",
                   help="the server (ring mode: finds the ringserve serving it on this machine); "
                        "--url: the same, as trace takes it too")
    g.add_argument("--server-dir", default=None,
                   help="ring mode: the server's runtime folder (holds server.json), instead of --base-url")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="http: /v1/completions or /v1/chat/completions")
    g.add_argument("--model", default=None,
                   help="http: the model name to ask for (default: the first of /v1/models)")
    g.add_argument("--api-key",
                   default=os.environ.get("OPENAI_API_KEY") or os.environ.get("RINGSERVE_API_KEY"))
    g.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="http /v1/completions: send token ids, or the text they decode to "
                        "(auto: ids when the server accepts them)")
    g.add_argument("--tokenizer", default=None,
                   help="model folder, .gguf or known name whose vocabulary random prompts are drawn "
                        "from (ring: the server's model; http default: the default model)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=DATASETS, default="random")
    w.add_argument("--dataset-path", default=None, help="jsonl: the file")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (prefix: after the prefix)")
    w.add_argument("--output-len", type=int, default=128, help="tokens to generate (ignore_eos)")
    w.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens of each shared prefix")
    w.add_argument("--num-prefixes", type=int, default=4, help="prefix: how many distinct prefixes")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--seed", type=int, default=0,
                   help="the same seed sends the same prompts: give each run against one server its "
                        "own seed, or it measures that server's prefix cache")
    a = p.add_argument_group("arrivals (a comma list sweeps)")
    m = a.add_mutually_exclusive_group()
    m.add_argument("--concurrency", type=_int_list, default=None,
                   help="requests kept in flight, e.g. 1,4,16,64 (default 1)")
    m.add_argument("--request-rate", type=_rate_list, default=None,
                   help="Poisson arrivals per second, e.g. 1,2,inf")
    a.add_argument("--max-concurrency", type=int, default=None, help="with --request-rate: cap in flight")
    a.add_argument("--num-prompts", type=int, default=None,
                   help="requests per load point (default 100, or unbounded with --duration)")
    a.add_argument("--duration", type=float, default=None, help="seconds per load point to keep issuing")
    a.add_argument("--warmup", type=int, default=1,
                   help="requests sent and discarded before the first point (also checks the set-up)")
    i = p.add_argument_group("a long prompt among decoding streams (tools/loadgen/interference.py)")
    i.add_argument("--long-prompt", type=int, default=None, metavar="TOKENS",
                   help="instead of a sweep: --concurrency N streams decode while one prompt of TOKENS "
                        "arrives; their inter-token latency during its prefill against before it")
    i.add_argument("--long-output-len", type=int, default=64, help="tokens the long prompt generates")
    i.add_argument("--baseline", type=float, default=10.0,
                   help="seconds the streams decode alone before the long prompt is sent")
    r = p.add_argument_group("report")
    r.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    r.add_argument("--json", default=None, metavar="FILE", help="write the run's results as JSON")
    r.add_argument("--plot", default=None, metavar="PNG",
                   help="latency against throughput (needs the `plot` extra: matplotlib)")
    r.add_argument("--compare", nargs="+", default=None, metavar="RUN.json",
                   help="print two (or more) runs side by side (with --plot: all on one chart) and exit")
    r.add_argument("--names", nargs="+", default=None, help="names of the runs in --compare / --plot")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _check(args: argparse.Namespace) -> None:
    for flag in ("input_len", "output_len", "prefix_len", "num_prefixes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.duration is not None and not args.duration > 0:
        raise ValueError("--duration must be positive")
    if args.dataset == "jsonl" and not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")
    if args.max_concurrency is not None and args.request_rate is None:
        raise ValueError("--max-concurrency goes with --request-rate (use --concurrency alone)")
    if args.long_prompt is not None and (args.request_rate is not None or len(args.concurrency or [1]) > 1
                                         or args.long_prompt < 1 or args.dataset != "random"):
        raise ValueError("--long-prompt takes one --concurrency, the random dataset and at least 1 token")


def _loads(args: argparse.Namespace):
    from ringserve.tools.loadgen.runner import Load
    if args.request_rate is not None:
        return [Load(request_rate=r, max_concurrency=args.max_concurrency) for r in args.request_rate]
    return [Load(concurrency=c) for c in (args.concurrency or [1])]


def _token_pool(args: argparse.Namespace, server_model: str | None):
    from ringserve.tools.loadgen.workload import ordinary_token_ids
    folder = server_model if args.tokenizer is None and server_model else None
    if folder is None:
        from ringserve.gpu.loader.model_store import resolve_model
        folder = str(resolve_model(args.tokenizer))
    return folder, ordinary_token_ids(folder)


def _workload(args: argparse.Namespace, pool, rng):
    from ringserve.tools.loadgen import workload
    if args.dataset == "random":
        return workload.random_requests(pool, args.input_len, args.output_len, rng)
    if args.dataset == "prefix":
        return workload.prefix_requests(pool, args.prefix_len, args.num_prefixes, args.input_len,
                                        args.output_len, rng)
    return workload.jsonl_requests(workload.read_jsonl(args.dataset_path, args.output_len), rng)


async def _run(args: argparse.Namespace, slos: dict[str, float]) -> dict[str, Any]:
    import numpy as np

    from ringserve.tools.loadgen.backends import HttpBackend, RingBackend
    from ringserve.tools.loadgen.report import document, format_point, sweep_table
    from ringserve.tools.loadgen.runner import run_load

    server = None
    if args.mode == "ring":
        from ringserve.tools.loadgen.discover import find_server
        server = find_server(None if args.server_dir else args.base_url, args.server_dir)
        longest = (args.prefix_len if args.dataset == "prefix" else 0) + args.input_len + args.output_len
        if args.dataset != "jsonl" and longest > server.max_model_len:
            raise ValueError(f"prompts of {longest - args.output_len} + {args.output_len} output tokens "
                             f"do not fit the server's max_model_len {server.max_model_len}")
    needs_pool = args.dataset != "jsonl" or (args.mode == "http" and args.prompt_format != "text")
    vocab_dir, pool = (_token_pool(args, server.model_dir if server else None) if needs_pool
                       else (args.tokenizer, None))
    backend: RingBackend | HttpBackend
    if server is not None:  # --mode ring
        backend = RingBackend(server, temperature=args.temperature)
    else:
        backend = HttpBackend(args.base_url, endpoint=args.endpoint, model=args.model,
                              api_key=args.api_key, temperature=args.temperature,
                              prompt_format=args.prompt_format, tokenizer_dir=vocab_dir, pool=pool)
    num_prompts = args.num_prompts if args.num_prompts or args.duration else 100
    points = []
    await backend.start()
    try:
        if args.warmup:
            rng = np.random.default_rng([args.seed, 1 << 20])
            warm = _workload(args, pool, rng)
            from ringserve.tools.loadgen.runner import Load
            summary, results = await run_load(backend, warm, Load(concurrency=args.warmup),
                                              num_prompts=args.warmup, duration=None, rng=rng,
                                              progress=False)
            if summary.failed:
                raise RuntimeError(f"the warm-up request failed: {results[0].error}")
        if args.long_prompt is not None:
            return await _long_prompt(args, backend, pool)
        for i, load in enumerate(_loads(args)):
            # Fresh prompts per point: a point must not profit from an earlier one's prefix cache.
            rng = np.random.default_rng([args.seed, i])
            summary, _ = await run_load(backend, _workload(args, pool, rng), load,
                                        num_prompts=num_prompts, duration=args.duration,
                                        rng=np.random.default_rng([args.seed, i, 1]), slos=slos,
                                        progress=not args.no_progress)
            print(format_point(load.label, asdict(summary)), flush=True)
            load_fields = {"concurrency": load.concurrency, "request_rate": load.request_rate
                           if load.request_rate is None or math.isfinite(load.request_rate) else "inf",
                           "max_concurrency": load.max_concurrency}
            points.append((load.label, load_fields, summary))
        description = backend.describe()
    finally:
        await backend.close()
    workload = {k: getattr(args, k) for k in ("dataset", "dataset_path", "input_len", "output_len",
                                              "prefix_len", "num_prefixes", "temperature", "seed",
                                              "num_prompts", "duration", "warmup")}
    if args.dataset != "prefix":
        del workload["prefix_len"], workload["num_prefixes"]
    doc = document({"backend": description, "workload": workload, "goodput_slos_ms": slos}, points)
    if len(points) > 1:
        print(sweep_table(doc["points"]))
    return doc


async def _long_prompt(args: argparse.Namespace, backend, pool) -> dict[str, Any]:
    import numpy as np

    from ringserve.tools.loadgen import interference, workload
    rng = np.random.default_rng([args.seed, 2])
    long = next(workload.random_requests(pool, args.long_prompt, args.long_output_len, rng))
    result = await interference.measure(backend, (args.concurrency or [1])[0],
                                        workload.random_requests(pool, args.input_len, args.output_len, rng),
                                        long, args.baseline)
    print(interference.format_result(result), flush=True)
    return {"format": "ringserve-loadgen-long-prompt/1", "backend": backend.describe(),
            "workload": {k: getattr(args, k) for k in ("input_len", "output_len", "long_prompt",
                                                       "long_output_len", "baseline", "seed")},
            "long_prompt": result, "points": []}


def command(args: argparse.Namespace) -> int:
    from ringserve.tools.loadgen.stats import parse_slos
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("ringserve.client").setLevel(logging.ERROR)  # "client closed" at the end
    try:
        if args.compare:
            _compare(args)
            return 0
        _check(args)
        slos = parse_slos(args.goodput)
        if args.plot:  # fail before the run, not after it
            import importlib.util
            if importlib.util.find_spec("matplotlib") is None:
                raise RuntimeError("--plot needs matplotlib: pip install 'ringserve[plot]'")
        doc = asyncio.run(_run(args, slos))
    except (ValueError, LookupError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.plot:
        _plot([((args.names or [doc["backend"]["mode"]])[0], doc)], args.plot)
    return 0 if all(p["summary"]["completed"] for p in doc["points"]) else 1


def _compare(args: argparse.Namespace) -> None:
    """--compare: earlier runs' --json documents side by side (and plotted with --plot)."""
    from ringserve.tools.loadgen.report import compare, load_document
    if len(args.compare) < 2:
        raise ValueError("--compare needs two or more --json files")
    docs = [load_document(p) for p in args.compare]
    names = list(args.names or [Path(p).stem for p in args.compare])
    if len(names) != len(docs):
        raise ValueError(f"--names needs one name per run ({len(docs)})")
    print(compare(docs, names))
    if args.plot:
        _plot(list(zip(names, docs, strict=True)), args.plot)


def _plot(docs, path) -> None:
    from ringserve.tools.loadgen.plot import plot_sweeps
    plot_sweeps(docs, path)
    print(f"wrote {path}", file=sys.stderr)
