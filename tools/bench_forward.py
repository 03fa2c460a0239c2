"""CPU forward speed: decode-step time at batch 1, 8, 32 and 64 and prefill throughput of our
forward (gpu/runner.py ModelRunner), beside HF transformers on the same weights in the same run.

    .venv/bin/python -m ringserve.tools.bench_forward [--json FILE]      # ours only: no torch

With the peer (torch is never a ringserve dependency, so it lives in a venv of its own; on the
development machine `pip install torch==2.13.0` takes a local CPU wheel):

    python -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 transformers
    /tmp/refvenv/bin/pip install -e /work/main        # ringserve and its dependencies
    /tmp/refvenv/bin/python -m ringserve.tools.bench_forward --json bench_forward.json

Both sides run the default model folder (ringserve.gpu.loader.model_store.resolve_model(None), the
converted SmolLM2-135M-Instruct) in float32 with the same number of threads (ours: Numba and
BLAS via the runner's num_threads; transformers: torch.set_num_threads). Decode: each of the B
requests has a --context-token prompt in its KV cache (one prompt prefilled, its K/V copied to
every request: same bytes per request as B different prompts, without B prefills); then
--steps decode steps of one token per request, each timed alone, median reported. The peer runs
`model(ids [B, 1], cache=...)` under torch.inference_mode with a DynamicCache of the same
length: one decode forward, no generate() loop. Prefill: one --prefill-tokens prompt in one step.
Each batch size runs on every side before the next size, so that a change in the machine's
load during the run hits both sides alike.

The roofline line: a batch-1 decode step must read every weight once; bytes per token over the
single-thread read bandwidth measured here (a vectorized read of 256 MiB: read_bandwidth) bounds its time.
--op-times: where our decode steps at the first batch size spend their time, each CpuOps call
timed (wall clock, so a parallel linear counts once), the rest being Python between the ops.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.gpu.batch import Batch
from ringserve.gpu.cpu.runner import CpuModelRunner, default_num_threads
from ringserve.gpu.loader.model_store import resolve_model
from ringserve.gpu.runner import ModelRunner
from ringserve.gpu.settings import CacheConfig, DeviceConfig
from ringserve.tools.bench_report import BenchRun, Column, add_json_argument, read_bandwidth, table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder or name (default: the default model)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens already cached per request")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size (median)")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                    help="weight dtype(s) of ours; the peer is always float32")
    ap.add_argument("--activations", nargs="+", default=["auto"], choices=["auto", "int8", "float32"],
                    help="what our quantized weights multiply (serve's --cpu-activation-dtype)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="our KV cache's storage (serve's --kv-cache-dtype; bench_llamacpp serves float16, "
                         "as llama-server's cache)")
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--no-peer", action="store_true", help="skip transformers even if installed")
    ap.add_argument("--op-times", action="store_true",
                    help="time each op of our decode steps at the first batch size (wall clock)")
    add_json_argument(ap)
    args = ap.parse_args(argv)
    for name in ("steps", "prefill_reps", "prefill_tokens"):  # each is a median of timed runs
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


# -- ours ----------------------------------------------------------------------------------

def decode_batch(step: int, context: int, tables: np.ndarray, block_size: int,
                 rng: np.random.Generator, vocab: int) -> Batch:
    """One decode token per request, at position context + step."""
    b: int = tables.shape[0]
    pos = np.full(b, context + step, dtype=np.int32)
    slots = tables[np.arange(b), pos // block_size] * block_size + pos % block_size
    return Batch(input_ids=rng.integers(3, vocab, b).astype(np.int32), positions=pos,
                 slot_mapping=slots.astype(np.int32), query_start_loc=np.arange(b + 1, dtype=np.int32),
                 seq_lens=pos + 1, block_tables=tables)


def prefill_batch(ids: np.ndarray, blocks: np.ndarray, block_size: int) -> Batch:
    n = len(ids)
    pos = np.arange(n, dtype=np.int32)
    return Batch(input_ids=ids.astype(np.int32), positions=pos,
                 slot_mapping=(blocks[pos // block_size] * block_size + pos % block_size).astype(np.int32),
                 query_start_loc=np.array([0, n], dtype=np.int32), seq_lens=np.array([n], dtype=np.int32),
                 block_tables=blocks[None].astype(np.int32))


class Ours:
    """Our ModelRunner, with KV blocks for the largest batch and for the prefill prompt."""

    def __init__(self, model_dir: Path, dtype: str, activations: str, args: argparse.Namespace):
        self.args, self.bs = args, 16
        self.per_req = -(-(args.context + args.steps + 2) // self.bs)
        self.prefill_blocks = np.arange(-(-args.prefill_tokens // self.bs), dtype=np.int32)
        device = DeviceConfig(device="cpu", dtype=dtype, cpu_threads=args.threads,
                              cpu_activation_dtype=activations)
        num_blocks = max(max(args.batch) * self.per_req, len(self.prefill_blocks))
        cache = CacheConfig(block_size=self.bs, num_gpu_blocks_override=num_blocks,
                            kv_cache_dtype=args.kv_cache_dtype)
        runner = ModelRunner(model_dir, device, cache)
        assert isinstance(runner, CpuModelRunner)  # device "cpu": its caches and weights are read here
        self.runner = runner
        self.vocab = self.runner.config.vocab_size
        self.rng = np.random.default_rng(0)
        self.prompt = self.rng.integers(3, self.vocab, args.context)
        self.op_seconds: dict[str, float] = defaultdict(float)  # --op-times: per op name, all timed steps

    def decode(self, b: int) -> float:
        """Median seconds of one decode step of b requests with context-token prompts cached."""
        args, bs, runner = self.args, self.bs, self.runner
        tables = np.arange(b * self.per_req, dtype=np.int32).reshape(b, self.per_req)
        runner.execute(prefill_batch(self.prompt, tables[0], bs))
        cached = tables[0, : -(-args.context // bs)]
        for cache in runner.kv_caches:  # every request gets request 0's prompt K/V, in its own blocks
            for r in range(1, b):
                cache.k[tables[r, : len(cached)]] = cache.k[cached]
                cache.v[tables[r, : len(cached)]] = cache.v[cached]
        runner.execute(decode_batch(0, args.context, tables, bs, self.rng, self.vocab))  # warm-up
        profile = args.op_times and b == args.batch[0]
        if profile:
            self._time_ops()
        times = []
        for step in range(1, args.steps + 1):
            batch = decode_batch(step, args.context, tables, bs, self.rng, self.vocab)
            t0 = time.perf_counter()
            runner.execute(batch)
            times.append(time.perf_counter() - t0)
        if profile:
            self.op_seconds["(between ops)"] = sum(times) - sum(self.op_seconds.values())
            for name in self._timed:
                delattr(runner.ops, name)  # the class's method again
        return statistics.median(times)

    _timed = ("embedding", "linear", "add_rms_norm", "rms_norm", "qk_norm", "attention",
              "silu_mul", "gelu_tanh_mul", "gather_rows", "to_float32")

    def _time_ops(self) -> None:
        """Each op of the runner's CpuOps timed into op_seconds (an instance attribute over the method)."""
        ops = self.runner.ops
        for name in self._timed:
            setattr(ops, name, self._timer(name, getattr(ops, name)))

    def _timer(self, name: str, op: Any) -> Any:
        def timed(*a: Any) -> None:
            t0 = time.perf_counter()
            op(*a)
            self.op_seconds[name] += time.perf_counter() - t0
        return timed

    def prefill(self) -> float:
        """Median seconds of one prefill-tokens prompt in one step."""
        ids = self.rng.integers(3, self.vocab, self.args.prefill_tokens)
        self.runner.execute(prefill_batch(ids[:32], self.prefill_blocks, self.bs))  # warm-up
        times = []
        for _ in range(self.args.prefill_reps):
            t0 = time.perf_counter()
            self.runner.execute(prefill_batch(ids, self.prefill_blocks, self.bs))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def weight_bytes(self) -> int:
        """What a batch-1 decode step reads in full (the embedding: one row, not counted unless
        it doubles as the lm_head)."""
        m = self.runner.weights
        return m.lm_head.nbytes + sum(layer.qkv.nbytes + layer.o.nbytes + layer.gate_up.nbytes
                                      + layer.down.nbytes for layer in m.layers)


# -- the peer -------------------------------------------------------------------------------

class Transformers:
    """HF transformers on the same folder, float32, one decode forward per step."""

    def __init__(self, model_dir: Path, args: argparse.Namespace):
        import torch
        import transformers
        self.torch, self.transformers, self.args = torch, transformers, args
        torch.set_num_threads(args.threads)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.vocab = self.model.config.vocab_size
        self.gen = torch.Generator().manual_seed(0)
        self.version = f"transformers {transformers.__version__}, torch {torch.__version__}"

    def ids(self, *shape: int):
        return self.torch.randint(3, self.vocab, shape, generator=self.gen)

    def decode(self, b: int) -> float:
        args, model = self.args, self.model
        with self.torch.inference_mode():
            cache = self.transformers.DynamicCache(config=model.config)
            model(self.ids(1, args.context), cache=cache, use_cache=True, logits_to_keep=1)
            if b > 1:
                cache.batch_repeat_interleave(b)
            model(self.ids(b, 1), cache=cache, use_cache=True)  # warm-up
            times = []
            for _ in range(args.steps):
                ids = self.ids(b, 1)
                t0 = time.perf_counter()
                model(ids, cache=cache, use_cache=True)
                times.append(time.perf_counter() - t0)
            assert cache.get_seq_length() == args.context + args.steps + 1
        return statistics.median(times)

    def prefill(self) -> float:
        ids = self.ids(1, self.args.prefill_tokens)
        with self.torch.inference_mode():
            self.model(ids[:, :32], use_cache=True, logits_to_keep=1)  # warm-up
            times = []
            for _ in range(self.args.prefill_reps):
                t0 = time.perf_counter()
                self.model(ids, use_cache=True, logits_to_keep=1)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def make_peer(model_dir: Path, args: argparse.Namespace) -> Transformers | None:
    if args.no_peer:
        return None
    try:
        return Transformers(model_dir, args)
    except ImportError:
        return None


# -- report ---------------------------------------------------------------------------------

def side_names(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """Our sides, one per weight dtype and activation type: name -> (dtype, activations)."""
    return {(d if len(args.activations) == 1 else f"{d}_{a}"): (d, a)
            for d in args.dtype for a in args.activations}


def columns(dtypes: list[str], peer: bool) -> list[Column]:
    cols = [Column("batch", "batch", "d")]
    for d in dtypes:
        cols += [Column(f"ours_{d}_ms", f"ours {d} ms/step", ".1f"),
                 Column(f"ours_{d}_tok_s", "tok/s", ".0f")]
    if peer:
        cols += [Column("transformers_ms", "transformers float32 ms/step", ".1f"),
                 Column("transformers_tok_s", "tok/s", ".0f")]
        cols += [Column(f"ratio_{d}", f"tok/s ratio {d}", ".2f") for d in dtypes]
    return cols


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = resolve_model(args.model)
    run = BenchRun.start("bench_forward", args)
    names = side_names(args)
    sides: dict[str, Ours | Transformers] = {
        name: Ours(model_dir, d, a, args) for name, (d, a) in names.items()}
    transformers = make_peer(model_dir, args)
    if transformers:
        sides["peer"] = transformers
    # Side by side for each size, so that a change in the machine's load hits both alike.
    decode: dict[str, dict[int, float]] = {name: {} for name in sides}
    for b in args.batch:
        for name, side in sides.items():
            decode[name][b] = side.decode(b)
    prefill = {name: side.prefill() for name, side in sides.items()}
    ours: dict[str, dict[str, Any]] = {
        d: {"decode_s": decode[d], "prefill_s": prefill[d], "weight_bytes": ours_side.weight_bytes()}
        for d, ours_side in sides.items() if isinstance(ours_side, Ours)}
    peer: dict[str, Any] | None = None
    if transformers:
        peer = {"decode_s": decode["peer"], "prefill_s": prefill["peer"], "version": transformers.version}
    bandwidth = read_bandwidth()
    run.finish()

    rows = []
    for b in args.batch:
        row = {"batch": b}
        for d in names:
            row[f"ours_{d}_ms"] = ours[d]["decode_s"][b] * 1e3
            row[f"ours_{d}_tok_s"] = b / ours[d]["decode_s"][b]
        if peer:
            row["transformers_ms"] = peer["decode_s"][b] * 1e3
            row["transformers_tok_s"] = b / peer["decode_s"][b]
            row.update({f"ratio_{d}": peer["decode_s"][b] / ours[d]["decode_s"][b] for d in names})
        rows.append(row)
    print(run.header())
    print(f"model {model_dir.name}, {args.threads} thread(s), context {args.context}, "
          f"KV cache {args.kv_cache_dtype}, median of {args.steps} decode steps")
    print(table(rows, columns(list(names), peer is not None)))
    n = args.prefill_tokens
    cols = [f"ours {d}" for d in names] + (["transformers float32"] if peer else [])
    pre = [ours[d]["prefill_s"] for d in names] + ([peer["prefill_s"]] if peer else [])
    rates = ", ".join(f"{c} {n / t:.0f} tok/s ({t:.2f} s)" for c, t in zip(cols, pre, strict=True))
    print(f"prefill {n} tokens: " + rates
          + (", ratio " + ", ".join(f"{peer['prefill_s'] / ours[d]['prefill_s']:.2f}x" for d in names)
             if peer else ""))
    for d in names:
        wb = ours[d]["weight_bytes"]
        bound = wb / bandwidth
        achieved = ours[d]["decode_s"][args.batch[0]]
        print(f"roofline {d}: {wb / 1e6:.0f} MB of weights per batch-1 step / {bandwidth / 1e9:.1f} GB/s "
              f"single-thread read = {bound * 1e3:.1f} ms; achieved {achieved * 1e3:.1f} ms "
              f"at batch {args.batch[0]} ({wb / achieved / 1e9:.1f} GB/s)")
    print_op_times(args, sides)
    if peer:
        print(f"peer: {peer['version']}")
    else:
        print("peer: transformers not measured (torch/transformers not installed here, or --no-peer)")
    run.write(args.json, rows, model=str(model_dir),
              prefill={"tokens": n, **{f"ours_{d}_s": ours[d]["prefill_s"] for d in names},
                       **({"transformers_s": peer["prefill_s"]} if peer else {})},
              read_bandwidth_bytes_per_s=bandwidth,
              weight_bytes_per_step={d: ours[d]["weight_bytes"] for d in names},
              peer=peer["version"] if peer else None)


def print_op_times(args: argparse.Namespace, sides: dict[str, Ours | Transformers]) -> None:
    """--op-times: ms per step by op, largest first."""
    if not args.op_times:
        return
    for d, side in sides.items():
        if isinstance(side, Ours):
            spent = sorted(side.op_seconds.items(), key=lambda kv: -kv[1])
            print(f"op times {d}, batch {args.batch[0]}: " + ", ".join(
                f"{name} {sec / args.steps * 1e3:.2f}" for name, sec in spent if sec > 0) + " ms/step")


if __name__ == "__main__":
    main()
