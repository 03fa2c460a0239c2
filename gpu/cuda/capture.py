"""CUDA graph capture that fails safe, without CuPy so that CI runs it over a stand-in stream.

A capture that raises must still end (a stream left capturing turns every later launch on it
into an error), is logged with its reason, and costs only its own batch size: that size runs
eager (plan.GraphTable.pick finds no graph for it). While a capture runs, allocation raises:
a temporary made inside the forward would bake one pool block into the graph, which the
pool may hand to someone else after the capture (silent corruption on every replay).
"""
from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Any, Callable

from ringserve.gpu.cuda.plan import GraphTable

log = logging.getLogger(__name__)


class AllocationDuringCapture(RuntimeError):
    pass


def refuse_allocation(nbytes: int) -> Any:
    """A CuPy allocator (cupy.cuda.using_allocator) for the time of a capture."""
    raise AllocationDuringCapture(
        f"a {nbytes}-byte device allocation during CUDA graph capture: every buffer a graph "
        "touches must exist before its capture (StepBuffers, the attention workspace)")


def capture(stream: Any, fn: Callable[[], None],
            no_allocation: Callable[[], AbstractContextManager]) -> Any:
    """fn()'s launches on stream as a graph (stream: begin_capture / end_capture /
    is_capturing, as cupy.cuda.Stream). If fn raises, the capture is ended all the same and
    fn's exception propagates (ending an invalidated capture may raise too: fn's error is the
    reason, so that one is the one reported)."""
    stream.begin_capture()
    completed = False
    graph = None
    try:
        with no_allocation():
            fn()
        completed = True
    finally:
        try:
            graph = stream.end_capture()
        except Exception:
            if completed:
                raise
    if stream.is_capturing():  # pragma: no cover - cuda says it ended
        raise RuntimeError("the stream is still capturing after end_capture")
    return graph


def capture_ladder(table: GraphTable, capture_size: Callable[[int], Any]) -> dict[int, str]:
    """capture_size(size) -> graph for each ladder size, largest first (the first capture
    sizes the shared buffers' pool use); a size whose capture raises is logged and left out
    of the table (it runs eager). Returns the failures, size -> reason."""
    failed: dict[int, str] = {}
    for size in reversed(table.sizes):
        t = time.perf_counter()
        try:
            graph = capture_size(size)
        except Exception as e:  # one size's failure must not cost the server or the others
            failed[size] = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture for batch size %d failed, that size runs eager: %s",
                        size, failed[size])
            continue
        table.add(size, graph, time.perf_counter() - t)
    return failed
