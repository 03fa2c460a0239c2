"""Work sharing inside a Numba parallel region: each thread claims the next task from a shared
counter (an atomic fetch-and-add) until none is left, as llama.cpp's threads take a matmul's
chunks.

A ``prange`` over tasks is split statically: Numba's scheduler and OpenMP's ``omp for`` give
each thread an equal run of iterations up front, so the region ends when the slowest thread
ends. On a machine whose cores are shared (the HTTP workers, the client, another engine) one
thread is often descheduled for a while, and the other, done with its half, waits for it.
Claimed tasks let the thread that runs take the work of the one that does not: the wait at
the join is at most one task. Usage, inside an ``@njit(parallel=True)`` function::

    counter[0] = 0                      # before the region (the fork orders it before the claims)
    for _ in prange(counter[1]):        # the threads to start (task_counter)
        i = claim(counter)
        while i < tasks:
            ...task i...
            i = claim(counter)
"""
from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ringserve.gpu.cpu.linear import per_thread
from ringserve.gpu.cpu.threading_layer import load_tbb

# NOTE: at import, before any parallel region: Numba picks its threading layer at the first one
load_tbb()

# Claimed tasks a thread's share is cut into (linear.py's TASKS_PER_THREAD is its static ranges):
# more even out a late thread (its last task is the most it can hold the others back) at one
# atomic add each; fewer keep each task's rows one long stream for the prefetchers (measured in
# docs/bench_forward.md).
CLAIMED_TASKS_PER_THREAD = 8


@intrinsic
def _fetch_add(typingctx, counter):
    """The value of counter[0] before adding 1 to it, atomically (``lock xadd``)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        # NOTE: monotonic is enough: the region's fork and join order the tasks' writes
        return builder.atomic_rmw("add", ary.data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(counter), codegen


claim: Any = _fetch_add


def task_counter(tasks: int, threads: int | None = None) -> np.ndarray:
    """The calling thread's counter (one region at a time per calling thread: the step's), [1]
    set to the threads a region of `tasks` tasks starts: no more than there are tasks, nor than
    `threads` (by default numba.get_num_threads(); 1: the region on the calling thread alone)."""
    # NOTE: given, not asked for in the region: numba.get_num_threads() in compiled code is a
    # call through a pointer that keeps Numba from caching the function
    counter = per_thread("task counter", _aligned_line)
    counter[1] = min(numba.get_num_threads() if threads is None else threads, tasks)
    return counter


def _aligned_line() -> np.ndarray:
    """8 int64 on a cache line of their own: claims never bounce a line that a kernel writes."""
    buf = np.zeros(16, np.int64)
    first = (-buf.ctypes.data % 64) // 8
    return buf[first:first + 8]


def num_tasks(units: int, threads: int | None = None) -> int:
    """Tasks for a parallel linear of `units` independent row blocks (tiles, rows)."""
    threads = numba.get_num_threads() if threads is None else threads
    return max(1, min(units, CLAIMED_TASKS_PER_THREAD * threads))


def linear_tasks(units: int) -> tuple[int, np.ndarray]:
    """(num_tasks, task_counter) of a parallel linear of `units` row blocks. PERF: one read of
    the thread count (numba.get_num_threads takes two locks, ~1-2 us: a batch-1 decode step
    makes ~70 of these calls)."""
    threads = numba.get_num_threads()
    tasks = num_tasks(units, threads)
    return tasks, task_counter(tasks, threads)
