"""Cost of structured outputs: constrained against unconstrained decoding in the engine.

The real EngineCore and model (the default one unless --model), in-process (no HTTP), decode
throughput with C requests at once, each generating --max-tokens tokens: plain sampling, then
the same requests constrained by a JSON schema that never completes within --max-tokens (an
array of at least 1000 objects), so both runs make exactly the same number of tokens:

    .venv/bin/python -m ringserve.tools.bench_structured --concurrency 1 16 [--json FILE]

Per constrained row and token: `mask us` is llguidance's bitmask (engine/structured_outputs.py
StructuredOutputs.bitmask, the whole step's call divided by its constrained rows), `advance
us` the matcher's consume_token; the sampler's -inf fill (gpu/sampling/sampler.py
apply_token_bitmask) is inside the throughput. Each figure is the median of --rounds rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from ringserve.engine import core as engine_core
from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.ipc.structured import StructuredOutputsParams
from ringserve.tools.bench_report import BenchRun, Column, add_json_argument, table

# Long, nested and varied: objects with a bounded integer, an enum and a bounded string.
SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "kind": {"enum": ["book", "film", "song"]},
        "title": {"type": "string", "maxLength": 16}},
    "required": ["id", "kind", "title"], "additionalProperties": False}}


class Timers:
    """Seconds in the engine's bitmask and advance calls, and how many rows each served."""

    def __init__(self, engine: EngineCore):
        self.mask_s = self.advance_s = 0.0
        self.mask_rows = self.advances = 0
        bitmask = engine.structured.bitmask

        def timed_bitmask(reqs):
            t0 = time.perf_counter()
            out = bitmask(reqs)
            self.mask_s += time.perf_counter() - t0
            self.mask_rows += sum(r.matcher is not None for r in reqs)
            return out

        engine.structured.bitmask = timed_bitmask  # type: ignore[method-assign]  # this engine only
        advance = engine_core.advance

        def timed_advance(req, token):
            t0 = time.perf_counter()
            out = advance(req, token)
            self.advance_s += time.perf_counter() - t0
            self.advances += 1
            return out

        self._restore = advance
        engine_core.advance = timed_advance  # restored in close()

    def close(self) -> None:
        engine_core.advance = self._restore


def run_once(engine: EngineCore, concurrency: int, max_tokens: int,
             constrained: bool) -> dict[str, float]:
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=max_tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA)
                            if constrained else None)
    timers = Timers(engine) if constrained else None
    try:
        for i in range(concurrency):
            prompt = [t % engine.vocab_size for t in (1, 504, 3158, 288, 253, 1173, 28, 198 + i)]
            engine.add_request(f"{constrained}-{time.monotonic_ns()}-{i}", prompt, params)
        tokens, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += len(out.new_token_ids)
                assert out.finish_reason in (None, "length"), out
        seconds = time.perf_counter() - t0
    finally:
        if timers is not None:
            timers.close()
    row = {"tok_s": tokens / seconds, "tokens": tokens}
    if timers is not None:
        row["mask_us"] = timers.mask_s * 1e6 / max(1, timers.mask_rows)
        row["advance_us"] = timers.advance_s * 1e6 / max(1, timers.advances)
    return row


COLUMNS = [Column("concurrency", "requests", "d"), Column("plain_tok_s", "plain tok/s", ".1f"),
           Column("json_tok_s", "json tok/s", ".1f"), Column("ratio", "json / plain", ".3f"),
           Column("mask_us", "mask us/token/request", ".1f"),
           Column("advance_us", "advance us/token/request", ".1f")]


def measure(engine: EngineCore, concurrency: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    plain, constrained = [], []
    for _ in range(rounds):  # alternated, so that a load change hits both alike
        plain.append(run_once(engine, concurrency, max_tokens, False))
        constrained.append(run_once(engine, concurrency, max_tokens, True))
    p = statistics.median(r["tok_s"] for r in plain)
    c = statistics.median(r["tok_s"] for r in constrained)
    return {"concurrency": concurrency, "plain_tok_s": p, "json_tok_s": c, "ratio": c / p,
            "mask_us": statistics.median(r["mask_us"] for r in constrained),
            "advance_us": statistics.median(r["advance_us"] for r in constrained),
            "tokens": constrained[0]["tokens"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model folder (default: the default model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    add_json_argument(ap)
    args = ap.parse_args(argv)
    engine = EngineCore(EngineConfig.create(model=args.model, device=args.device,
                                            max_model_len=args.max_tokens + 64))
    run_once(engine, 1, 4, True)  # warm: JIT, the llguidance tokenizer, the first grammar
    run = BenchRun.start("bench_structured", args)
    rows = [measure(engine, c, args.max_tokens, args.rounds) for c in args.concurrency]
    run.finish()
    print(run.header())
    print(f"decode of {args.max_tokens} tokens per request on {args.device}, plain vs a JSON "
          f"schema (bitmask + advance per constrained row and token), median of {args.rounds}")
    print(table(rows, COLUMNS))
    run.write(args.json, rows)


if __name__ == "__main__":
    main()
