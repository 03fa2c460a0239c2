"""Quantized linear kernels' speed: ``y = x @ W.T`` per GGUF type (gpu/cpu/quant_kernels.py, and
gpu/cpu/int8_kernels.py with int8 activations, VNNI or AMX tiles) in G
weights/s and GB/s of the bytes the packed weight holds, beside float32 through numpy (OpenBLAS
sgemv / sgemm) in the same run, for several batch sizes, shapes and thread counts.

    .venv/bin/python -m ringserve.tools.bench_quant [--threads 1 2] [--batch 1 4 16 64] [--json FILE]

Weights are random valid blocks (gpu/loader/quant.py random_raw), repacked as at load. Each cell is the
best of --repeats timed calls (after one warm-up call), and the whole grid is run --rounds times
keeping each cell's best: the development VM is shared with other busy processes, and the best
time is the one least disturbed by them. Threads: Numba's (parallel=True when more than one) and
BLAS's (threadpoolctl), the same number for both, as the CPU runner sets them.
"""
from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any, Callable

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from ringserve.gpu.cpu.amx_kernels import has_amx, tiles_linear
from ringserve.gpu.cpu.int8_kernels import U6_TYPES, Int8Weight, has_vnni, int8_linear, supports, tiles
from ringserve.gpu.cpu.quant_kernels import quant_linear
from ringserve.gpu.loader.quant import BLOCK_SIZES, SUPPORTED_TYPES, QuantWeight, random_raw, repack
from ringserve.tools.bench_report import BenchRun, add_json_argument, markdown_table, read_bandwidth

NUMPY_F32 = "numpy f32"  # the baseline row: float32 weights through np.matmul (sgemv / sgemm)
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
VNNI = " vnni"  # the suffix of the rows that keep int8 activations on VNNI at every batch


def default_activations() -> list[str]:
    return ["float32"] + (["int8"] if has_vnni() else []) + (["vnni"] if has_vnni() and has_amx() else [])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=list(SUPPORTED_TYPES), choices=SUPPORTED_TYPES)
    ap.add_argument("--shape", nargs="+", default=["8192x4096", "576x1536"],
                    help="out x in of the weight (default: a Llama-8B-sized one; SmolLM2-135M's down "
                         "projection); a type whose blocks do not tile a row is left out")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--int8-4bit", action="store_true",
                    help="also each 4-bit type repacked as int8 planes (row '<type> i8'), beside its nibbles")
    ap.add_argument("--int8-6bit", action="store_true",
                    help="also each u6 type tiled in int8 bytes (row '<type> x int8 i8'), beside its u6")
    ap.add_argument("--activations", nargs="+", choices=["float32", "int8", "vnni"],
                    default=default_activations(),
                    help="what the integer types multiply: float32 (gpu/cpu/quant_kernels.py) and/or "
                         "int8 blocks as served (gpu/cpu/int8_kernels.py: rows '<type> x int8', VNNI, "
                         "AMX tiles from 16 rows where the CPU has them; the activations' quantization "
                         "included in the time), and/or 'vnni': the same on VNNI at every batch (rows "
                         "'<type> x int8 vnni'; by default where AMX runs)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per cell and round (best kept)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the whole grid (best kept)")
    add_json_argument(ap)
    return ap.parse_args(argv)


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: compile, fault in the scratch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


Weight = np.ndarray | QuantWeight | Int8Weight


def _weights(args: argparse.Namespace, n: int, k: int, rng: np.random.Generator) -> dict[str, Weight]:
    """The float32 peer and every asked type that tiles a row of k, random valid blocks."""
    weights: dict[str, Weight] = {NUMPY_F32: rng.standard_normal((n, k)).astype(np.float32)}
    for qtype in args.types:
        if k % BLOCK_SIZES[qtype][0] == 0:
            raw = random_raw(qtype, (n, k), rng)
            w = repack(raw, qtype, (n, k))
            if "float32" in args.activations:
                weights[qtype] = w
            if args.int8_4bit and qtype in FOUR_BIT and "float32" in args.activations:
                weights[qtype + " i8"] = repack(raw, qtype, (n, k), nibbles=False)
            if supports(w):  # as served: K-quants' scales factored
                factored = repack(raw, qtype, (n, k), factored=True)
                tiled = tiles(factored)
                for activations, name in (("int8", qtype + " x int8"), ("vnni", qtype + " x int8" + VNNI)):
                    if activations in args.activations:
                        weights[name] = tiled
                if "int8" in args.activations and args.int8_6bit and qtype in U6_TYPES:
                    weights[qtype + " x int8 i8"] = tiles(factored, six_bit=False)
    return weights


def _call(name: str, w: Weight, x: np.ndarray, out: np.ndarray, threads: int) -> Callable[[], Any]:
    if isinstance(w, Int8Weight):  # as served: the activations quantized in every call
        linear = int8_linear if name.endswith(VNNI) else tiles_linear
        return partial(linear, x, w, out, parallel=threads > 1)
    if isinstance(w, QuantWeight):
        return partial(quant_linear, x, w, out, parallel=threads > 1)
    return partial(np.matmul, x, w.T, out=out)


def measure(args: argparse.Namespace) -> list[dict]:
    rng = np.random.default_rng(0)
    best: dict[tuple, float] = {}
    info: dict[tuple, tuple[str, float]] = {}  # (shape, type) -> (kind, bytes per weight)
    for shape_text in args.shape:
        n, k = (int(v) for v in shape_text.split("x"))
        weights = _weights(args, n, k, rng)
        xs = {b: rng.standard_normal((b, k)).astype(np.float32) for b in args.batch}
        for name, w in weights.items():
            kind = "f32" if isinstance(w, np.ndarray) else w.kind
            kind += "x16" if isinstance(w, Int8Weight) else ""  # 16-row tiles
            info[shape_text, name] = (kind, w.nbytes / (n * k))
        for _ in range(args.rounds):
            for threads in args.threads:
                numba.set_num_threads(threads)
                with threadpool_limits(limits=threads, user_api="blas"):
                    for name, w in weights.items():
                        for b, x in xs.items():
                            out = np.empty((b, n), np.float32)
                            t = best_time(_call(name, w, x, out, threads), args.repeats)
                            key = (shape_text, threads, name, b)
                            best[key] = min(best.get(key, float("inf")), t)
    rows = []
    for (shape_text, threads, name, b), t in best.items():
        n, k = (int(v) for v in shape_text.split("x"))
        kind, bpw = info[shape_text, name]
        rows.append({"shape": shape_text, "threads": threads, "type": name, "kind": kind, "batch": b,
                     "bytes_per_weight": round(bpw, 4), "seconds": t, "gweights_s": n * k / t / 1e9,
                     "gbytes_s": n * k * bpw / t / 1e9})
    return rows


def render(rows: list[dict], batches: list[int]) -> str:
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for threads in dict.fromkeys(r["threads"] for r in rows):
            sel = [r for r in rows if r["shape"] == shape and r["threads"] == threads]
            by_type: dict[str, dict[int, dict]] = {}
            for r in sel:
                by_type.setdefault(r["type"], {})[r["batch"]] = r
            head = ["type", "kind", "B/weight"] + [f"batch {b}: G w/s (GB/s)" for b in batches]
            lines = []
            for name, cells in by_type.items():
                first = next(iter(cells.values()))
                lines.append([name, first["kind"], f"{first['bytes_per_weight']:.3f}"]
                             + [f"{cells[b]['gweights_s']:.2f} ({cells[b]['gbytes_s']:.1f})"
                                for b in batches])
            out.append(f"W {shape} (out x in), {threads} thread(s):\n\n"
                       + markdown_table(head, lines, ["<", "<", ">"] + [">"] * len(batches)))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = BenchRun.start("bench_quant", args)
    rows = measure(args)
    bandwidth = read_bandwidth()
    print(run.header())
    print(f"single-thread read bandwidth {bandwidth / 1e9:.1f} GB/s (a vectorized read of 256 MiB); "
          f"a batch-1 kernel's GB/s against it is its share of the roofline\n")
    print(render(rows, args.batch))
    run.write(args.json, rows, read_bandwidth_bytes_s=bandwidth)


if __name__ == "__main__":
    main()
