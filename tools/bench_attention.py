"""CPU paged attention for one prompt chunk: the per-token loop (gpu/cpu/attention.py) against
the tiled prefill attention (gpu/cpu/prefill_attention.py) on the same inputs, one layer.

    python -m ringserve.tools.bench_attention --heads 32 --kv-heads 8 --context 4000 --chunk 512
    python -m ringserve.tools.bench_attention --decode 1 --context 4000 --kv-cache-dtype float16 --threads 2

A chunk of --chunk query tokens at the end of a --context-token request (the last chunk of a
chunked prompt: the costliest), its keys in a shuffled paged cache of --kv-cache-dtype. Each
kernel runs once to compile, then --reps times; best wall time and CPU time (process time:
what a busy shared machine stretches least), GFLOP/s of Q K^T and P V, and the largest
difference between the two outputs. With --decode N: N requests decoding one token each at
--context, the loop on one thread against the loop over --threads threads
(attention.py's two drivers), and the K/V bytes a layer reads per second.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from ringserve.gpu.cpu.attention import paged_attention, paged_attention_parallel
from ringserve.gpu.cpu.kv_dtypes import KV_CACHE_DTYPES
from ringserve.gpu.cpu.prefill_attention import prefill_attention
from ringserve.gpu.cpu.tasks import task_counter


def _cache(rng, shape, dtype: str) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated: the values do not matter here
    return x.astype(np.float16).view(np.int16) if dtype == "float16" else x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--context", type=int, default=4000)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=1, help="the tiled kernel's threads (the loop has one)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="instead: N decoding requests at --context, the loop's two drivers")
    args = p.parse_args(argv)
    numba.set_num_threads(args.threads)
    if args.decode:
        return _decode(args)
    rng = np.random.default_rng(0)
    blocks = -(-args.context // args.block_size)
    shape = (blocks + 1, args.block_size, args.kv_heads, args.head_dim)
    k, v = _cache(rng, shape, args.kv_cache_dtype), _cache(rng, shape, args.kv_cache_dtype)
    q = rng.standard_normal((args.chunk, args.heads, args.head_dim)).astype(np.float32)
    kernel_args = (np.arange(args.context - args.chunk, args.context, dtype=np.int32),
                   np.array([0, args.chunk], np.int32), np.array([args.context], np.int32),
                   rng.permutation(blocks + 1)[None, :blocks].astype(np.int32),
                   np.float32(args.head_dim ** -0.5), 0)
    flops = 4 * args.heads * args.head_dim * args.chunk * (args.context - args.chunk / 2)
    outs = []
    for name, kernel in (("loop (attention.py)", paged_attention), ("tiled (prefill_attention.py)",
                                                                    prefill_attention)):
        out = np.empty_like(q)
        wall, cpu = _timed(kernel, q, k, v, kernel_args, out, args.reps)
        print(f"{name:<30} wall {wall * 1e3:8.1f} ms  cpu {cpu * 1e3:8.1f} ms  "
              f"{flops / cpu / 1e9:6.1f} GFLOP/s of CPU time")
        outs.append(out)
    print(f"largest difference: {np.abs(outs[0] - outs[1]).max():.2e}")
    return 0


def _timed(kernel, q, k, v, kernel_args, out, reps: int, more=()) -> tuple[float, float]:
    """Best wall and CPU seconds of reps calls, after one that compiles."""
    kernel(q, k, v, *kernel_args, out, *more)  # compile
    wall = cpu = float("inf")
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        kernel(q, k, v, *kernel_args, out, *more)
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    return wall, cpu


def _decode(args) -> int:
    rng = np.random.default_rng(0)
    n, blocks = args.decode, -(-args.context // args.block_size)
    shape = (n * blocks, args.block_size, args.kv_heads, args.head_dim)
    k, v = _cache(rng, shape, args.kv_cache_dtype), _cache(rng, shape, args.kv_cache_dtype)
    q = rng.standard_normal((n, args.heads, args.head_dim)).astype(np.float32)
    kernel_args = (np.full(n, args.context - 1, np.int32), np.arange(n + 1, dtype=np.int32),
                   np.full(n, args.context, np.int32),
                   rng.permutation(n * blocks).reshape(n, blocks).astype(np.int32),
                   np.float32(args.head_dim ** -0.5), 0)
    kv_bytes = 2 * n * args.context * args.kv_heads * args.head_dim * k.itemsize
    counter = task_counter(n * args.kv_heads)
    outs = []
    for name, kernel, more in (("loop, one thread", paged_attention, ()),
                               (f"loop, {args.threads} thread(s)", paged_attention_parallel,
                                (2**62, counter))):
        out = np.empty_like(q)
        wall, cpu = _timed(kernel, q, k, v, kernel_args, out, args.reps, more)
        print(f"{name:<22} wall {wall * 1e3:8.2f} ms  cpu {cpu * 1e3:8.2f} ms  "
              f"K/V read {kv_bytes / wall / 1e9:6.1f} GB/s")
        outs.append(out)
    print(f"largest difference: {np.abs(outs[0] - outs[1]).max():.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
