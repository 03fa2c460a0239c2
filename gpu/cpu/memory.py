"""Memory for what a CPU decode step streams (packed weights, the KV cache) on 2 MiB transparent
huge pages where Linux offers them (``madvise`` mode, the common default).

numpy's arrays come from malloc on 4 KiB pages. A decode step reads every weight once: on 4 KiB
pages it takes a TLB miss every 4 KiB and the hardware prefetchers stop at each page boundary, so
the many small matrices of a small model stream at 14-20 GB/s where one large one streams at 30
(docs/bench_forward.md has the figures). Anonymous mappings advised ``MADV_HUGEPAGE`` *before*
they are touched are faulted in as huge pages instead. The arrays keep their dtypes and shapes:
only where their bytes live changes. Where the advice does not exist (not Linux) or is refused,
the mappings are plain anonymous memory, which is what malloc would have given.
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
from typing import Any

import numpy as np

HUGE_PAGE = 2 << 20
CHUNK = 16 * HUGE_PAGE   # a bump chunk: small tensors share one; a tensor above it gets its own
ALIGN = 64               # a cache line: what the kernels' vector loads like


def _mapping(size: int) -> mmap.mmap:
    """An anonymous mapping of size bytes (a whole number of huge pages), advised huge."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:  # NOTE: THP "never", or a kernel without it: plain pages, as malloc's
            pass
    return m


class HugePageArena:
    """Bump allocation of arrays in huge-page mappings, kept alive as long as the arena is. The
    last chunk's tail is the only waste (< CHUNK)."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []
        self._free: np.ndarray | None = None   # the current chunk's unused bytes

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        if size > CHUNK // 4:  # NOTE: a large tensor gets a mapping of its own, not a chunk's tail
            m = _mapping(-(-size // HUGE_PAGE) * HUGE_PAGE)
            self._maps.append(m)
            return np.frombuffer(m, np.uint8, nbytes).view(dt).reshape(shape)
        if self._free is None or self._free.size < size:
            m = _mapping(CHUNK)
            self._maps.append(m)
            self._free = np.frombuffer(m, np.uint8)
        block, self._free = self._free[:size], self._free[size:]
        return block[:nbytes].view(dt).reshape(shape)

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return self.empty(shape, dtype)  # NOTE: fresh anonymous memory reads as zeros

    def copy(self, a: np.ndarray) -> np.ndarray:
        out = self.empty(a.shape, a.dtype)
        out[...] = a
        return out

    def place(self, value: Any) -> Any:
        """value with every numpy array in it (an array, or a frozen dataclass of arrays and
        of such dataclasses, as gpu/cpu/packed.py's weights are) copied into the arena; what
        holds no array is returned as it is."""
        if isinstance(value, np.ndarray):
            return self.copy(value)
        if isinstance(value, tuple):
            placed = tuple(self.place(v) for v in value)
            return value if all(a is b for a, b in zip(placed, value, strict=True)) else placed
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {}
            for f in dataclasses.fields(value):
                old = getattr(value, f.name)
                if (new := self.place(old)) is not old:
                    changes[f.name] = new
            return dataclasses.replace(value, **changes) if changes else value
        return value


M_MMAP_THRESHOLD = -3           # glibc's mallopt parameter (malloc.h)
STEP_MMAP_THRESHOLD = 4 << 20   # a block at least this large gets a mapping of its own


def map_large_blocks() -> bool:
    """glibc's malloc, for this process from now on: every block of at least
    STEP_MMAP_THRESHOLD bytes a mapping of its own, unmapped when freed. glibc's own threshold
    starts at 128 KiB and rises to the largest block freed so far (up to 32 MiB), so after one
    long prefill the activations of every later step (a 512-token step's are 4-8 MB each) come
    from the heap, and what they leave free there stays resident, scattered between live blocks:
    a 1B serving engine held ~60 MB of such heap after mixed step sizes (docs/bench_quant.md).
    Decode steps' activations are smaller and stay on the heap, where mapping them per step
    would cost page faults. False where the C library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD) == 1
