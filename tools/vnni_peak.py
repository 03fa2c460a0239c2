"""The ceiling of the CPU's int8 GEMM: how many 512-bit `vpdpbusd` (64 int8 multiply-adds each)
a core retires a second with nothing else to do, on one thread and on every core at once.

    python -m ringserve.tools.vnni_peak [--chains 12] [--seconds 1]

A loop of `chains` independent accumulator chains (enough to hide the instruction's latency),
compiled by LLVM (llvmlite, Numba's) for this CPU and called through ctypes, which releases the
GIL: the threads run at once. gpu/cpu/int8_kernels.py's tiles do the same multiply-adds plus
the nibble unpacking and the per-sub-block float epilogue, on the same vector pipes; their
G multiply-adds/s over this figure is how much of the ceiling they reach (docs/bench_quant.md).
Only where `has_vnni` (AVX-512 VNNI): elsewhere it says so and exits 1.

    python -m ringserve.tools.vnni_peak --beside all

also measures what the tiles' other vector instructions cost beside `vpdpbusd`: the same loop
with 4 and then 8 chains of one 512-bit instruction each (BESIDE) added to the 12 `vpdpbusd`,
and the extra time per added instruction in `vpdpbusd` slots (the base loop's time / 12). 1.0:
it takes the pipes `vpdpbusd` runs on; 0: it runs beside them. On the Zen 4 VM of
docs/bench_quant.md a byte shift (LLVM's gf2p8affineqb) and a float multiply-add take a slot
each, and so does `vpmulld`; word shifts and integer adds none.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable

MACS_PER_INSTRUCTION = 64   # 16 int32 lanes x 4 byte products
# The 512-bit instructions the int8 tiles run beside vpdpbusd (--beside): name -> what it is
# (_beside_op writes each as one instruction a chain and iteration)
BESIDE = {
    "byte-shift": "a byte shift (x86 has none: LLVM's gf2p8affineqb)",
    "word-shift": "vpsrlw",
    "add": "vpaddd (as the ANDs and adds of the unpacking)",
    "fma": "vfmadd (the float epilogue)",
    "convert": "vcvtdq2ps",
    "mulld": "vpmulld",
}


def _beside_op(b, kind: str, x):
    """One instruction of kind (BESIDE) on x, a <16 x i32>: its result, of x's type."""
    from llvmlite import ir
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    v16, v16f = ir.VectorType(i32, 16), ir.VectorType(f32, 16)

    def as_(ty, value):
        return b.bitcast(value, ty)
    if kind == "byte-shift":
        v64b = ir.VectorType(i8, 64)
        return as_(v16, b.lshr(as_(v64b, x), ir.Constant(v64b, [1] * 64)))
    if kind == "word-shift":
        v32w = ir.VectorType(i16, 32)
        return as_(v16, b.lshr(as_(v32w, x), ir.Constant(v32w, [1] * 32)))
    if kind == "add":
        return b.add(x, ir.Constant(v16, [1] * 16))
    if kind == "fma":
        product = b.fmul(as_(v16f, x), ir.Constant(v16f, [0.5] * 16), flags=["contract"])
        return as_(v16, b.fadd(product, ir.Constant(v16f, [1.0] * 16), flags=["contract"]))
    if kind == "convert":
        return as_(v16, b.sitofp(x, v16f))
    if kind == "mulld":  # NOTE: a constant LLVM cannot write as adds and shifts (x * 3: two vpaddd)
        return b.mul(x, ir.Constant(v16, [0x12345679] * 16))
    raise ValueError(f"unknown instruction {kind!r}: one of {', '.join(BESIDE)}")


def compile_probe(chains: int, beside: str | None = None, count: int = 0) -> Callable[[int], int]:
    """run(n): n iterations of `chains` vpdpbusd, each on its own accumulator, and `count`
    chains of one `beside` instruction (BESIDE) each."""
    import llvmlite.binding as llvm
    from llvmlite import ir
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    i32, i64 = ir.IntType(32), ir.IntType(64)
    v16 = ir.VectorType(i32, 16)
    module = ir.Module()
    module.triple = llvm.get_process_triple()
    vpdpbusd = ir.Function(module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.x86.avx512.vpdpbusd.512")
    fn = ir.Function(module, ir.FunctionType(i32, [i64]), "run")
    entry, loop, done = (fn.append_basic_block(name) for name in ("entry", "loop", "done"))
    b = ir.IRBuilder(entry)
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), entry)
    weights = ir.Constant(v16, [0x01020304] * 16)
    accs: list = []
    others: list = []
    for k in range(chains + count):  # NOTE: each chain starts apart, so LLVM cannot merge them
        acc = b.phi(v16)
        acc.add_incoming(ir.Constant(v16, [k] * 16), entry)
        (accs if k < chains else others).append(acc)
    # NOTE: three activation vectors, not one a chain: the registers then hold every chain (a
    # spill to the stack would be timed with the instruction beside)
    activations = [ir.Constant(v16, [k + 3] * 16) for k in range(3)]
    sums = [b.call(vpdpbusd, [acc, weights, activations[k % 3]]) for k, acc in enumerate(accs)]
    sums += [_beside_op(b, beside or "", x) for x in others]
    for acc, s in zip(accs + others, sums, strict=True):
        acc.add_incoming(s, loop)
    nxt = b.add(i, ir.Constant(i64, 1))
    i.add_incoming(nxt, loop)
    b.cbranch(b.icmp_unsigned("<", nxt, fn.args[0]), loop, done)
    b.position_at_end(done)
    total = ir.Constant(v16, [0] * 16)
    for s in sums:
        total = b.add(total, s)
    b.ret(b.extract_element(total, ir.Constant(i32, 0)))
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    assembly = machine.emit_assembly(parsed)  # what the probe runs (tests check its instructions)
    engine = llvm.create_mcjit_compiler(parsed, machine)
    engine.finalize_object()
    run = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64)(engine.get_function_address("run"))
    run.engine = engine  # type: ignore[attr-defined]  # NOTE: the code lives as long as the engine
    run.assembly = assembly  # type: ignore[attr-defined]
    return run


def rates(run: Callable[[int], int], chains: int, threads: int, seconds: float) -> list[float]:
    """G multiply-adds/s of each of `threads` threads running the probe at once for ~seconds."""
    t = time.perf_counter()
    run(100_000)
    per_second = 100_000 / max(time.perf_counter() - t, 1e-6)
    n = max(int(per_second * seconds), 1)
    out = [0.0] * threads
    start = threading.Barrier(threads)

    def one(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        run(n)
        out[i] = n * chains * MACS_PER_INSTRUCTION / (time.perf_counter() - t0) / 1e9

    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return out


def slots_beside(chains: int, kind: str, counts: tuple[int, ...], seconds: float) -> list[float]:
    """vpdpbusd slots each added `kind` instruction (BESIDE) takes beside `chains` vpdpbusd chains
    (one thread), with each of `counts` of them added: the extra time per added instruction over
    the base loop's per vpdpbusd, against one base measured beside them. The best of three runs
    each (a slow moment of the machine is not an instruction's cost)."""
    def best(run: Callable[[int], int]) -> float:
        return max(rates(run, chains, 1, seconds / 3)[0] for _ in range(3))
    base = best(compile_probe(chains))
    return [(base / best(compile_probe(chains, kind, n)) - 1) * chains / n for n in counts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringserve.tools.vnni_peak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chains", type=int, default=12, help="independent accumulators (default 12)")
    p.add_argument("--seconds", type=float, default=1.0, help="each measurement's length")
    p.add_argument("--beside", nargs="+", choices=[*BESIDE, "all"], default=[],
                   help="also: what each of these instructions costs beside vpdpbusd (one thread)")
    args = p.parse_args(argv)
    if args.chains < 1 or not 0 < args.seconds <= 60:
        p.error("--chains must be >= 1 and --seconds in (0, 60]")
    from ringserve.gpu.cpu.int8_kernels import has_vnni
    if not has_vnni():
        print("this CPU has no AVX-512 VNNI: the int8 kernels do not run here", file=sys.stderr)
        return 1
    run = compile_probe(args.chains)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    one = rates(run, args.chains, 1, args.seconds)[0]
    every = rates(run, args.chains, cores, args.seconds)
    print("| threads | G vpdpbusd/s a thread | G int8 multiply-adds/s a thread | all threads |")
    print("|---:|---:|---:|---:|")
    print(f"| 1 | {one / MACS_PER_INSTRUCTION:.2f} | {one:.0f} | {one:.0f} |")
    print(f"| {cores} | {min(every) / MACS_PER_INSTRUCTION:.2f}-{max(every) / MACS_PER_INSTRUCTION:.2f} "
          f"| {min(every):.0f}-{max(every):.0f} | {sum(every):.0f} |")
    kinds = list(BESIDE) if "all" in args.beside else args.beside
    if kinds:
        print(f"\n| beside {args.chains} vpdpbusd chains | instruction | vpdpbusd slots each, 4 added "
              "| 8 added |")
        print("|---|---|---:|---:|")
    for kind in kinds:
        four, eight = slots_beside(args.chains, kind, (4, 8), args.seconds)
        print(f"| {kind} | {BESIDE[kind]} | {four:.2f} | {eight:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
