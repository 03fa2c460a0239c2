"""Numba's parallel regions on TBB (the ``tbb`` package) where it is installed, else OpenMP.

A CPU step runs ~65-120 parallel regions (one per linear). Under OpenMP each ends at a barrier
that every thread must reach: a thread that the OS has descheduled (the machine's cores are shared
with the HTTP workers, the client, other programs) holds the region until it runs again. On the
2-core VM with other work on both cores, a 2-thread batch-1 step of the Llama-3.2-1B shape took
~1.4-2.2 s against ~0.26 s on one thread (docs/bench_forward.md). TBB's regions end when their
tasks are done, not when every thread has arrived: the calling thread runs the tasks nobody has
taken, so a busy machine costs a region at most the task a late thread already holds, and the
same step took ~0.30 s. With a core to spare both layers split the work alike.

pip puts libtbb.so.12 in the environment's lib folder, where the dynamic loader does not look, so
Numba's own check (``CDLL("libtbb.so.12")``) would not find it: it is loaded here first, by path
(the loader then resolves that name to it). Numba keeps its default order (tbb, omp,
workqueue); NUMBA_THREADING_LAYER still chooses.
"""
from __future__ import annotations

import ctypes
import importlib.metadata

LIBTBB = "libtbb.so.12"


def load_tbb() -> bool:
    """Whether libtbb is loaded in this process (the tbb package's, or one the loader finds)."""
    try:
        ctypes.CDLL(LIBTBB, mode=ctypes.RTLD_GLOBAL)
        return True
    except OSError:
        pass
    try:
        files = importlib.metadata.distribution("tbb").files or []
    except importlib.metadata.PackageNotFoundError:
        return False
    for f in files:
        if f.name == LIBTBB:
            try:
                ctypes.CDLL(str(f.locate()), mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                return False
    return False
